"""Route a script's stderr (progress bars, tracebacks) to the rule's log file; an FqError (a refusal
the operator must read: a held claim, a wrong key, a full disk) is one line there, not a traceback."""
import sys


def _one_line(kind, value, tb):
    from fq.errors import FqError

    if isinstance(value, FqError):
        print(f"fq: {value}", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, tb)


def to_log(snakemake, clear_temps: bool = False) -> None:
    """``clear_temps``: remove the .tmp-* leftovers of a killed earlier run of this job (its outputs only). Only for
    rules without a claim (plan, retire, repair, verify_published, report): one launcher runs them at a time, and
    a job whose outputs an orphan might still be writing (stage, skeleton, encode, native) cleans up only once it
    holds the claim, finalize only under the exclusive workers lock."""
    if snakemake.log:
        sys.stderr = open(snakemake.log[0], "a", buffering=1)
    sys.excepthook = _one_line
    if clear_temps:
        from pathlib import Path

        from fq.workflow.locks import remove_dead_temps

        for out in snakemake.output:
            for p in remove_dead_temps(Path(out).parent, [Path(out).name]):
                print(f"removed {p}: leftover of an interrupted write of this job", file=sys.stderr)
