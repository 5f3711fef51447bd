# Budgeted bases (recipe "bits"): the source's allocation units measured on the calibration text (sensitivity, streamed
# one decoder layer at a time: fq.allocation.streamed; on the campaign's encode device), then
# the allocation at every budget of the recipe solved from it (allocate). The plan reads OUT/allocation/allocation.json
# when the Snakefile is parsed, so a campaign whose allocation is not there yet has it as its only target: the next
# run plans the encode jobs from it (make demo and fq.commands.demo run both). allocation.file names one made by
# fq allocate instead (a hub source, or a model too big for this machine): then neither job exists.
if C.alloc.measures:

    rule sensitivity:
        input:
            model=ancient(source_files()),
            text=ancient(C.alloc.sensitivity_text),
        output:
            sensitivity=C.alloc.sensitivity_file,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/allocation/sensitivity.log",
        benchmark:
            f"{OUT}/benchmarks/allocation/sensitivity.tsv"
        params:
            model=lambda wc, input: str(Path(input.model[0]).parent),
            codebook=next(n.codebook for n in C.recipe.nodes if n.is_budgeted),
            rows=C.alloc.settings["rows"],
            columns=C.alloc.settings["columns"],
            samples=C.alloc.settings["samples"],
            seed=C.alloc.settings["seed"],
            ks=C.alloc.settings["ks"],
            stream_bytes=C.alloc.settings["stream_bytes"],
            device=config["encode"]["device"],
            devices=config["encode"].get("devices", []),
            locks=f"{OUT}/locks",
        threads: 2
        resources:
            gpu=1 if config["encode"]["device"] == "cuda" else 0,
        script:
            "../scripts/sensitivity.py"

    rule allocate:
        input:
            sensitivity=C.alloc.sensitivity_file,
        output:
            allocation=C.alloc.file,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/allocation/allocate.log",
        benchmark:
            f"{OUT}/benchmarks/allocation/allocate.tsv"
        params:
            budgets=C.alloc.budgets,
        script:
            "../scripts/allocate.py"
