"""The test kits: what the tests build their inputs with, imported as ``from tests.kits import provkit``.

    tree          one signed, published tree (skeleton, fragments, manifest, plans, publication) whose node digests
                  and recipe sha256 are fq's own (fq.planning.recipe): the one place the kits below sign and publish
    provkit       a small published campaign (k2, r1, r2; products k2r1, k2r1r2) for the provenance tests
    runtimekit    a tiny random-init GLM-4-MoE published as a campaign whose full chain is its source, for runtime tests
    basekit       a one-base tree of a familykit checkpoint, the family's layout and skeleton shards
    tpkit         provkit's campaign at a geometry tensor parallelism cuts, and as a whole-model base
    insiderkit    an insider's re-signing of a published tree with the campaign's own key
    familykit     tiny checkpoints of every model family, laid out as their authors publish them
    demokit       the embedded demo model cut to 4 experts a layer, for the Snakemake campaign tests
    crashkit      a tiny DeepSeek-layout checkpoint and Snakemake as a process group, for the crash tests
    slurmkit      a one-node SLURM cluster on localhost (``python -m tests.kits.slurmkit DIR``)
    exl3kit       exllamav3 against fq's reference forward (GPU tests)
    hubfake       a fake Hugging Face Hub on 127.0.0.1
    cuda_viterbi_model  a numpy model of the CUDA Viterbi kernel

Nothing is imported here: each kit is a module of its own (some import torch or transformers at import).
"""
