"""``fq gate``: the release gate, run before the GPU fleet is released (docs/runbook.md).

Checks that everything finalize needs -- the campaign directory, campaign.json, the signer key, the
recipe and config, the source metadata, the workflow, fq itself and the ``fq``/``snakemake``
executables -- lives on the campaign's filesystem, that no launcher or worker (orphans included) is
running, and that every planned fragment is committed. Exit 0: release; 1: a check failed (each is
named); 2: usage (bad arguments, an unreadable or invalid config).
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from fq.errors import FqError


def rehearsal_flag(value: str) -> bool:
    """Exactly 0 or 1: a release-gate switch is validated strictly, never guessed from 'yes' or 'true'."""
    if value in ("0", "1"):
        return value == "1"
    raise argparse.ArgumentTypeError(f"{value!r}: expected exactly 0 or 1 (0: a real release, every check enforced; "
                                     f"1: a rehearsal on this machine, 'not on the campaign volume' only warns)")


def _default_snakefile() -> str | None:
    import fq

    candidate = Path(fq.__file__).resolve().parent.parent / "Snakefile"
    return str(candidate) if candidate.is_file() else None


def register(sub) -> None:
    p = sub.add_parser("gate", help="release gate: may the GPU fleet be released before finalize? (exit 0/1/2)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configfile", action="append", default=[], metavar="FILE",
                   help="the config file(s) the campaign runs with, as given to snakemake (repeatable)")
    p.add_argument("--directory", "-d", default=".", metavar="DIR",
                   help="snakemake's working directory: relative paths of the config resolve here (default: .)")
    p.add_argument("--snakefile", "-s", default=_default_snakefile(), metavar="FILE",
                   help="the workflow's Snakefile (default: the one beside the installed fq package)")
    p.add_argument("--rehearsal", type=rehearsal_flag, default=False, metavar="0|1",
                   help="1 on a rehearsal that finalizes on this same machine: files off the campaign volume only "
                        "warn. Exactly 0 or 1 (default 0)")
    p.set_defaults(func=run)


def run(args) -> int:
    from fq.workflow.gate import main_report, run_gate

    if not args.snakefile or not Path(args.snakefile).is_file():
        raise FqError(f"--snakefile {args.snakefile!r}: not a file (pass the campaign workflow's Snakefile)")
    snakefile = Path(args.snakefile).resolve()
    configfiles = [Path(c).resolve() for c in args.configfile]
    try:
        os.chdir(args.directory)
    except OSError as e:
        raise FqError(f"--directory {args.directory}: {e.strerror}") from None
    report = run_gate(snakefile, configfiles, args.rehearsal)
    return main_report(report)
