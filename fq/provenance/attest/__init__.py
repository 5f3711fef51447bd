"""fq-attestation/1: Ed25519 keys, DSSE envelopes, in-toto Statements, and the fq predicate profiles.

    keys       generate / load / fingerprint (sha256 of the raw 32-byte public key)
    dsse       pae, sign, open_envelope (verify the signature before the payload is parsed)
    statement  in-toto Statement v1, JSON Schemas of the predicates
    campaign   the campaign identity every attestation and plan carries
    fragment   attest_fragment / attest_skeleton / verify_shard: one attestation line beside each shard

Part of fq.provenance (and of its layer: fq.core, fq.errors, fq.model below it); fragment is its one module
that needs the provenance modules around it (fragments, identity).
"""
