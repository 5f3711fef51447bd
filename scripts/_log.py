"""Route a script's stderr (progress bars, tracebacks) to the rule's log file."""
import sys


def to_log(snakemake) -> None:
    if snakemake.log:
        sys.stderr = open(snakemake.log[0], "a", buffering=1)
