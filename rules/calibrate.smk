# Calibration (config calibration:): tokens -> embeddings -> the source model one decoder layer at a time, each
# calibrated MoE layer writing its Hessian, which that layer's encode jobs read (fq.workflow.calibration). The
# chain's hidden states are temp (each is read by the next layer's job only); the Hessians and their bindings
# stay. Encode jobs of layer L wait for layer L's Hessian only, so encoding L overlaps calibrating L+1.
if C.calibration:

    rule calib_tokens:
        input:
            text=[C.calibration_text] if not C.calibration["tokens"] else [],
            tokens=[C.calibration["tokens"]] if C.calibration["tokens"] else [],
            tokenizer=[str(C.source_dir / "tokenizer.json")] if not C.calibration["tokens"] else [],
        output:
            tokens=C.calib_tokens,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/calibration/tokens.log",
        benchmark:
            f"{OUT}/benchmarks/calibration/tokens.tsv"
        params:
            rows=C.calibration["rows"],
            cols=C.calibration["columns"],
            sha256=C.calibration["sha256"],
            text=lambda wc, input: input.text[0] if input.text else None,
            tokens=lambda wc, input: input.tokens[0] if input.tokens else None,
            tokenizer_dir=lambda wc, input: str(Path(input.tokenizer[0]).parent) if input.tokenizer else None,
        script:
            "../scripts/calib_tokens.py"

    rule calib_embed:
        input:
            unpack(calib_embed_inputs),
        output:
            hidden=temp(C.calib_hidden(None)),
            record=C.calib_record(None),
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/calibration/embed.log",
        benchmark:
            f"{OUT}/benchmarks/calibration/embed.tsv"
        params:
            source_dir=str(C.source_dir),
            staging=f"{OUT}/staging",
            rows=C.calibration["rows"],
            cols=C.calibration["columns"],
        script:
            "../scripts/calib_embed.py"

    # Two rules, one per output set: a dense layer advances the hidden states; a calibrated MoE layer also writes
    # its Hessian. Same script, same params.
    rule calib_dense:
        input:
            unpack(calib_layer_inputs),
        output:
            hidden=temp(f"{OUT}/calibration/hidden-layer{{layer}}.safetensors"),
            record=f"{OUT}/calibration/layer{{layer}}.json",
        wildcard_constraints:
            layer=calib_layer_pattern(calibrated=False),
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

    rule calib_moe:
        input:
            unpack(calib_layer_inputs),
        output:
            hidden=temp(f"{OUT}/calibration/hidden-layer{{layer}}.safetensors"),
            hessian=f"{OUT}/calibration/hessian-layer{{layer}}.safetensors",
            record=f"{OUT}/calibration/layer{{layer}}.json",
        wildcard_constraints:
            layer=calib_layer_pattern(calibrated=True),
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
