# Calibration (config calibration:): tokens -> embeddings -> the source model one decoder layer at a time, each
# calibrated MoE layer writing its Hessian, which that layer's encode jobs read (fq.workflow.calibration). The
# chain's hidden states are temp (each is read by the next layer's job only); the Hessians and their bindings
# stay. Encode jobs of layer L wait for layer L's Hessian only, so encoding L overlaps calibrating L+1.
if C.calib.settings:

    rule calib_tokens:
        input:
            text=[C.calib.text] if not C.calib.settings["tokens"] else [],
            tokens=[C.calib.settings["tokens"]] if C.calib.settings["tokens"] else [],
            tokenizer=[str(C.source_dir / "tokenizer.json")] if not C.calib.settings["tokens"] else [],
        output:
            tokens=C.calib.tokens,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/calibration/tokens.log",
        benchmark:
            f"{OUT}/benchmarks/calibration/tokens.tsv"
        params:
            rows=C.calib.settings["rows"],
            cols=C.calib.settings["columns"],
            sha256=C.calib.settings["sha256"],
            text=lambda wc, input: input.text[0] if input.text else None,
            tokens=lambda wc, input: input.tokens[0] if input.tokens else None,
            tokenizer_dir=lambda wc, input: str(Path(input.tokenizer[0]).parent) if input.tokenizer else None,
        script:
            "../scripts/calib_tokens.py"

    rule calib_embed:
        input:
            unpack(calib_embed_inputs),
        output:
            hidden=temp(C.calib.hidden(None)),
            record=C.calib.record(None),
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/calibration/embed.log",
        benchmark:
            f"{OUT}/benchmarks/calibration/embed.tsv"
        params:
            source_dir=str(C.source_dir),
            staging=f"{OUT}/staging",
            rows=C.calib.settings["rows"],
            cols=C.calib.settings["columns"],
        script:
            "../scripts/calib_embed.py"

    # One rule per output set (Snakemake output patterns are fixed per rule): a dense layer advances the hidden states;
    # a calibrated MoE layer also writes its Hessian; a layer with quantized non-expert linears (whole-model bases)
    # also writes their input Hessians. Same script, same params.
    for R in calib_layer_rules():

        rule:
            name:
                R["name"]
            input:
                unpack(calib_layer_inputs),
            output:
                **R["outputs"],
            wildcard_constraints:
                layer=R["layers"],
            conda:
                "../envs/fq.yaml"
            log:
                f"{OUT}/logs/calibration/layer{{layer}}.log",
            benchmark:
                f"{OUT}/benchmarks/calibration/layer{{layer}}.tsv"
            params:
                **CALIB_LAYER_PARAMS,
            threads: 1
            resources:
                gpu=1 if config["encode"]["device"] == "cuda" else 0,
            script:
                "../scripts/calib_layer.py"

    if None in C.calib.linear_capture:

        # the head's input: the last decoder layer's output through the final norm (read from the skeleton)
        rule calib_head:
            input:
                campaign=ancient(C.campaign_json),
                key=ancient(KEY),
                hidden=C.calib.hidden(C.source.num_hidden_layers - 1),
                skeleton=lambda wc: C.calib.head_norm_skeleton(),
            output:
                linears=C.calib.linear_hessian(None),
                record=C.calib.path("head.json"),
            conda:
                "../envs/fq.yaml"
            log:
                f"{OUT}/logs/calibration/head.log",
            benchmark:
                f"{OUT}/benchmarks/calibration/head.tsv"
            params:
                source_dir=str(C.source_dir),
                binding=C.calib.linear_hessian_binding(None),
                capture=C.calib.settings["capture"],
                device=config["encode"]["device"],
                devices=config["encode"].get("devices", []),
                locks=f"{OUT}/locks",
            threads: 1
            resources:
                gpu=1 if config["encode"]["device"] == "cuda" else 0,
            script:
                "../scripts/calib_head.py"
