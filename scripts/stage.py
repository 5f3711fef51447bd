from _log import to_log
from fq.workflow.staging import stage_shard

to_log(snakemake)
p = snakemake.params
stage_shard(snakemake.input.campaign, p.source_kind, p.source_dir, snakemake.wildcards.shard, p.window,
            snakemake.output.shard, repo=p.repo, revision=p.revision, lock_dir=p.locks,
            out_index=snakemake.output.ranges)
