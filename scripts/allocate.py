from _log import to_log
from fq.workflow.allocation import allocate_job

to_log(snakemake)
allocate_job(snakemake.input.sensitivity, snakemake.params.budgets, snakemake.output.allocation)
