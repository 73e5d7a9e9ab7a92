"""The one ``grstack`` command line: every component (trainer, ranker, router, operator) behind subcommands.

Each subcommand lives in its own module exposing ``register(subparsers)``; modules are imported lazily so
``grstack --help`` and the operator's start-up never import torch. The core install (``pip install
grstack``) carries no torch: each subcommand names the extra it needs, and where that extra is missing the
command says which ``pip install`` adds it instead of failing with a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence

from grstack.runtime import __version__
from grstack.runtime.cli_args import ArgParser
from grstack.runtime.errors import UserError

# The modules each extra of pyproject.toml ([project.optional-dependencies]) installs, by import name.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "train": ("torch", "numpy", "pyarrow", "tqdm", "matplotlib"),
    "serve": ("torch", "numpy", "pyarrow", "aiohttp", "aetcd", "google.protobuf", "psutil"),
    "operator": ("kopf", "kubernetes", "aiohttp"),
}

# (subcommand, module, one-line help, extras it needs beyond the core dependencies). The module's
# ``register(parser)`` adds arguments and sets ``func``.
SUBCOMMANDS: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    ("data", "grstack.runtime.data.cli", "import, synthesise and inspect sequence datasets", ("train",)),
    ("train", "grstack.runtime.train.cli", "train a model from a config", ("train",)),
    ("eval", "grstack.runtime.eval.cli", "evaluate a trained run (leave-one-out, full ranking)", ("train",)),
    ("demo", "grstack.runtime.demo", "the main job on one machine: synth data, train, evaluate, report",
     ("train", "serve")),
    ("bench", "grstack.runtime.bench.cli", "benchmarks that print JSON", ("train", "serve")),
    ("serve", "grstack.runtime.serve.cli", "relay-race ranking service: ranker, router, local", ("serve",)),
    ("operator", "grstack.operator.cli", "run the Kubernetes operator", ("operator",)),
    ("crds", "grstack.operator.crds_cli", "write the CRD YAML generated from the pydantic models", ()),
)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ModuleNotFoundError, ValueError):  # a missing parent package; a module set to None
        return False


def missing_module(extras: tuple[str, ...]) -> str | None:
    """The first module of ``extras`` that cannot be imported here, or None when all of them can."""
    for extra in extras:
        for module in EXTRA_MODULES[extra]:
            if not _importable(module):
                return module
    return None


def needs_message(command: str, module: str, extras: tuple[str, ...]) -> str:
    return f"grstack {command} needs {module.split('.')[0]}: pip install 'grstack[{','.join(extras)}]'"


def _available() -> list[tuple[str, str, str, tuple[str, ...]]]:
    """The subcommands whose package is part of this install."""
    return [entry for entry in SUBCOMMANDS if _importable(entry[1].rsplit(".", 1)[0]) and _importable(entry[1])]


def _refuse(message: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        raise UserError(message)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = ArgParser(  # its errors are UsageErrors, its help shows defaults; subparsers inherit both
        prog="grstack",
        description="grstack: training and serving for generative recommendation (HSTU) on one machine or Kubernetes.",
    )
    parser.add_argument("--version", action="version", version=f"grstack {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module, help_text, extras in _available():
        missing = missing_module(extras)
        if missing is None:
            sp = sub.add_parser(name, help=help_text, description=help_text)
            importlib.import_module(module).register(sp)
            continue
        # Still listed, so `grstack --help` shows the whole product; running it names the missing extra.
        message = needs_message(name, missing, extras)
        sp = sub.add_parser(name, help=f"{help_text} (needs grstack[{','.join(extras)}])",
                            description=f"{help_text}. Not available here: {message}.")
        sp.add_argument("args", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
        sp.set_defaults(func=_refuse(message), needs_extra=True)
    return parser


def _extras_of(command: str | None) -> tuple[str, ...]:
    return next((extras for name, _, _, extras in SUBCOMMANDS if name == command), ())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        # every argument is checked here, before any work starts (a subcommand whose extra is missing
        # takes any arguments: it only says what to install)
        args, unknown = parser.parse_known_args(argv)
        if unknown and not getattr(args, "needs_extra", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except ModuleNotFoundError as exc:
        # A module of an extra that its import check passed over (e.g. a partly installed extra).
        extras = _extras_of(args.command)
        top = (exc.name or "").split(".")[0]
        if not any(top == module.split(".")[0] for extra in extras for module in EXTRA_MODULES[extra]):
            raise
        print(f"error: {needs_message(args.command, top, extras)}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
