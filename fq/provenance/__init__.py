"""What a campaign signs and what a consumer checks before it trusts a byte.

    fragments, scales   one node's encoding of one block (expert-contiguous), skeleton shards; finite EXL3 scales
    identity            the encoder bundle identity (ENCODER_FILES: the files that can change a payload byte)
    attest/             fq-attestation/1: keys, DSSE, in-toto statements, the campaign identity, per-shard attestations
    manifest            the signed base manifest; exl3config: a base's derived EXL3 config files; model_card: its
                        README.md; derived: every derivation rule; model_sig: its OpenSSF model signature (model.sig)
    assembly            the signed plan of one product (fq-assembly/1) and the version state
    publication         the signed publication statement; summary: campaign_summary.json, its unsigned view
    product             one product opened for a consumer: the plan checks verify, combine and tp share
    verify              fq verify: every file of a tree accounted for and checked under a pinned key
    combine, adapter    fq combine: one verified adapter for a product and a selection (selection) of experts

What it may import: fq.core, fq.errors, fq.display, fq.codec, fq.model (shards, experts) and fq.planning (which
it does not use: a consumer checks a signed plan without its recipe). Never runtime, tp, workflow, promote or the
CLI; torch only inside functions (``fq verify`` loads none).
"""
