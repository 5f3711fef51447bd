"""Campaign steps the Snakemake workflow runs: each rule's script is a thin call into one module here.

    campaign  config -> Campaign (source, recipe, plan, paths): what the Snakefile plans at parse time
    init      bind source, signer and encoder identity into campaign.json
    hub       Hugging Face sources: shard digests, verified downloads, the source metadata kept in OUT/meta
    staging   fetch/copy one source shard as a real file, verified against its sha256
    skeleton  copy a shard's non-expert tensors verbatim, attested per tensor
    encode    one node's encoding of one block (+ attestation + metrics); devices: which GPUs a job uses
    finalize  verify everything, refuse strays, publish bases, stages and signed assemblies
    eval      fq.runtime's eval on the published tree;  report: quality tables and plots
    launch    the launcher's checks and lock;  gate: fq gate, the pre-flight checks;  locks: worker and claim locks
    common    what several steps share (file names, the signer check, verified copies, campaign.json's shard
              digests): it imports no other module here, so the steps import it and not one another

Modules here import one another without a circle (tests/test_layering.py): common, locks and devices at the bottom,
campaign -> hub, then init, staging, skeleton, finalize, report, eval; encode, launch and gate on top.

What it may import: everything below it (fq.core, fq.errors, fq.codec, fq.model, fq.planning, fq.provenance,
fq.runtime, fq.tp); never fq.commands or fq.cli: the CLI calls in here, not the other way round. torch only where a
step encodes or evaluates (encode, eval), so the Snakefile's parse and the torch-free jobs stay light.
"""
