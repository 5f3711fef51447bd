from _log import to_log
from fq.workflow.skeleton import derive_variant

to_log(snakemake)
derive_variant(snakemake.input.campaign, snakemake.input.key, snakemake.input.whole, list(snakemake.params.tensors),
               snakemake.output.shard, snakemake.params.locks)
