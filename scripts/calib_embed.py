from _log import to_log
from fq.workflow.calibration import embed_job

to_log(snakemake)
p = snakemake.params
embed_job(campaign_json=snakemake.input.campaign, source_dir=p.source_dir, staging=p.staging,
          tokens=snakemake.input.tokens, out_hidden=snakemake.output.hidden, out_record=snakemake.output.record,
          rows=p.rows, cols=p.cols)
