from _log import to_log
from fq.workflow.encode import encode_native
from fq.workflow.specs import NativeSpec

to_log(snakemake)
s, p = NativeSpec.from_json(snakemake.params.spec, "native job's spec"), snakemake.params
encode_native(K=s.K, codebook=s.codebook, layer=s.layer, experts=list(s.experts), sources=s.sources,
              out_metrics=snakemake.output.metrics, device=p.device, devices_list=list(p.devices), lock_dir=p.locks,
              seed=p.seed, threads=snakemake.threads, out_tensors=snakemake.output.tensors, layout=s.layout,
              block=s.block, hessian=s.hessian.to_json() if s.hessian else None)
