from _log import to_log
from fq.model.usage import measure_job

to_log(snakemake)
measure_job(snakemake.params.model, snakemake.input.text, snakemake.output.usage, hot=snakemake.params.hot,
            threads=snakemake.threads)
