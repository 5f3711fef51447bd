# Encoding: skeleton copies per source shard, one job per (node, layer, block), native comparisons.


rule skeleton:
    input:
        unpack(skeleton_inputs),
    output:
        shard=f"{OUT}/skeleton/{{shard}}",
        attestation=f"{OUT}/skeleton/{{shard}}.intoto.jsonl",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/skeleton/{{shard}}.log",
    benchmark:
        f"{OUT}/benchmarks/skeleton/{{shard}}.tsv"
    params:
        tensors=lambda wc: list(C.skeleton_tensors[wc.shard]),
        staged=lambda wc: C.staged(wc.shard),
        locks=f"{OUT}/locks",
    script:
        "../scripts/skeleton.py"


rule encode:
    input:
        unpack(encode_inputs),
    output:
        fragment=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors",
        attestation=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors.intoto.jsonl",
        metrics=f"{OUT}/metrics/{{node}}/{{node}}-layer{{layer}}-block{{block}}.json",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/encode/{{node}}-layer{{layer}}-block{{block}}.log",
    benchmark:
        f"{OUT}/benchmarks/encode/{{node}}-layer{{layer}}-block{{block}}.tsv"
    params:
        spec=encode_spec,
        device=config["encode"]["device"],
        devices=config["encode"].get("devices", []),
        seed=config["encode"].get("seed", 0),
        locks=f"{OUT}/locks",
    threads: config["encode"].get("threads", 1) or workflow.cores
    resources:
        gpu=1 if config["encode"]["device"] == "cuda" else 0,
    script:
        "../scripts/encode.py"


rule native:
    input:
        unpack(native_inputs),
    output:
        metrics=f"{OUT}/native/K{{K}}-{{codebook}}/layer{{layer}}-block{{block}}.json",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/native/K{{K}}-{{codebook}}-layer{{layer}}-block{{block}}.log",
    benchmark:
        f"{OUT}/benchmarks/native/K{{K}}-{{codebook}}-layer{{layer}}-block{{block}}.tsv"
    params:
        spec=native_spec,
        device=config["encode"]["device"],
        devices=config["encode"].get("devices", []),
        seed=config["encode"].get("seed", 0),
        locks=f"{OUT}/locks",
    threads: config["encode"].get("threads", 1) or workflow.cores
    resources:
        gpu=1 if config["encode"]["device"] == "cuda" else 0,
    script:
        "../scripts/native.py"
