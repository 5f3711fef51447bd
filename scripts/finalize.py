from _log import to_log
from fq.workflow.campaign import load_campaign
from fq.workflow.finalize import finalize

to_log(snakemake)
finalize(load_campaign(snakemake.config), snakemake.input.key, snakemake.params.version, snakemake.params.expires)
