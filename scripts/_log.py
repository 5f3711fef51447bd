"""Route a script's stderr (progress bars, tracebacks) to the rule's log file; an FqError (a refusal
the operator must read: a held claim, a wrong key, a full disk) is one line there, not a traceback."""
import sys


def _one_line(kind, value, tb):
    from fq.errors import FqError

    if isinstance(value, FqError):
        print(f"fq: {value}", file=sys.stderr, flush=True)
    else:
        sys.__excepthook__(kind, value, tb)


def to_log(snakemake) -> None:
    if snakemake.log:
        sys.stderr = open(snakemake.log[0], "a", buffering=1)
    sys.excepthook = _one_line
