# Budgeted bases (recipe "bits"): the source's allocation units measured on the calibration text (sensitivity), then
# the allocation at every budget of the recipe solved from it (allocate). The plan reads OUT/allocation/allocation.json
# when the Snakefile is parsed, so a campaign whose allocation is not there yet has it as its only target: the next
# run plans the encode jobs from it (make demo and fq.commands.demo run both). allocation.file names one made by
# fq allocate instead (a hub source, or a model too big for this machine): then neither job exists.
if C.measures_allocation:

    rule sensitivity:
        input:
            model=ancient(source_files()),
            text=ancient(C.sensitivity_text),
        output:
            sensitivity=C.sensitivity_file,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/allocation/sensitivity.log",
        benchmark:
            f"{OUT}/benchmarks/allocation/sensitivity.tsv"
        params:
            model=lambda wc, input: str(Path(input.model[0]).parent),
            codebook=next(n.codebook for n in C.recipe.nodes if n.is_budgeted),
            rows=C.allocation_config["rows"],
            columns=C.allocation_config["columns"],
            samples=C.allocation_config["samples"],
            seed=C.allocation_config["seed"],
            ks=C.allocation_config["ks"],
        threads: 2
        script:
            "../scripts/sensitivity.py"

    rule allocate:
        input:
            sensitivity=C.sensitivity_file,
        output:
            allocation=C.allocation_file,
        conda:
            "../envs/fq.yaml"
        log:
            f"{OUT}/logs/allocation/allocate.log",
        benchmark:
            f"{OUT}/benchmarks/allocation/allocate.tsv"
        params:
            budgets=C.allocation_budgets,
        script:
            "../scripts/allocate.py"
