from _log import to_log
from fq.workflow.skeleton import extract_skeleton

to_log(snakemake)
extract_skeleton(snakemake.input.campaign, snakemake.input.key, snakemake.params.staged, snakemake.params.tensors,
                 snakemake.output.shard, lock_dir=snakemake.params.locks)
