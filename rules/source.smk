# Source side: the demo checkpoint, the signer key, campaign init, the plan, staging and retirement.


rule demo_model:
    output:
        files=[f"{OUT}/demo-model/{name}" for name in DEMO_SIDE_FILES + ("model.safetensors.index.json",)]
        + [f"{OUT}/demo-model/{s}" for s in C.source.shards],
        text=[f"{OUT}/demo-text/{split}.txt" for split in DEMO_TEXT_SPLITS],
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/demo_model.log",
    benchmark:
        f"{OUT}/benchmarks/demo_model.tsv"
    params:
        out=lambda wc, output: str(Path(output.files[0]).parent),
        text=lambda wc, output: str(Path(output.text[0]).parent),
    script:
        "../scripts/demo_model.py"


# The demo's expert usage, measured: its calibration text routed through the checkpoint by transformers, each
# layer's router top-k selections counted (fq usage). Hot stages select from it; a real campaign passes its own
# file (config usage:, made with `fq usage`) and has no such job. The DAG is planned before any job runs, from
# the usage recorded with the demo model until this file exists; the job refuses a measurement that selects
# other hot experts (fq.model.usage.measure_job).
if C.usage_file:

    rule usage:
        input:
            model=rules.demo_model.output.files,
            text=f"{OUT}/demo-text/calibration.txt",
        output:
            usage=C.usage_file,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/usage.log",
        benchmark:
            f"{OUT}/benchmarks/usage.tsv"
        params:
            model=lambda wc, input: str(Path(input.model[0]).parent),
            hot=sorted({n.experts.hot for n in C.recipe.nodes if n.experts.mode == "hot"}),
        threads: 2
        script:
            "../scripts/usage.py"


rule keygen:
    output:
        # protected: a signer key is never regenerated behind the operator's back
        key=protected(f"{OUT}/keys/signer.key"),
        pub=protected(f"{OUT}/keys/signer.pub"),
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/keygen.log",
    benchmark:
        f"{OUT}/benchmarks/keygen.tsv"
    params:
        prefix=lambda wc, output: output.key.removesuffix(".key"),
    script:
        "../scripts/keygen.py"


rule model_signing_keygen:
    # the campaign's own ECDSA P-256 key for the OpenSSF model signature of each base (model.sig), generated where the
    # signer key is (signer_key null: the demo); config model_signing_key names another, or false for none
    output:
        key=protected(f"{OUT}/keys/model-signing.key"),
        pub=protected(f"{OUT}/keys/model-signing.pub"),
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/model_signing_keygen.log",
    benchmark:
        f"{OUT}/benchmarks/model_signing_keygen.tsv"
    params:
        prefix=lambda wc, output: output.key.removesuffix(".key"),
    script:
        "../scripts/model_signing_keygen.py"


rule init:
    input:
        # ancient: what matters is that they exist; init itself refuses a changed identity
        key=ancient(KEY),
        source=ancient(source_files()),
    output:
        campaign=C.campaign_json,
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/init.log",
    benchmark:
        f"{OUT}/benchmarks/init.tsv"
    params:
        device=config["encode"]["device"],
        devices=config["encode"].get("devices", []),
    script:
        "../scripts/init.py"


rule plan:
    input:
        recipe=config["recipe"],
        # the measured usage: plan.json's hot selections come from it (the params trigger reruns on new counts)
        usage=[ancient(C.usage_file)] if C.usage_file else [],
    output:
        plan=C.plan_json,
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/plan.log",
    benchmark:
        f"{OUT}/benchmarks/plan.tsv"
    params:
        identity=C.plan.identity_sha256,
    script:
        "../scripts/plan.py"


rule stage:
    input:
        campaign=ancient(C.campaign_json),
        gate=stage_gate,
    output:
        shard=temp(f"{OUT}/staging/{{shard}}"),
        # its header's and tensors' sha256, from the pass that verified the shard: the chain's jobs read only theirs
        ranges=temp(f"{OUT}/staging/{{shard}}.ranges.json"),
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/stage/{{shard}}.log",
    benchmark:
        f"{OUT}/benchmarks/stage/{{shard}}.tsv"
    params:
        window=lambda wc: C.shard_window(wc.shard),
        source_kind=C.source_kind,
        source_dir=str(C.source_dir),
        repo=config["source"].get("repo"),
        revision=C.source.revision,
        locks=f"{OUT}/locks",
    script:
        "../scripts/stage.py"


rule retire:
    input:
        consumers=lambda wc: C.shard_consumers_window(int(wc.window)),
    output:
        marker=f"{OUT}/windows/window-{{window}}.retired",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/retire/window-{{window}}.log",
    benchmark:
        f"{OUT}/benchmarks/retire/window-{{window}}.tsv"
    params:
        staging=f"{OUT}/staging",
        retire=lambda wc: list(C.plan.windows[int(wc.window)].retire),
    script:
        "../scripts/retire.py"
