from _log import to_log
from fq.workflow.eval import run_eval

to_log(snakemake, clear_temps=True)
i, o, p = snakemake.input, snakemake.output, snakemake.params
run_eval(published=p.published, pub=p.pub, campaign_json=i.campaign, source=p.source, text=i.text, native=p.native,
         weight_only=p.weight_only, twin_aliases=dict(p.twin_aliases),
         tokens=p.tokens, seq_len=p.seq_len, out_json=o.json, out_tsv=o.tsv)
