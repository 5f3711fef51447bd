from _log import to_log
from fq.provenance.attest import keys

to_log(snakemake)
keys.generate(snakemake.params.prefix)
