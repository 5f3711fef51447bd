from _log import to_log
from fq.errors import FqError
from fq.model.experts import ExpertLayout
from fq.workflow.encode import BlockJob, encode_blocks
from fq.workflow.specs import EncodeSpec

to_log(snakemake)
s, p = EncodeSpec.from_json(snakemake.params.spec, "encode job's spec"), snakemake.params
# The spec describes the node's whole layer in both encode.per_job modes (the params are Snakemake's rerun key
# and stay the same either way, so switching modes re-encodes nothing); a block job encodes its wildcards' block.
blocks = s.blocks
if "block" in snakemake.wildcards.keys():
    blocks = [b for b in blocks if b.block == int(snakemake.wildcards.block)]


def paths(out):
    return [out] if isinstance(out, str) else list(out)


hessian = s.hessian.to_json() if s.hessian else None
jobs = [BlockJob(node=s.node, role=s.role, K=s.K, codebook=s.codebook, node_digest=s.node_digest, layer=s.layer,
                 block=b.block, experts=list(b.experts), sources=b.sources,
                 ancestors=[a.to_json() for a in b.ancestors], out_fragment=f, out_metrics=m, hessian=hessian)
        for b, f, m in zip(blocks, paths(snakemake.output.fragment), paths(snakemake.output.metrics), strict=True)]
for j in jobs:  # outputs and spec in the same block order (rules/encode.smk writes both from the plan)
    if f"-block{j.block:03d}." not in j.out_fragment or f"-block{j.block:03d}." not in j.out_metrics:
        raise FqError(f"encode job: outputs {j.out_fragment}, {j.out_metrics} are not those of block {j.block}")
encode_blocks(jobs, campaign_json=snakemake.input.campaign, key_path=snakemake.input.key, device=p.device,
              devices_list=list(p.devices), lock_dir=p.locks, seed=p.seed, threads=snakemake.threads,
              layout=ExpertLayout.from_json(s.layout))
