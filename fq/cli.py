"""The ``fq`` command. Each module in ``fq.commands`` adds its subcommands through
``register(subparsers)``; a subcommand's handler takes the parsed args and returns an exit code.

Every error a user can cause is an ``FqError``: printed as one line ``fq <cmd>: <message>`` on
stderr with exit status 2, never a traceback. Commands check the paths they were given before any work
(``fq.core.paths``); an ``OSError`` that still escapes is printed the same way, as ``fq <cmd>: PATH: reason``.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import fq.commands
from fq.display import printable
from fq.errors import FqError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fq", description="Signed EXL3 bases and cartridges for MoE checkpoints.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for info in sorted(pkgutil.iter_modules(fq.commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"fq.commands.{info.name}")
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except FqError as e:
        print(f"fq {args.command}: {printable(str(e))}", file=sys.stderr)
        return 2
    except OSError as e:  # a safety net: commands check their paths before working; what slips by is one line too
        where = "".join(f"{f}: " for f in (e.filename, e.filename2) if f is not None)
        print(f"fq {args.command}: {printable(where + (e.strerror or str(e)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"fq {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
