from _log import to_log
from fq.provenance import model_sig

to_log(snakemake)
model_sig.generate(snakemake.params.prefix)
