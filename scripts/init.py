from _log import to_log
from fq.workflow.campaign import load_campaign
from fq.workflow.init import run_init

to_log(snakemake)
run_init(load_campaign(snakemake.config), snakemake.input.key, snakemake.params.device, snakemake.output.campaign,
         devices=list(snakemake.params.devices))
