"""``model.sig``: a published base directory signed in the OpenSSF model-signing format (sigstore/model-transparency,
``model_signing`` 1.1.1 on PyPI), so that the standard tool verifies it:

    model_signing verify key BASE_DIR --signature BASE_DIR/model.sig --public_key model-signing.pub

Format (what that package's key mode writes and reads; this is fq's own writer and reader):

- a Sigstore bundle, JSON: ``{"mediaType": "application/vnd.dev.sigstore.bundle.v0.3+json", "verificationMaterial":
  {"publicKey": {"hint": sha256 hex of the public key's SubjectPublicKeyInfo PEM}, "tlogEntries": []},
  "dsseEnvelope": {"payload": base64(statement), "payloadType": "application/vnd.in-toto+json", "signatures":
  [{"sig": base64(DER ECDSA signature over PAE(payloadType, payload)), "keyid": ""}]}}``;
- the statement, an in-toto Statement v1 with ``predicateType: https://model_signing/signature/v1.0``, one subject
  ``{name: the directory's name, digest: {sha256: sha256 over the resources' digests (raw bytes, in order)}}``, and a
  predicate ``{serialization: {method: "files", hash_type: "sha256", allow_symlinks: false, ignore_paths:
  ["model.sig"]}, resources: [{name, algorithm: "sha256", digest}]}``, one resource per file of the directory but
  ``model.sig`` (sorted by name: the manifest's files and the manifest itself);
- keys: ECDSA on P-256, P-384 or P-521 (the tool's key mode takes no other), hashed with SHA-256, -384 or -512 as
  the tool pairs them. Signatures are deterministic (RFC 6979, ``cryptography``'s ``deterministic_signing``), and
  payload and bundle are canonical JSON, so finalizing again writes the same bytes.

What fq checks (``check_signature``, run wherever a base is checked against its manifest): the base manifest, signed
with the campaign's Ed25519 key, declares the model-signing public key (``model_signing: {signature, public_key}``);
``model.sig`` must be signed by that key (bundle hint and ECDSA signature), and list exactly the files the manifest
lists, plus the manifest, with the digests the manifest states (its own line's sha256 for the manifest). With the
manifest's own check of every file, that is the tool's check of the directory, done by fq.

    generate(prefix) -> (key path, pub path)        # PREFIX.key (PKCS#8 PEM, 0600), PREFIX.pub (SPKI PEM)
    load_private(path) / load_public_pem(text, where) / public_pem(key) / hint(pem)
    bundle(name, digests, key) -> bytes             # digests: {file name: sha256}
    write_signature(base_dir, digests, key) -> path
    check_signature(base_dir, digests, public_pem, where) -> [problem]
"""
from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec

from fq.core import atomic, canonical
from fq.core.safepath import open_regular
from fq.errors import FqError
from fq.provenance.attest import keys

SIGNATURE = "model.sig"
BUNDLE_MEDIA_TYPE = "application/vnd.dev.sigstore.bundle.v0.3+json"
PAYLOAD_TYPE = "application/vnd.in-toto+json"
STATEMENT_TYPE = "https://in-toto.io/Statement/v1"
PREDICATE_TYPE = "https://model_signing/signature/v1.0"
SERIALIZATION = {"method": "files", "hash_type": "sha256", "allow_symlinks": False, "ignore_paths": [SIGNATURE]}
CURVES = {"secp256r1": hashes.SHA256, "secp384r1": hashes.SHA384, "secp521r1": hashes.SHA512}
MAX_BYTES = 64 << 20  # a GLM-5 base lists about 12,000 files: about 2 MB of bundle


def _hash(key) -> hashes.HashAlgorithm:
    return CURVES[key.curve.name]()


def _check_curve(key, where: str) -> None:
    if not isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) or key.curve.name not in CURVES:
        what = key.curve.name if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)) \
            else type(key).__name__
        raise FqError(f"{where}: a {what} key; OpenSSF model signing takes ECDSA keys on P-256, P-384 or P-521")


def generate(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """A new ECDSA P-256 pair, ``PREFIX.key`` and ``PREFIX.pub``; never overwrites a key."""
    return keys.write_pair(ec.generate_private_key(ec.SECP256R1()), prefix)


def load_private(path: str | os.PathLike) -> ec.EllipticCurvePrivateKey:
    key = keys.read_private(path, "the model-signing private key")
    _check_curve(key, str(path))
    return key


def public_pem(key) -> str:
    """The SubjectPublicKeyInfo PEM of a key (what ``--public_key`` reads, and what the bundle's hint hashes)."""
    pub = key.public_key() if isinstance(key, ec.EllipticCurvePrivateKey) else key
    return pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo).decode()


def load_public_pem(text: str, where: str) -> ec.EllipticCurvePublicKey:
    try:
        key = serialization.load_pem_public_key(text.encode())
    except (ValueError, UnsupportedAlgorithm) as e:
        raise FqError(f"{where}: not a PEM public key ({e})") from None
    _check_curve(key, where)
    if public_pem(key) != text:
        raise FqError(f"{where}: not in the canonical SubjectPublicKeyInfo PEM form its hint is computed over")
    return key


def hint(pem: str) -> str:
    """The bundle's ``verificationMaterial.publicKey.hint``: sha256 of the public key's PEM, hex (the tool's)."""
    return hashlib.sha256(pem.encode()).hexdigest()


def _pae(payload: bytes) -> bytes:
    return b"DSSEv1 %d %s %d %s" % (len(PAYLOAD_TYPE), PAYLOAD_TYPE.encode(), len(payload), payload)


def _root_digest(resources: list[dict]) -> str:
    h = hashlib.sha256()
    for r in resources:
        h.update(bytes.fromhex(r["digest"]))
    return h.hexdigest()


def statement(name: str, digests: dict[str, str]) -> bytes:
    """The payload: the directory ``name`` and its files' sha256 (``digests``), as canonical JSON."""
    resources = [{"name": n, "algorithm": "sha256", "digest": digests[n]} for n in sorted(digests)]
    return canonical.dumps({"_type": STATEMENT_TYPE, "predicateType": PREDICATE_TYPE,
                            "subject": [{"name": name, "digest": {"sha256": _root_digest(resources)}}],
                            "predicate": {"serialization": SERIALIZATION, "resources": resources}})


def bundle(name: str, digests: dict[str, str], key: ec.EllipticCurvePrivateKey) -> bytes:
    _check_curve(key, "model-signing key")
    payload = statement(name, digests)
    sig = key.sign(_pae(payload), ec.ECDSA(_hash(key), deterministic_signing=True))  # RFC 6979: reruns, same bytes
    return canonical.dumps({
        "mediaType": BUNDLE_MEDIA_TYPE,
        "verificationMaterial": {"publicKey": {"hint": hint(public_pem(key))}, "tlogEntries": []},
        "dsseEnvelope": {"payload": base64.b64encode(payload).decode(), "payloadType": PAYLOAD_TYPE,
                         "signatures": [{"sig": base64.b64encode(sig).decode(), "keyid": ""}]}})


def write_signature(base_dir: str | os.PathLike, digests: dict[str, str], key: ec.EllipticCurvePrivateKey) -> Path:
    """``BASE_DIR/model.sig`` over ``digests`` (every file of the directory but itself), written when it differs."""
    if SIGNATURE in digests:
        raise FqError(f"{base_dir}/{SIGNATURE}: a signature does not sign itself")
    data = bundle(Path(base_dir).name, digests, key)
    path = Path(base_dir) / SIGNATURE
    if path.is_symlink() or not path.is_file() or path.read_bytes() != data:
        atomic.write_bytes(path, data)
    return path


def _field(doc, keys: tuple, where: str, want: str):
    """doc[k0][k1]..., or an FqError naming the field and what was expected."""
    at = doc
    for i, k in enumerate(keys):
        if not isinstance(at, dict) or k not in at:
            raise FqError(f"{where}: {'.'.join(keys[:i + 1])} is missing; expected {want}")
        at = at[k]
    return at


def _open(data: bytes, public_key: ec.EllipticCurvePublicKey, pem: str, where: str) -> dict:
    """The verified statement of a bundle: media type, key hint, one ECDSA signature by ``public_key``."""
    doc = canonical.loads(data, where, max_bytes=MAX_BYTES)
    if _field(doc, ("mediaType",), where, BUNDLE_MEDIA_TYPE) != BUNDLE_MEDIA_TYPE:
        raise FqError(f"{where}: mediaType {doc['mediaType']!r}, expected {BUNDLE_MEDIA_TYPE!r}")
    got_hint = _field(doc, ("verificationMaterial", "publicKey", "hint"), where, "the signing key's hint")
    if got_hint != hint(pem):
        raise FqError(f"{where}: verificationMaterial.publicKey.hint {str(got_hint)[:16]}… names another key than the "
                      f"model-signing key the manifest declares ({hint(pem)[:16]}…)")
    env = _field(doc, ("dsseEnvelope",), where, "a DSSE envelope")
    if _field(env, ("payloadType",), where, PAYLOAD_TYPE) != PAYLOAD_TYPE:
        raise FqError(f"{where}: dsseEnvelope.payloadType {env['payloadType']!r}, expected {PAYLOAD_TYPE!r}")
    sigs = _field(env, ("signatures",), where, "one signature")
    if not isinstance(sigs, list) or len(sigs) != 1 or not isinstance(sigs[0], dict) or \
            not isinstance(sigs[0].get("sig"), str):
        raise FqError(f"{where}: dsseEnvelope.signatures: expected exactly one {{sig, keyid}} (the tool verifies the "
                      "first only)")
    try:
        payload = base64.b64decode(_field(env, ("payload",), where, "base64"), validate=True)
        sig = base64.b64decode(sigs[0]["sig"], validate=True)
    except (ValueError, TypeError):
        raise FqError(f"{where}: dsseEnvelope.payload or its signature is not base64") from None
    try:
        public_key.verify(sig, _pae(payload), ec.ECDSA(_hash(public_key)))
    except InvalidSignature:
        raise FqError(f"{where}: the ECDSA signature does not verify under the model-signing key the manifest "
                      "declares") from None
    st = canonical.loads(payload, f"{where} (statement)", max_bytes=MAX_BYTES)
    for key, want in (("_type", STATEMENT_TYPE), ("predicateType", PREDICATE_TYPE)):
        if _field(st, (key,), where, want) != want:
            raise FqError(f"{where}: statement {key} {st[key]!r}, expected {want!r}")
    return st


def check_signature(base_dir: str | os.PathLike, digests: dict[str, str], pem: str, where: str | None = None
                    ) -> list[str]:
    """Problems of ``BASE_DIR/model.sig`` against the files the manifest lists (``digests``: name -> sha256, the
    manifest itself included) and the public key it declares (``pem``); empty: it agrees."""
    where = where or f"{base_dir}/{SIGNATURE}"
    try:
        public_key = load_public_pem(pem, f"{where}: the manifest's model_signing.public_key")
        with open_regular(base_dir, SIGNATURE, where) as fh:
            if os.fstat(fh.fileno()).st_size > MAX_BYTES:
                return [f"{where}: larger than any model signature fq writes ({MAX_BYTES} bytes; refused unread)"]
            data = fh.read()
        st = _open(data, public_key, pem, where)
        pred = _field(st, ("predicate",), where, "{serialization, resources}")
        ser = _field(pred, ("serialization",), where, "the files serialization")
        if not isinstance(ser, dict) or {k: ser.get(k) for k in ("method", "hash_type", "allow_symlinks")} != \
                {k: SERIALIZATION[k] for k in ("method", "hash_type", "allow_symlinks")}:
            return [f"{where}: predicate.serialization {canonical.dumps(ser).decode()[:120]}: expected method files, "
                    "hash_type sha256, allow_symlinks false"]
        ignored = ser.get("ignore_paths", [])
        if not isinstance(ignored, list) or any(not isinstance(p, str) for p in ignored):
            return [f"{where}: predicate.serialization.ignore_paths: expected a list of paths"]
        covered = sorted(n for n in digests for p in ignored if n == p or n.startswith(p.rstrip("/") + "/"))
        if covered:  # the tool would not hash these: a swapped file there would pass it
            return [f"{where}: serialization.ignore_paths leaves out {', '.join(covered[:3])}, which the manifest lists"]
        resources = _field(pred, ("resources",), where, "[{name, algorithm, digest}]")
        ok = isinstance(resources, list) and all(
            isinstance(r, dict) and set(r) == {"name", "algorithm", "digest"} and r["algorithm"] == "sha256"
            and isinstance(r["name"], str) and isinstance(r["digest"], str) and len(r["digest"]) == 64
            and all(c in "0123456789abcdef" for c in r["digest"]) for r in resources)
        if not ok:
            return [f"{where}: predicate.resources: expected [{{name, algorithm: sha256, digest: 64 hex digits}}]"]
        subject = _field(st, ("subject",), where, "one subject")
        if not isinstance(subject, list) or len(subject) != 1 or \
                _field(subject[0], ("digest", "sha256"), where, "the resources' digest") != _root_digest(resources):
            return [f"{where}: subject: expected one subject whose sha256 is over the resources' digests"]
    except FqError as e:
        return [str(e)]
    listed = {r["name"]: r["digest"] for r in resources}
    problems = []
    if len(listed) != len(resources):
        problems.append(f"{where}: names a file twice")
    extra, missing = sorted(set(listed) - set(digests)), sorted(set(digests) - set(listed))
    if extra or missing:
        parts = ([f"lists {len(extra)} file(s) the manifest does not ({', '.join(extra[:3])})"] if extra else []) + \
            ([f"lacks {len(missing)} the manifest lists ({', '.join(missing[:3])})"] if missing else [])
        problems.append(f"{where}: {' and '.join(parts)}; a model signature covers the manifest's files exactly")
    differ = sorted(n for n in set(listed) & set(digests) if listed[n] != digests[n])
    if differ:
        problems.append(f"{where}: sha256 of {', '.join(differ[:3])}{' …' if len(differ) > 3 else ''} is not the "
                        "manifest's")
    return problems
