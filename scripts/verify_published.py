from _log import to_log
from fq.workflow.finalize import verify_published

to_log(snakemake, clear_temps=True)
verify_published(snakemake.params.published, snakemake.params.pub, snakemake.output.verified)
