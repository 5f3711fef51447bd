from _log import to_log
from fq.workflow.staging import retire_window

to_log(snakemake, clear_temps=True)
retire_window(snakemake.params.staging, int(snakemake.wildcards.window), snakemake.params.retire, snakemake.output.marker)
