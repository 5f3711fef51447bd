from _log import to_log
from fq.workflow.campaign import load_campaign
from fq.workflow.report import make_report

to_log(snakemake, clear_temps=True)
i, o = snakemake.input, snakemake.output
make_report(load_campaign(snakemake.config), i.summary, o.table, o.quality, o.layers, o.rows,
            eval_json=i.eval[0] if i.eval else None, kl_png=o.get("kl"), proxy_png=o.get("proxy"),
            allocation_png=o.get("allocation"))
