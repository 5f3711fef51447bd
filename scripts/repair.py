from _log import to_log
from fq.workflow.campaign import load_campaign
from fq.workflow.staging import write_repair_marker

to_log(snakemake, clear_temps=True)
write_repair_marker(load_campaign(snakemake.config), snakemake.output.marker)
