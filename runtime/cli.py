"""The one ``grstack`` command line: every component (trainer, ranker, router, operator) behind subcommands.

Each subcommand lives in its own module exposing ``register(subparsers)``; modules are imported lazily so
``grstack --help`` and the operator's start-up never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from grstack.runtime.errors import UserError

# (subcommand, module, one-line help). The module's ``register(parser)`` adds arguments and sets ``func``.
SUBCOMMANDS: tuple[tuple[str, str, str], ...] = (
    ("data", "grstack.runtime.data.cli", "import, synthesise and inspect sequence datasets"),
    ("train", "grstack.runtime.train.cli", "train a model from a config"),
    ("eval", "grstack.runtime.eval.cli", "evaluate a trained run (leave-one-out, full ranking)"),
    ("demo", "grstack.runtime.demo", "the main job on one machine: synth data, train, evaluate, report"),
    ("bench", "grstack.runtime.bench.cli", "benchmarks that print JSON"),
    ("serve", "grstack.runtime.serve.cli", "relay-race ranking service: ranker, router, local"),
    ("operator", "grstack.operator.cli", "run the Kubernetes operator"),
    ("crds", "grstack.operator.crds_cli", "write the CRD YAML generated from the pydantic models"),
)


def _available() -> list[tuple[str, str, str]]:
    found = []
    for name, module, help_text in SUBCOMMANDS:
        if importlib.util.find_spec(module.rsplit(".", 1)[0]) is None:
            continue
        try:
            spec = importlib.util.find_spec(module)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            found.append((name, module, help_text))
    return found


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="grstack",
        description="grstack: training and serving for generative recommendation (HSTU) on one machine or Kubernetes.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, module, help_text in _available():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).register(sp)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
