from _log import to_log
from fq.workflow.calibration import layer_job

to_log(snakemake)
p, out = snakemake.params, snakemake.output
layer_job(campaign_json=snakemake.input.campaign, source_dir=p.source_dir, staging=p.staging, layer=int(p.layer),
          hidden_in=snakemake.input.hidden, out_hidden=out.hidden, out_record=out.record,
          out_hessian=out.get("hessian"), binding=p.binding, capture=p.capture, device=p.device,
          devices_list=list(p.devices), lock_dir=p.locks, threads=snakemake.threads, linears=list(p.linears),
          out_linears=out.get("linears"), linear_binding=p.linear_binding, weighting=p.get("weighting", "none"))
