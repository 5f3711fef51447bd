from _log import to_log
from fq.model.experts import ExpertLayout
from fq.workflow.share import share_fragment
from fq.workflow.specs import ShareSpec

to_log(snakemake)
s, o = ShareSpec.from_json(snakemake.params.spec, "share job's spec"), snakemake.output
share_fragment(campaign_json=snakemake.input.campaign, key_path=snakemake.input.key, node=s.node,
               node_digest=s.node_digest, owner=s.owner, owner_digest=s.owner_digest, layer=s.layer, block=s.block,
               owner_fragment=snakemake.input.fragment, owner_metrics=snakemake.input.metrics,
               out_fragment=o.fragment, out_metrics=o.metrics, lock_dir=snakemake.params.locks,
               layout=ExpertLayout.from_json(s.layout))
