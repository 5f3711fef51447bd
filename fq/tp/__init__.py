"""Tensor-parallel products: declare every weight with its sharding, plan it onto a device mesh,
export per-rank shards by whole 128-aligned tiles, and load them transactionally.

    fq.tp.manifest  pure declarations (WeightEntry, shard policies, collectives) and their validation
    fq.tp.moe       the manifest of an MoE product (MoeSpec -> TpManifest) and a reference MoE forward
    fq.tp.mesh      DeviceMesh (tp x ep x pp, epoch) and plan(manifest, mesh) -> MeshPlan: pure, deterministic
    fq.tp.slicing   EXL3 tensor sets cut along output or input by whole Hadamard blocks
    fq.tp.linears   a whole-model base's non-expert linears: the split rule, their manifest entries, their shards
    fq.tp.sources   where a load's bytes come from: a published product, a TP export, in-memory tensors
    fq.tp.store     WeightStore: admission, journaled allocation, rollback, origin checks, unload
    fq.tp.export    fq tp-export: per-rank shards with attestations naming the unsliced fragments
    fq.tp.records   the signed documents of a TP export (fq-tp-shard/1, fq-tp-export/1)

docs/tp.md describes the vocabulary, the split rules, the plan format and the store's guarantees.

What it may import: fq.provenance (products, fragments, attestations, manifests), fq.model (shards, experts),
fq.codec, fq.core, fq.errors. Never fq.runtime (its neighbour in the layer), fq.workflow or the CLI.
"""
