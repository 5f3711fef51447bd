# Encoding: skeleton copies per source shard, encode jobs per (node, layer, block) or per (node, layer), share jobs
# (a base publishing another base's expert encoding), native comparisons, weight-only twins
# (calibration.compare_weight_only).


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


# Encode jobs, one of two granularities (config encode.per_job), writing the same files byte for byte:
#   block: rule encode, one job per (node, layer, block);
#   layer: the encode_layer rules, one job per (node, layer) encoding all of that node's blocks of the layer in one
#          process (one process start, CUDA init, key and encoder check per layer instead of per block).
# Exactly one of the two is defined, chosen from config: with both defined, every fragment would have two producers
# and a `ruleorder` would have to pick one for each, `snakemake -n` and --list-rules would show a rule that never
# runs, and a profile's per-rule settings could name the wrong one. A layer job's outputs are the explicit list of
# its blocks' files (the paths the block rule writes), so finalize, staging, retirement and the report do not know
# which mode ran. Both take the same params (encode_key, the rerun key), so a campaign may switch modes.
if C.per_job == "block":

    rule encode:
        input:
            unpack(encode_inputs),
        output:
            fragment=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors",
            attestation=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors.intoto.jsonl",
            metrics=f"{OUT}/metrics/{{node}}/{{node}}-layer{{layer}}-block{{block}}.json",
        wildcard_constraints:
            node="|".join(re.escape(n) for n in C.encoding_nodes),  # a base sharing another's experts: rule share
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/encode/{{node}}-layer{{layer}}-block{{block}}.log",
        benchmark:
            f"{OUT}/benchmarks/encode/{{node}}-layer{{layer}}-block{{block}}.tsv"
        params:
            spec=encode_spec,
            key=encode_key,
            **ENCODE_PARAMS,
        threads: config["encode"].get("threads", 1) or workflow.cores
        resources:
            gpu=1 if config["encode"]["device"] == "cuda" else 0,
        script:
            "../scripts/encode.py"

else:
    # Output patterns are fixed per rule, so each rule serves the (node, layer) pairs with one set of block indices:
    # encode_layer for the nodes that encode every expert (all blocks of every layer), encode_layer_2, ... for a hot
    # stage whose experts miss a block in some layer (Campaign.layer_rules). Their names depend on the recipe and the
    # usage statistics, so no profile can name them: they take the threads and the group a profile sets for
    # encode_layer (encode_layer_threads, encode_layer_group); other per-rule settings (runtime) stay the defaults.
    for R in C.layer_rules:

        rule:
            name:
                R.name
            input:
                unpack(encode_inputs),
            output:
                fragment=[f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{b:03d}.safetensors" for b in R.blocks],
                attestation=[
                    f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{b:03d}.safetensors.intoto.jsonl"
                    for b in R.blocks
                ],
                metrics=[f"{OUT}/metrics/{{node}}/{{node}}-layer{{layer}}-block{b:03d}.json" for b in R.blocks],
            wildcard_constraints:
                node="|".join(re.escape(n) for n in R.nodes),
                layer="|".join(f"{l:03d}" for l in R.layers),
            conda:
                "../envs/fq.yaml"
            log:
                f"{OUT}/logs/encode/{{node}}-layer{{layer}}.log",
            benchmark:
                f"{OUT}/benchmarks/encode/{{node}}-layer{{layer}}.tsv"
            params:
                spec=encode_spec,
                key=encode_key,
                **ENCODE_PARAMS,
            threads: encode_layer_threads() or config["encode"].get("threads", 1) or workflow.cores
            resources:
                gpu=1 if config["encode"]["device"] == "cuda" else 0,
            group:
                None if R.name == "encode_layer" else encode_layer_group
            script:
                "../scripts/encode.py"


# A base publishing another base's expert encoding (recipe Node.experts_from: same K and codebook) copies that base's
# committed fragment of each block under its own name (fq.workflow.share): no encode, no device, no staged shard.
if C.shared_fragments:

    rule share:
        input:
            unpack(share_inputs),
        output:
            fragment=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors",
            attestation=f"{OUT}/fragments/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors.intoto.jsonl",
            metrics=f"{OUT}/metrics/{{node}}/{{node}}-layer{{layer}}-block{{block}}.json",
        wildcard_constraints:
            node="|".join(re.escape(n) for n in C.shared_nodes),
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/share/{{node}}-layer{{layer}}-block{{block}}.log",
        benchmark:
            f"{OUT}/benchmarks/share/{{node}}-layer{{layer}}-block{{block}}.tsv"
        params:
            spec=share_spec,
            locks=f"{OUT}/locks",
        script:
            "../scripts/share.py"


rule native:
    input:
        unpack(native_inputs),
    output:
        metrics=f"{OUT}/native/K{{K}}-{{codebook}}/layer{{layer}}-block{{block}}.json",
        tensors=f"{OUT}/native/K{{K}}-{{codebook}}/layer{{layer}}-block{{block}}.safetensors",
    conda:
        "../envs/fq.yaml"
    log:
        f"{OUT}/logs/native/K{{K}}-{{codebook}}-layer{{layer}}-block{{block}}.log",
    benchmark:
        f"{OUT}/benchmarks/native/K{{K}}-{{codebook}}-layer{{layer}}-block{{block}}.tsv"
    params:
        spec=native_spec,
        **ENCODE_PARAMS,
    threads: config["encode"].get("threads", 1) or workflow.cores
    resources:
        gpu=1 if config["encode"]["device"] == "cuda" else 0,
    script:
        "../scripts/native.py"


# Weight-only twins (calibration.compare_weight_only): every fragment, or those of the named nodes' chains, encoded
# again without its Hessian, a stage against its parent's twin, for fq eval's calibrated-vs-weight-only comparison.
# Comparison material like the natives: unsigned, never published; one job per (node, layer, block) whatever
# encode.per_job says.
if C.compare.weight_only_jobs:

    rule weight_only:
        input:
            unpack(weight_only_inputs),
        output:
            tensors=f"{OUT}/weight-only/{{node}}/{{node}}-layer{{layer}}-block{{block}}.safetensors",
            metrics=f"{OUT}/weight-only/{{node}}/{{node}}-layer{{layer}}-block{{block}}.json",
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/weight-only/{{node}}-layer{{layer}}-block{{block}}.log",
        benchmark:
            f"{OUT}/benchmarks/weight-only/{{node}}-layer{{layer}}-block{{block}}.tsv"
        params:
            spec=weight_only_spec,
            **ENCODE_PARAMS,
        threads: config["encode"].get("threads", 1) or workflow.cores
        resources:
            gpu=1 if config["encode"]["device"] == "cuda" else 0,
        script:
            "../scripts/weight_only.py"


# Whole-model bases: one job per (linear node, layer) encodes one class of non-expert linears (attention, shared,
# dense) of one layer, or the head, reading the committed skeleton (fq.workflow.encode_linears); bases quantizing
# that class at those bits share it. Each such base publishes a skeleton variant without those linears.
if C.linears.jobs:

    rule encode_linears:
        input:
            unpack(linear_inputs),
        output:
            fragment=f"{OUT}/linears/{{lnode}}/{{lnode}}-{{unit}}.safetensors",
            attestation=f"{OUT}/linears/{{lnode}}/{{lnode}}-{{unit}}.safetensors.intoto.jsonl",
            metrics=f"{OUT}/metrics/linears/{{lnode}}-{{unit}}.json",
        wildcard_constraints:
            lnode="|".join(re.escape(n["name"]) for n in C.plan.linears),
            unit=r"layer\d{3}|head",
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/encode/linears/{{lnode}}-{{unit}}.log",
        benchmark:
            f"{OUT}/benchmarks/encode/linears/{{lnode}}-{{unit}}.tsv"
        params:
            spec=linear_spec,
            key=linear_key,
            **ENCODE_PARAMS,
        threads: config["encode"].get("threads", 1) or workflow.cores
        resources:
            gpu=1 if config["encode"]["device"] == "cuda" else 0,
        script:
            "../scripts/encode_linears.py"

    rule skeleton_variant:
        input:
            campaign=ancient(C.campaign_json),
            key=ancient(KEY),
            whole=f"{OUT}/skeleton/{{shard}}",
            attestation=f"{OUT}/skeleton/{{shard}}.intoto.jsonl",
        output:
            shard=f"{OUT}/skeleton/{{variant}}/{{shard}}",
            attestation=f"{OUT}/skeleton/{{variant}}/{{shard}}.intoto.jsonl",
        wildcard_constraints:
            variant=r"without-[a-z+]+",
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/skeleton/{{variant}}/{{shard}}.log",
        benchmark:
            f"{OUT}/benchmarks/skeleton/{{variant}}/{{shard}}.tsv"
        params:
            tensors=lambda wc: list(C.linears.variants[wc.variant][wc.shard]),
            locks=f"{OUT}/locks",
        script:
            "../scripts/skeleton_variant.py"
