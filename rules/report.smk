# Report: quality per product and per layer, products beside one-pass encodes, sizes and digests; with eval:, the
# output-level measurements (fq eval) beside them: KL against bits per weight, and KL/perplexity/top-1 columns.


rule report:
    input:
        summary=f"{OUT}/{SUMMARY}",
        metrics=metrics_files(),
        eval=C.evals.files()[:1],
    output:
        table=report(f"{OUT}/report/products.tsv", caption="../report/products.rst", category="Products"),
        quality=report(f"{OUT}/report/quality.png", caption="../report/quality.rst", category="Quality"),
        layers=report(f"{OUT}/report/layers.png", caption="../report/layers.rst", category="Quality"),
        rows=f"{OUT}/report/products.json",
        **({"kl": report(f"{OUT}/report/kl.png", caption="../report/kl.rst", category="Quality")}
           if C.evals.settings else {}),
        **({"proxy": report(f"{OUT}/report/proxy.png", caption="../report/proxy.rst", category="Quality")}
           if C.calib.settings else {}),
        **({"allocation": report(f"{OUT}/report/allocation.png", caption="../report/allocation.rst",
                                 category="Allocation")} if C.recipe.budgeted else {}),
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/report.log",
    benchmark:
        f"{OUT}/benchmarks/report.tsv"
    script:
        "../scripts/report.py"
