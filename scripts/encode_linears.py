from _log import to_log
from fq.workflow.encode_linears import encode_linear_job

to_log(snakemake)
s, p, out = snakemake.params.spec, snakemake.params, snakemake.output
encode_linear_job(campaign_json=snakemake.input.campaign, key_path=snakemake.input.key, node=s["node"], cls=s["class"],
                  K=s["K"], codebook=s["codebook"], node_digest=s["node_digest"], layer=s["layer"],
                  sources=s["sources"], out_fragment=out.fragment, out_metrics=out.metrics, device=p.device,
                  devices_list=list(p.devices), lock_dir=p.locks, seed=p.seed, threads=snakemake.threads,
                  hessian=s["hessian"], ancestors=s["ancestors"])
