"""model.sig: a published base signed in the OpenSSF model-signing format (issue 44). The real ``model_signing``
package (1.1.1, pinned in requirements.lock) verifies what fq writes and refuses a tampered file; fq's own checks
refuse a model.sig that disagrees with the signed manifest. The demo campaign's bases: tests/test_workflow.py."""
from __future__ import annotations

import base64
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kits import provkit
from fq.core import canonical
from fq.errors import FqError
from fq.provenance import model_sig
from fq.provenance.manifest import MANIFEST_NAME, read_base_manifest, verify_base
from fq.provenance.verify import verify_path
from tests.test_exl3_config import NOW, insider_resign_base


def tool_verify(base: Path, pub: Path) -> tuple[bool, str]:
    """The standard tool's check, through its Python API (the CLI runs the same: test_workflow.py runs the CLI)."""
    from model_signing import hashing, verifying

    try:
        verifying.Config().use_elliptic_key_verifier(public_key=pub).set_hashing_config(
            hashing.Config().set_ignored_paths(paths=[base / "model.sig"], ignore_git_paths=True)
        ).verify(base, base / "model.sig")
    except ValueError as e:
        return False, str(e)
    return True, ""


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return provkit.build_campaign(tmp_path_factory.mktemp("modelsig"), card=True, model_signing=True)


@pytest.fixture
def c(pristine, tmp_path):
    return provkit.private_copy(pristine, tmp_path / "c")


def oms_key(c):
    return model_sig.load_private(c.key_path.parent / "model-signing.key")


def test_the_standard_tool_verifies_the_base_and_refuses_a_tampered_file(c):
    base = c.root / "base/k2"
    pub = c.key_path.parent / "model-signing.pub"
    assert tool_verify(base, pub) == (True, "")
    assert verify_path(c.root, c.pub, now=NOW).ok
    shard = base / "model-00001-of-00001.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1
    shard.write_bytes(bytes(data))
    ok, why = tool_verify(base, pub)
    assert not ok and "Hash mismatch for 'model-00001-of-00001.safetensors'" in why
    shard.write_bytes(bytes(data[:-1]) + bytes([data[-1] ^ 1]))
    (base / "extra.txt").write_text("not signed")
    ok, why = tool_verify(base, pub)
    assert not ok and "Extra files found" in why and "extra.txt" in why


def test_the_bundle_is_the_tool_format_and_deterministic(pristine, tmp_path):
    base = pristine.root / "base/k2"
    data = (base / "model.sig").read_bytes()
    doc = json.loads(data)
    assert doc["mediaType"] == "application/vnd.dev.sigstore.bundle.v0.3+json"
    st = json.loads(base64.b64decode(doc["dsseEnvelope"]["payload"]))
    assert st["predicateType"] == "https://model_signing/signature/v1.0" and len(st["subject"]) == 1
    assert st["predicate"]["serialization"] == {"method": "files", "hash_type": "sha256", "allow_symlinks": False,
                                                "ignore_paths": ["model.sig"]}
    m = read_base_manifest(base, pristine.pub)
    assert {r["name"]: r["digest"] for r in st["predicate"]["resources"]} == m.digests()  # the manifest's files + itself
    assert m.model_signing["public_key"] == (pristine.key_path.parent / "model-signing.pub").read_text()
    other = shutil.copytree(base, tmp_path / "k2")  # RFC 6979: signing again gives the same bytes
    (other / "model.sig").unlink()
    model_sig.write_signature(other, m.digests(), oms_key(pristine))
    assert (other / "model.sig").read_bytes() == data
    card = (base / "README.md").read_text()  # the card names the key and the command
    assert f"PEM's sha256 is `{model_sig.hint(m.model_signing['public_key'])}`" in card
    assert "model_signing verify key base/k2 --signature base/k2/model.sig --public_key model-signing.pub" in card


def refused(c) -> list[str]:
    problems = verify_path(c.root, c.pub, now=NOW).problems
    with pytest.raises(FqError):
        verify_base(c.root / "base/k2", c.pub)
    return problems


def test_fq_refuses_a_model_sig_that_disagrees_with_the_manifest(c, tmp_path):
    base = c.root / "base/k2"
    sig = base / "model.sig"
    where = f"{sig}"
    m = read_base_manifest(base, c.pub)
    good = sig.read_bytes()
    # signed by another ECDSA key than the one the manifest declares
    other = model_sig.load_private(model_sig.generate(tmp_path / "other")[0])
    model_sig.write_signature(base, m.digests(), other)
    assert refused(c) == [f"{where}: verificationMaterial.publicKey.hint {model_sig.hint(model_sig.public_pem(other))[:16]}… "
                          "names another key than the model-signing key the manifest declares "
                          f"({model_sig.hint(m.model_signing['public_key'])[:16]}…)"]
    # the right key, the hint kept, the signature of another payload
    doc = canonical.loads(good)
    forged = canonical.loads(model_sig.bundle("k2", m.digests(), other))
    doc["dsseEnvelope"]["signatures"] = forged["dsseEnvelope"]["signatures"]
    sig.write_bytes(canonical.dumps(doc))
    assert refused(c) == [f"{where}: the ECDSA signature does not verify under the model-signing key the manifest "
                          "declares"]
    # the right key over other digests (a stale signature), and over another file set
    name = "model-00001-of-00001.safetensors"
    model_sig.write_signature(base, {**m.digests(), name: "0" * 64}, oms_key(c))
    assert refused(c) == [f"{where}: sha256 of {name} is not the manifest's"]
    model_sig.write_signature(base, {**m.digests(), "extra.bin": "0" * 64}, oms_key(c))
    assert refused(c) == [f"{where}: lists 1 file(s) the manifest does not (extra.bin); a model signature covers the "
                          "manifest's files exactly"]
    sig.unlink()
    assert refused(c) == [f"{where}: missing; {MANIFEST_NAME} declares the OpenSSF model signature of this directory"]
    sig.write_bytes(good)
    assert verify_path(c.root, c.pub, now=NOW).ok


def test_a_model_sig_the_manifest_does_not_declare_is_refused(c):
    base = c.root / "base/k2"
    good = (base / "model.sig").read_bytes()
    insider_resign_base(c, lambda pred: pred.pop("model_signing"))
    (base / "model.sig").write_bytes(good)
    assert refused(c) == [f"{base}/model.sig: {MANIFEST_NAME} declares no model-signing key, so nothing vouches for "
                          "this signature (stray file in a published base)"]


def test_an_ignored_listed_file_and_a_foreign_key_are_refused_by_name(c, tmp_path):
    base = c.root / "base/k2"
    m = read_base_manifest(base, c.pub)
    doc = canonical.loads(model_sig.statement("k2", m.digests()))
    doc["predicate"]["serialization"]["ignore_paths"] = ["model.sig", "config.json"]
    payload = canonical.dumps(doc)
    key = oms_key(c)
    from cryptography.hazmat.primitives.asymmetric import ec

    bundle = canonical.loads(model_sig.bundle("k2", m.digests(), key))
    bundle["dsseEnvelope"]["payload"] = base64.b64encode(payload).decode()
    bundle["dsseEnvelope"]["signatures"][0]["sig"] = base64.b64encode(
        key.sign(model_sig._pae(payload), ec.ECDSA(model_sig._hash(key)))).decode()
    (base / "model.sig").write_bytes(canonical.dumps(bundle))
    assert refused(c) == [f"{base}/model.sig: serialization.ignore_paths leaves out config.json, which the manifest "
                          "lists"]
    with pytest.raises(FqError, match="Ed25519PrivateKey key; OpenSSF model signing takes ECDSA keys on P-256"):
        model_sig.load_private(c.key_path)  # the campaign's Ed25519 signer key


def test_the_cli_of_the_standard_tool_verifies_it(pristine):
    base = pristine.root / "base/k2"
    p = subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(base), "--signature",
                        str(base / "model.sig"), "--public_key", str(pristine.key_path.parent / "model-signing.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "Verification succeeded" in p.stdout, p.stdout + p.stderr
