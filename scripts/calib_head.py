from _log import to_log
from fq.workflow.calibration import head_job

to_log(snakemake)
p, out = snakemake.params, snakemake.output
head_job(campaign_json=snakemake.input.campaign, key_path=snakemake.input.key, source_dir=p.source_dir,
         skeleton=list(snakemake.input.skeleton), hidden_in=snakemake.input.hidden, out_linears=out.linears,
         out_record=out.record, binding=p.binding, capture=p.capture, device=p.device, devices_list=list(p.devices),
         lock_dir=p.locks, threads=snakemake.threads)
