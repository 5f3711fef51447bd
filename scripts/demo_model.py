from _log import to_log
from fq.model import demo_model

to_log(snakemake)
demo_model.write(snakemake.params.out, snakemake.params.text)
