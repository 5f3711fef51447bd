"""DSSE (with the spec's test vector), keys, in-toto statements, predicate schemas, encoder identity."""
import base64
import json
import os
import stat

import pytest
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature, encode_dss_signature

from fq.core.canonical import dumps
from fq.errors import FqError
from fq.provenance.attest import dsse, keys
from fq.provenance.attest.statement import FRAGMENT, parse_statement, validate_predicate
from fq.provenance.identity import bundle_files, check_identity, determinism_scope, encoder_identity


# --- DSSE: the test vector of secure-systems-lab/dsse protocol.md (ECDSA P-256, RFC 6979) ---
VECTOR_TYPE = "http://example.com/HelloWorld"
VECTOR_BODY = b"hello world"
VECTOR_PAE = b"DSSEv1 29 http://example.com/HelloWorld 11 hello world"
VECTOR_D = 97358161215184420915383655311931858321456579547487070936769975997791359926199
VECTOR_X = 46950820868899156662930047687818585632848591499744589407958293238635476079160
VECTOR_SIG = "A3JqsQGtVsJ2O2xqrI5IcnXip5GToJ3F+FnZ+O88SjtR6rDAajabZKciJTfUiHqJPcIAriEGAHTVeCUjW2JIZA=="


def test_dsse_spec_test_vector():
    assert dsse.pae(VECTOR_TYPE, VECTOR_BODY) == VECTOR_PAE
    key = ec.derive_private_key(VECTOR_D, ec.SECP256R1())
    assert key.public_key().public_numbers().x == VECTOR_X
    raw = base64.b64decode(VECTOR_SIG)
    r, s = int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big")
    key.public_key().verify(encode_dss_signature(r, s), dsse.pae(VECTOR_TYPE, VECTOR_BODY), ec.ECDSA(hashes.SHA256()))
    # RFC 6979 signing over our PAE reproduces the published signature bit for bit
    again = key.sign(dsse.pae(VECTOR_TYPE, VECTOR_BODY), ec.ECDSA(hashes.SHA256(), deterministic_signing=True))
    assert decode_dss_signature(again) == (r, s)
    # and the envelope of the vector carries the same payload encoding
    assert base64.b64encode(VECTOR_BODY).decode() == "aGVsbG8gd29ybGQ="


def test_pae_counts_bytes_not_characters():
    assert dsse.pae("t", "é".encode()) == b"DSSEv1 1 t 2 \xc3\xa9"
    assert dsse.pae("", b"") == b"DSSEv1 0  0 "


@pytest.fixture(scope="module")
def key():
    return Ed25519PrivateKey.generate()


def test_envelope_round_trip_and_urlsafe(key):
    env = dsse.sign(b'{"a":1}', key)
    line = dsse.envelope_line(env)
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    assert dsse.open_envelope(line, key.public_key(), "x") == b'{"a":1}'
    env["signatures"][0]["sig"] = env["signatures"][0]["sig"].replace("+", "-").replace("/", "_").rstrip("=")
    assert dsse.open_envelope(dumps(env), key.public_key(), "x") == b'{"a":1}'


def test_envelope_refusals(key):
    other = Ed25519PrivateKey.generate()
    line = dsse.envelope_line(dsse.sign(b"{}", key))
    with pytest.raises(FqError, match="no valid signature by the pinned key"):
        dsse.open_envelope(line, other.public_key(), "att")
    env = json.loads(line)
    env["payload"] = base64.b64encode(b'{"b":1}').decode()
    with pytest.raises(FqError, match="no valid signature"):
        dsse.open_envelope(dumps(env), key.public_key(), "att")
    env = json.loads(line)
    env["payloadType"] = "application/json"
    with pytest.raises(FqError, match="no valid signature"):  # the type is authenticated by PAE
        dsse.open_envelope(dumps(env), key.public_key(), "att")
    with pytest.raises(FqError, match="payloadType 'text/plain', expected"):
        dsse.open_envelope(dumps(dsse.sign(b"{}", key, "text/plain")), key.public_key(), "att")
    with pytest.raises(FqError, match="exactly one envelope line"):
        dsse.open_envelope(line + line, key.public_key(), "att")
    with pytest.raises(FqError, match="no signatures"):
        dsse.open_envelope(dumps(dsse.unsigned(b"{}")), key.public_key(), "att")
    with pytest.raises(FqError, match="not valid base64"):
        dsse.open_envelope(line.replace(b'"payload":"', b'"payload":"!!'), key.public_key(), "att")


def test_signature_is_checked_before_the_payload_is_parsed(key):
    """A forged envelope whose payload would crash a parser is refused for its signature, not parsed."""
    forged = dsse.sign(b"\xff not json {{{", Ed25519PrivateKey.generate())
    with pytest.raises(FqError, match="no valid signature"):
        dsse.open_envelope(dumps(forged), key.public_key(), "att")
    signed = dsse.sign(b"\xff not json {{{", key)
    body = dsse.open_envelope(dumps(signed), key.public_key(), "att")
    with pytest.raises(FqError, match="not UTF-8"):
        parse_statement(body, "att", FRAGMENT)


def test_duplicate_keys_in_envelope_refused(key):
    line = dsse.envelope_line(dsse.sign(b"{}", key)).rstrip(b"\n")
    dup = line[:-1] + b',"payloadType":"application/vnd.in-toto+json"}'
    with pytest.raises(FqError, match="duplicate JSON key 'payloadType'"):
        dsse.open_envelope(dup, key.public_key(), "att")


# --- keys ---
def test_keygen_modes_fingerprint_and_no_overwrite(tmp_path):
    priv, pub, fp = keys.generate(tmp_path / "signer")
    assert stat.S_IMODE(os.stat(priv).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(pub).st_mode) == 0o644
    k = keys.load_private(priv)
    assert keys.fingerprint(keys.load_public(pub)) == keys.fingerprint(k) == fp and len(fp) == 64
    with pytest.raises(FqError, match="already exists"):
        keys.generate(tmp_path / "signer")
    os.chmod(priv, 0o644)
    with pytest.raises(FqError, match="accessible by group/others"):
        keys.load_private(priv)
    with pytest.raises(FqError, match="not a PEM public key"):
        keys.load_public(priv)
    ec_pub = ec.generate_private_key(ec.SECP256R1()).public_key()
    from cryptography.hazmat.primitives import serialization
    p = tmp_path / "ec.pub"
    p.write_bytes(ec_pub.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo))
    with pytest.raises(FqError, match="expected an Ed25519 public key"):
        keys.load_public(p)


# --- statements and schemas ---
def test_integers_stay_integers_in_predicates(tmp_path, campaign_copy):
    from tests.kits import provkit
    c = campaign_copy
    line = (c.root / "base/k2/k2-layer001-block000.safetensors.intoto.jsonl").read_bytes()
    _, pred = parse_statement(dsse.open_envelope(line, c.pub, "x"), "x", FRAGMENT)
    validate_predicate(FRAGMENT, pred, "x")
    pred["layer"] = 1.0
    with pytest.raises(FqError, match=r"predicate\.layer: 1\.0 is not of type 'integer'"):
        validate_predicate(FRAGMENT, pred, "x")


def test_both_profiles_validate_every_line_a_campaign_emits(tmp_path, campaign_copy):
    from tests.kits import provkit
    c = campaign_copy
    kinds = set()
    for att in c.root.rglob("*.safetensors.intoto.jsonl"):
        _, pred = parse_statement(dsse.open_envelope(att.read_bytes(), c.pub, att.name), att.name, FRAGMENT)
        kinds.add(pred["kind"])
        other = dict(pred, kind="skeleton" if pred["kind"] == "expert" else "expert")
        with pytest.raises(FqError, match="predicate"):
            validate_predicate(FRAGMENT, other, att.name)  # a line is valid under its own profile only
    assert kinds == {"expert", "skeleton"}


def test_stage_predicate_requires_parent(tmp_path, campaign_copy):
    from tests.kits import provkit
    c = campaign_copy
    line = (c.root / "stages/r1/r1-layer001-block000.safetensors.intoto.jsonl").read_bytes()
    _, pred = parse_statement(dsse.open_envelope(line, c.pub, "x"), "x", FRAGMENT)
    pred["parent"] = None
    with pytest.raises(FqError, match=r"predicate\.parent: None is not of type 'object'"):
        validate_predicate(FRAGMENT, pred, "x")


# --- encoder identity ---
def test_encoder_identity_is_deterministic_and_self_checking():
    a, b = encoder_identity(), encoder_identity()
    assert a == b and a["cuda"] is None and a["device_arch"].startswith("cpu-")
    assert check_identity(a, "x") is a
    with pytest.raises(FqError, match="digest does not match"):
        check_identity(dict(a, torch="0.0"), "x")
    assert "quant_args" in determinism_scope()["equal"]


def test_a_cpu_identity_made_without_importing_torch_is_the_one_torch_gives():
    """The launcher's check and the init job bind or compare a CPU identity without importing torch (about 2 s of
    CPU each): the versions read from torch's own version.py, so the digest is the one an encode job computes."""
    import subprocess
    import sys

    import torch

    code = ("import json, sys; from fq.provenance.identity import encoder_identity; "
            "print(json.dumps([encoder_identity('cpu'), 'torch' in sys.modules]))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    ident, imported = json.loads(p.stdout)
    assert not imported
    assert ident == encoder_identity("cpu") and ident["torch"] == torch.__version__
    assert ident["cuda"] == torch.version.cuda


def test_bundle_covers_payload_sources_and_compiled_kernel(tmp_path):
    (tmp_path / "codec").mkdir()
    (tmp_path / "model").mkdir()
    (tmp_path / "workflow").mkdir()
    (tmp_path / "codec" / "a.py").write_text("x = 1\n")
    (tmp_path / "model" / "shards.py").write_text("x = 2\n")
    (tmp_path / "shards.py").write_text("# not at a bundled path: outside the bundle\n")
    (tmp_path / "workflow" / "encode.py").write_text("x = 3\n")
    (tmp_path / "codec" / "k.c").write_text("int x;\n")
    (tmp_path / "codec" / "_trellis.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    (tmp_path / "notes.txt").write_text("not part of the bundle")
    (tmp_path / "cli.py").write_text("# cannot change a payload byte: outside the bundle\n")
    before = bundle_files(tmp_path)
    assert [p for p, _ in before] == ["codec/_trellis.cpython-311-x86_64-linux-gnu.so", "codec/a.py", "codec/k.c",
                                      "model/shards.py", "workflow/encode.py"]
    (tmp_path / "codec" / "_trellis.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF rebuilt")
    assert bundle_files(tmp_path) != before


def test_every_bundle_pattern_names_files_of_the_package():
    """A module of the bundle that moves must take its pattern along: a pattern that matches nothing would silently
    drop the file from every identity."""
    from fq.provenance.identity import ENCODER_FILES, PACKAGE_ROOT

    bundled = {p for p, _ in bundle_files()}
    for pattern in ENCODER_FILES:
        if pattern.endswith(".so"):
            continue  # the compiled kernel exists once built (make install); a checkout without it is still a package
        assert any(PACKAGE_ROOT.joinpath(p).match(pattern) for p in bundled), f"{pattern} matches no file of fq"
    assert {"model/shards.py", "provenance/fragments.py", "model/experts.py", "workflow/encode.py"} <= bundled


def test_identity_refuses_an_absent_cuda_device():
    import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(FqError, match="CUDA is not available"):
        encoder_identity("cuda:0")


# --- experts_from: a base fragment holding another base's encoding of the same block ---
@pytest.mark.parametrize("bad, message", [
    (lambda p: {"node": p["node"], "name": "x", "sha256": "0" * 64}, "names its own node"),
    (lambda p: {"node": "k9", "name": "k9-layer009-block000.safetensors", "sha256": "0" * 64},
     "not node k9's fragment of layer"),
])
def test_an_insider_signed_experts_from_that_names_no_fragment_of_the_block_is_refused(campaign_copy, bad, message):
    """An attestation re-signed with the campaign key (a compromised pipeline) whose experts_from names the
    fragment's own node, or another block's fragment, is refused when read, before any byte is used."""
    from tests.kits import provkit
    from fq.provenance.attest.fragment import verify_shard

    c = campaign_copy
    rel = c.frag("k2", 1, 0)
    verify_shard(c.root, rel, c.pub, c.campaign)  # as published: accepted
    p = c.root / rel
    st = provkit._attested(p)
    st["predicate"]["experts_from"] = bad(st["predicate"])
    p.with_name(p.name + ".intoto.jsonl").write_bytes(provkit._statement_line(st, c.priv))
    with pytest.raises(FqError, match=message):
        verify_shard(c.root, rel, c.pub, c.campaign)


def test_a_stage_fragment_naming_experts_from_is_refused(campaign_copy):
    from tests.kits import provkit
    from fq.provenance.attest.fragment import verify_shard

    c = campaign_copy
    rel = c.frag("r1", 1, 0)
    p = c.root / rel
    st = provkit._attested(p)
    st["predicate"]["experts_from"] = {"node": "k2", "name": "k2-layer001-block000.safetensors", "sha256": "0" * 64}
    p.with_name(p.name + ".intoto.jsonl").write_bytes(provkit._statement_line(st, c.priv))
    with pytest.raises(FqError, match="only a base takes another base's experts"):
        verify_shard(c.root, rel, c.pub, c.campaign)
