# Finalize: verify, refuse strays, publish, sign assemblies and the publication statement; then verify the
# published tree as a consumer would.


rule finalize:
    input:
        campaign=ancient(C.campaign_json),
        plan=C.plan_json,
        key=ancient(KEY),
        fragments=fragment_files(),
        skeletons=skeleton_files(),
        linears=linear_files(),
        retired=[C.retired(w.index) for w in C.plan.windows],
        repair=repair_marker(),
        eval_text=[C.evals.text] if C.evals.settings else [],  # the model cards name it with its sha256
        model_signing_key=[ancient(C.model_signing_key)] if C.model_signing_key else [],  # model.sig per base
    output:
        summary=f"{OUT}/{SUMMARY}",
        assemblies=assembly_files(),
        publication=f"{OUT}/published/{PUBLICATION_NAME}",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/finalize.log",
    benchmark:
        f"{OUT}/benchmarks/finalize.tsv"
    params:
        version=config["assembly"]["version"],
        expires=config["assembly"]["expires"],
    script:
        "../scripts/finalize.py"


rule repair:
    output:
        marker=temp(f"{OUT}/repair/{{digest}}.missing"),
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/repair/{{digest}}.log",
    benchmark:
        f"{OUT}/benchmarks/repair/{{digest}}.tsv"
    script:
        "../scripts/repair.py"


rule verify_published:
    input:
        summary=f"{OUT}/{SUMMARY}",
        assemblies=assembly_files(),
        publication=f"{OUT}/published/{PUBLICATION_NAME}",
        campaign=ancient(C.campaign_json),
    output:
        verified=f"{OUT}/published.verified",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/verify_published.log",
    benchmark:
        f"{OUT}/benchmarks/verify_published.tsv"
    params:
        published=lambda wc, input: str(Path(input.publication).parent),
        pub=f"{OUT}/signer.pub",
    script:
        "../scripts/verify_published.py"
