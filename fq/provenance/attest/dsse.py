"""DSSE envelopes (https://github.com/secure-systems-lab/dsse), signed with Ed25519.

Signature = Sign(PAE(payloadType, payload)), with
``PAE(type, body) = "DSSEv1" SP LEN(type) SP type SP LEN(body) SP body`` (lengths in ASCII decimal
bytes). An envelope on disk is one line of canonical JSON:
``{"payload": b64, "payloadType": ..., "signatures": [{"keyid": fingerprint, "sig": b64}]}``.

``open_envelope`` is eager: it checks the envelope's own shape, decodes, verifies the signatures by
the pinned key over the PAE, checks the payload type, and only then returns the payload bytes for
parsing. ``keyid`` is an unauthenticated hint and never decides anything.

Strict signatures: an fq envelope carries 1 to ``MAX_SIGNATURES`` entries, each ``{"sig": base64 of 64
bytes[, "keyid": string]}``, and every entry must verify under the pinned key: a junk, malformed or
foreign entry beside a valid signature refuses the envelope (nothing in a signed document goes
unchecked), and the cap bounds the work a hostile document can cause before it is refused.
"""
from __future__ import annotations

import base64
import binascii

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core.canonical import dumps, loads
from fq.errors import FqError, SignatureError
from fq.provenance.attest.keys import fingerprint

PAYLOAD_TYPE = "application/vnd.in-toto+json"
MAX_SIGNATURES = 4  # fq writes one; as every entry must verify under the pinned key, more are only repeats
SIG_BYTES = 64  # an Ed25519 signature


def pae(payload_type: str, body: bytes) -> bytes:
    t = payload_type.encode("utf-8")
    return b"DSSEv1 %d %s %d %s" % (len(t), t, len(body), body)


def sign(body: bytes, key: Ed25519PrivateKey, payload_type: str = PAYLOAD_TYPE) -> dict:
    sig = key.sign(pae(payload_type, body))
    return {"payload": base64.b64encode(body).decode("ascii"), "payloadType": payload_type,
            "signatures": [{"keyid": fingerprint(key), "sig": base64.b64encode(sig).decode("ascii")}]}


def unsigned(body: bytes, payload_type: str = PAYLOAD_TYPE) -> dict:
    """An envelope with no signatures: a provenance record that no verifier will accept as signed."""
    return {"payload": base64.b64encode(body).decode("ascii"), "payloadType": payload_type, "signatures": []}


def envelope_line(envelope: dict) -> bytes:
    """The bytes of an attestation file: canonical JSON and one newline."""
    return dumps(envelope) + b"\n"


def b64decode(text: object, where: str) -> bytes:
    """Standard or URL-safe base64 (the spec requires accepting both); padding optional; nothing else."""
    if not isinstance(text, str):
        raise FqError(f"{where}: expected a base64 string")
    s = text.replace("-", "+").replace("_", "/")
    s += "=" * (-len(s) % 4)
    try:
        return base64.b64decode(s, validate=True)
    except (binascii.Error, ValueError):
        raise FqError(f"{where}: not valid base64") from None


def _verifies(public_key: Ed25519PublicKey, sig: bytes, message: bytes) -> bool:
    try:
        public_key.verify(sig, message)
        return True
    except InvalidSignature:
        return False


def open_envelope(data: bytes, public_key: Ed25519PublicKey, source: str,
                  payload_type: str = PAYLOAD_TYPE) -> bytes:
    """Verified payload bytes of an envelope line; raises naming ``source`` and the problem."""
    if data.count(b"\n") > 1 or (b"\n" in data and not data.endswith(b"\n")):
        raise FqError(f"{source}: expected exactly one envelope line, found {len(data.splitlines())}")
    env = loads(data, source)
    if not isinstance(env, dict) or set(env) != {"payload", "payloadType", "signatures"}:
        got = sorted(env) if isinstance(env, dict) else type(env).__name__
        raise FqError(f"{source}: DSSE envelope must have exactly payload, payloadType, signatures; got {got}")
    ptype = env["payloadType"]
    if not isinstance(ptype, str):
        raise FqError(f"{source}: payloadType must be a string")
    body = b64decode(env["payload"], f"{source}: payload")
    sigs = env["signatures"]
    if not isinstance(sigs, list) or not sigs:
        raise FqError(f"{source}: envelope has no signatures")
    if len(sigs) > MAX_SIGNATURES:
        raise FqError(f"{source}: envelope carries {len(sigs)} signatures; at most {MAX_SIGNATURES} are accepted")
    entries = []
    for i, s in enumerate(sigs):
        if not isinstance(s, dict) or "sig" not in s or not set(s) <= {"sig", "keyid"}:
            raise FqError(f"{source}: signatures[{i}] must be an object with sig and optional keyid")
        if not isinstance(s.get("keyid", ""), str):
            raise FqError(f"{source}: signatures[{i}].keyid must be a string")
        raw = b64decode(s["sig"], f"{source}: signatures[{i}].sig")
        if len(raw) != SIG_BYTES:
            raise FqError(f"{source}: signatures[{i}].sig is {len(raw)} bytes; an Ed25519 signature is {SIG_BYTES}")
        entries.append((str(s.get("keyid", "?"))[:16], raw))
    message = pae(ptype, body)
    want = fingerprint(public_key)
    valid = [_verifies(public_key, raw, message) for _, raw in entries]
    if not any(valid):
        raise SignatureError(f"{source}: no valid signature by the pinned key {want[:16]}… "
                             f"(signature keyids: {', '.join(k for k, _ in entries)}); signed by another key or altered "
                             "after signing", tuple(k for k, _ in entries))
    if not all(valid):
        i = valid.index(False)
        raise FqError(f"{source}: signatures[{i}] (keyid {entries[i][0]}) is not a signature by the pinned key "
                      f"{want[:16]}…; an fq envelope carries only its signer's signatures")
    if ptype != payload_type:
        raise FqError(f"{source}: payloadType {ptype!r}, expected {payload_type!r}")
    return body

