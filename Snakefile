# fq: one campaign = source checkpoint + recipe -> signed EXL3 bases, stages and assemblies.
# Every product node, block fragment, attestation and assembly is a file target, so this DAG is the
# recipe's parent graph: resume, windowed staging and retirement follow from file dependencies.
from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


from fq.workflow.campaign import normalize_config

validate(normalize_config(config), "config/schemas/config.schema.yaml")


include: "rules/common.smk"
include: "rules/source.smk"
include: "rules/calibrate.smk"
include: "rules/allocate.smk"
include: "rules/encode.smk"
include: "rules/finalize.smk"
include: "rules/eval.smk"
include: "rules/report.smk"


# The key/encoder bindings checked before the first job (fq.workflow.launch), and the launcher lock where the parse
# did not take it (rules/common.smk: Snakemake driven through its API). Dry runs and --lint never get here.
onstart:
    on_start(C, KEY, config["encode"]["device"], pending_rules(), held=LAUNCH_LOCK)


onsuccess:
    if C.allocation_pending:
        print(f"fq: allocation measured ({C.alloc.file}); run snakemake again to encode the budgeted bases")


rule all:
    input:
        all_targets(),
    default_target: True
