from _log import to_log
from fq.workflow.calibration import tokens_job

to_log(snakemake)
p = snakemake.params
tokens_job(out=snakemake.output.tokens, rows=p.rows, cols=p.cols, sha256=p.sha256, text=p.text, tokens=p.tokens,
           tokenizer_dir=p.tokenizer_dir)
