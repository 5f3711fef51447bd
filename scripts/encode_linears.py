from _log import to_log
from fq.workflow.encode_linears import encode_linear_job
from fq.workflow.specs import LinearSpec

to_log(snakemake)
s, p, out = LinearSpec.from_json(snakemake.params.spec, "linear job's spec"), snakemake.params, snakemake.output
encode_linear_job(campaign_json=snakemake.input.campaign, key_path=snakemake.input.key, node=s.node, cls=s.cls,
                  K=s.K, codebook=s.codebook, node_digest=s.node_digest, layer=s.layer, sources=s.sources,
                  out_fragment=out.fragment, out_metrics=out.metrics, device=p.device, devices_list=list(p.devices),
                  lock_dir=p.locks, seed=p.seed, threads=snakemake.threads,
                  hessian=s.hessian.to_json() if s.hessian else None, ancestors=[a.to_json() for a in s.ancestors])
