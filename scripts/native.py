from _log import to_log
from fq.workflow.encode import encode_native

to_log(snakemake)
s, p = snakemake.params.spec, snakemake.params
encode_native(K=s["K"], codebook=s["codebook"], layer=s["layer"], experts=s["experts"], sources=s["sources"],
              out_metrics=snakemake.output.metrics, device=p.device, devices_list=list(p.devices), lock_dir=p.locks,
              seed=p.seed, threads=snakemake.threads,
              out_tensors=snakemake.output.tensors, layout=s["layout"], block=s["block"], hessian=s.get("hessian"))
