"""Campaign steps the Snakemake workflow runs: each rule's script is a thin call into one module here.

    campaign  config -> Campaign (source, recipe, plan, paths): what the Snakefile plans at parse time
    init      bind source, signer and encoder identity into campaign.json
    staging   fetch/copy one source shard as a real file, verified against its sha256
    skeleton  copy a shard's non-expert tensors verbatim, attested per tensor
    encode    one node's encoding of one block (+ attestation + metrics)
    finalize  verify everything, refuse strays, publish bases, stages and signed assemblies
    report    quality tables and plots
"""
