from _log import to_log
from fq.workflow.allocation import sensitivity_job

to_log(snakemake)
p = snakemake.params
sensitivity_job(p.model, snakemake.input.text, snakemake.output.sensitivity, codebook=p.codebook, rows=p.rows,
                columns=p.columns, samples=p.samples, seed=p.seed, ks=p.ks, threads=snakemake.threads,
                stream_bytes=p.stream_bytes, device=p.device, devices_list=p.devices, lock_dir=p.locks)
