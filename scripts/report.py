from _log import to_log
from fq.workflow.campaign import load_campaign
from fq.workflow.report import make_report

to_log(snakemake, clear_temps=True)
o = snakemake.output
make_report(load_campaign(snakemake.config), snakemake.input.summary, o.table, o.quality, o.layers, o.rows)
