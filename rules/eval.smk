# Quality at the model's output (fq eval): after finalize and the consumer's verification, every product and every
# native comparison point (and weight-only twin) loaded on the CPU (verified under the pinned key first) and measured against the source
# on held-out text. Only with eval: in the config (a source on local disk).
if C.evals.settings:

    rule eval:
        input:
            verified=f"{OUT}/published.verified",
            publication=f"{OUT}/published/{PUBLICATION_NAME}",
            assemblies=assembly_files(),
            campaign=ancient(C.campaign_json),
            source=source_files() + [str(C.source_dir / name) for name in ("config.json", "tokenizer.json")],
            text=C.evals.text,
            native=native_tensor_files(),
            weight_only=weight_only_files(),
        output:
            json=C.evals.files()[0],
            tsv=C.evals.files()[1],
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/eval.log",
        benchmark:
            f"{OUT}/benchmarks/eval.tsv"
        params:
            published=lambda wc, input: str(Path(input.publication).parent),
            pub=f"{OUT}/signer.pub",
            source=lambda wc, input: str(Path(input.source[-1]).parent),  # the directory of its tokenizer.json
            native=lambda wc, input: str(Path(input.native[0]).parent.parent) if input.native else None,
            weight_only=lambda wc, input: str(Path(input.weight_only[0]).parent.parent) if input.weight_only else None,
            twin_aliases=C.compare.twin_aliases,  # a base sharing another's experts is measured with that base's twins
            tokens=C.evals.settings["tokens"],
            seq_len=C.evals.settings["seq_len"],
        threads: 1  # fq.runtime.quality measures on one thread (its numbers do not depend on the machine's cores)
        script:
            "../scripts/eval.py"
