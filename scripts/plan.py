from _log import to_log
from fq.planning.plan import write_plan
from fq.workflow.campaign import load_campaign

to_log(snakemake, clear_temps=True)
write_plan(snakemake.output.plan, load_campaign(snakemake.config).plan)
