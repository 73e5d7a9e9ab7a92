"""``grstack crds --out DIR``: write the CRD YAML generated from the pydantic models."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grstack.runtime.errors import UserError


def register(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", action="append", required=True, metavar="DIR",
                        help="directory to write into (repeatable: crds/ and charts/grstack/crds/)")
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a file in DIR differs from the generated one")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from grstack.operator.crds import rendered_files

    files = rendered_files()
    stale = []
    for out in args.out:
        directory = Path(out)
        if directory.exists() and not directory.is_dir():
            raise UserError(f"--out {out}: not a directory")
        for name, text in files.items():
            target = directory / name
            try:
                current = target.read_text() if target.is_file() else None
            except OSError as exc:
                raise UserError(f"--out {out}: cannot read {target}: {exc.strerror or exc}") from exc
            if current == text:
                continue
            if args.check:
                stale.append(str(target))
                continue
            try:
                directory.mkdir(parents=True, exist_ok=True)
                target.write_text(text)
            except OSError as exc:
                raise UserError(f"--out {out}: cannot write {target}: {exc.strerror or exc}") from exc
            print(f"wrote {target}", file=sys.stderr)
    if stale:
        print("stale: " + ", ".join(stale) + " (run: grstack crds --out crds/ --out charts/grstack/crds/)",
              file=sys.stderr)
        return 1
    return 0
