from _log import to_log
from fq.attest import keys

to_log(snakemake)
keys.generate(snakemake.params.prefix)
