from _log import to_log
from fq.workflow.encode import encode_weight_only
from fq.workflow.specs import WeightOnlySpec

to_log(snakemake)
s, p = WeightOnlySpec.from_json(snakemake.params.spec, "weight-only job's spec"), snakemake.params
encode_weight_only(node=s.node, role=s.role, K=s.K, codebook=s.codebook, node_digest=s.node_digest, layer=s.layer,
                   block=s.block, experts=list(s.experts), sources=s.sources,
                   ancestors=[a.to_json() for a in s.ancestors], out_tensors=snakemake.output.tensors,
                   out_metrics=snakemake.output.metrics, device=p.device, devices_list=list(p.devices),
                   lock_dir=p.locks, seed=p.seed, threads=snakemake.threads, layout=s.layout)
