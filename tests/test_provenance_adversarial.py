"""The adversarial suite: every attack or operator mistake is refused, with a message naming it.

Each case mutates a private copy of one valid campaign (tests/kits/provkit.py) and is then run through the
consumer paths it concerns: ``verify`` (``fq verify`` on the whole published tree) and/or ``combine``
(``fq combine`` of product k2r1r2, all experts). A case may instead drive its own flow and return the
messages. ``test_suite_size`` pins how many cases there are.
"""
import base64
import datetime as dt
import json
import os
import re
import shutil
import struct

import pytest
import torch

from tests.kits import provkit
from fq.core.canonical import dumps, loads, sha256_hex
from fq.errors import FqError
from fq.model.experts import STANDARD
from fq.provenance.assembly import PlanState, read_assembly
from fq.provenance.attest import dsse
from fq.provenance.attest.campaign import campaign_identity
from fq.provenance.attest.fragment import attest_fragment
from fq.provenance.combine import combine
from fq.provenance.exl3config import write_derived
from fq.provenance.fragments import fragment_filename, write_fragment
from fq.provenance.manifest import write_base_manifest
from fq.provenance.verify import verify_path
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

NOW = provkit.NOW
CASES: dict = {}


def case(name, pattern, via=("verify", "combine"), **combine_kw):
    def deco(fn):
        CASES[name] = (fn, pattern, via, combine_kw)
        return fn
    return deco


# --- helpers that tamper with a campaign ---
def shard(c, node="r1", layer=1, block=0):
    return c.root / c.frag(node, layer, block)


def att_path(p):
    return p.with_name(p.name + ".intoto.jsonl")


def attested(c, p):
    env = loads(att_path(p).read_bytes())
    return loads(base64.b64decode(env["payload"]))


def ranges(c, p):
    return {e["expert"]: (e["offset"], e["length"]) for e in attested(c, p)["predicate"]["experts"]}


def plan_of(c, product="k2r1r2"):
    return read_assembly(c.plans[product], c.pub, now=NOW).predicate


def write_signed_plan(c, plan, product="k2r1r2", key=None, raw_payload=None):
    """Sign a plan as given, bypassing every producer-side check (a compromised or buggy pipeline), and (a
    readable plan) the publication statement that lists it, as that pipeline's finalize would."""
    republish = raw_payload is None and key is None
    if raw_payload is None:
        subjects = [(f["name"], f["sha256"]) for f in plan["fragments"]] + \
                   [(plan["base"]["manifest"]["name"], plan["base"]["manifest"]["sha256"])]
        raw_payload = dumps({"_type": "https://in-toto.io/Statement/v1", "predicateType": "https://fq.dev/assembly/v1",
                             "predicate": plan,
                             "subject": [{"name": n, "digest": {"sha256": d}} for n, d in subjects]})
    c.plans[product].write_bytes(dsse.envelope_line(dsse.sign(raw_payload, key or c.priv)))
    if republish:
        try:
            provkit.publish(c)
        except FqError:
            pass  # a plan that does not even read back (a broken edge, a bad name) keeps the old statement


def header_edit(p, edit):
    """Rewrite a shard's JSON header in place (same length, space padded) after ``edit(header_dict)``."""
    data = p.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8:8 + n])
    edit(head)
    body = json.dumps(head, separators=(",", ":")).encode()
    assert len(body) <= n
    p.write_bytes(data[:8] + body + b" " * (n - len(body)) + data[8 + n:])


def forge_signed(c, p, data: bytes):
    """Replace a fragment with ``data`` and sign everything about it with the campaign's own key, the way a
    pipeline with a bug would: a matching attestation, its children's parent edges, re-signed plans and publication
    (provkit.insider_resign). Only the consumer's own structural checks remain between these bytes and an inference
    engine."""
    p.write_bytes(data)
    provkit.insider_resign(c, p.relative_to(c.root).as_posix())


# --- the cases ---
@case("flipped payload byte", r"bytes of expert 1 do not match the attested sha256 \(payload altered\)")
def _(c, tmp):
    p = shard(c)
    off, n = ranges(c, p)[1]
    data = bytearray(p.read_bytes())
    data[off + n // 2] ^= 0x01
    p.write_bytes(bytes(data))


@case("two experts' byte ranges swapped", r"bytes of expert 0 are those attested for expert 1 \(expert byte ranges swapped\)")
def _(c, tmp):
    p = shard(c)
    r = ranges(c, p)
    (o0, n0), (o1, n1) = r[0], r[1]
    assert n0 == n1
    data = bytearray(p.read_bytes())
    data[o0:o0 + n0], data[o1:o1 + n1] = data[o1:o1 + n1], data[o0:o0 + n0]
    p.write_bytes(bytes(data))


@case("truncated shard", r"\d+ bytes, (its attestation|the plan) says \d+ \(truncated; refused before reading it\)")
def _(c, tmp):
    p = shard(c)
    p.write_bytes(p.read_bytes()[:-100])


@case("attestation re-signed with another key", r"no valid signature by the pinned key")
def _(c, tmp):
    p = att_path(shard(c))
    env = loads(p.read_bytes())
    p.write_bytes(dsse.envelope_line(dsse.sign(base64.b64decode(env["payload"]), Ed25519PrivateKey.generate())))


@case("attestation replayed from another block",
      r"attests 'r1-layer001-block001\.safetensors', not 'r1-layer001-block000\.safetensors' \(attestation replayed")
def _(c, tmp):
    shutil.copy(att_path(shard(c, block=1)), att_path(shard(c, block=0)))


@case("shard and attestation of another layer copied under this block's name",
      r"attests 'r1-layer003-block000\.safetensors', not 'r1-layer001-block000\.safetensors'")
def _(c, tmp):
    shutil.copy(shard(c, layer=3), shard(c, layer=1))
    shutil.copy(att_path(shard(c, layer=3)), att_path(shard(c, layer=1)))


@case("stage whose parent digest does not match (re-encoded parent)", r"chain edge broken")
def _(c, tmp):
    """The base fragment was re-encoded after its stage was built: everything is validly signed, but the
    stage corrects a reconstruction that no longer exists."""
    gen = torch.Generator().manual_seed(99)
    experts = {e: {pr: provkit.random_set(o, i, 2, "mul1", gen) for pr, (o, i) in provkit.DIMS.items()}
               for e in range(4)}
    p = shard(c, "k2", 1, 0)
    write_fragment(p, layout=STANDARD, node="k2", role="base", layer=1, block=0, K=2, codebook="mul1", experts=experts)
    attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                    quant_args={"seed": 0, "K": 2, "codebook": "mul1"}, node_digest=provkit.NODES["k2"]["digest"])
    write_base_manifest(c.root / "base/k2", node="k2", campaign=c.campaign, key=c.priv, derived=provkit.DERIVED)
    with pytest.raises(FqError, match="chain edge broken"):  # the producer refuses to plan it
        c.replan("k2r1r2", 2)
    plan = plan_of(c)  # still the old plan; make it name the new base so only the edge is wrong
    new_sha = sha256_hex(p.read_bytes())
    for f in plan["fragments"]:
        if f["name"] == c.frag("k2", 1, 0):
            f.update(sha256=new_sha, attestation_sha256=sha256_hex(att_path(p).read_bytes()))
    write_signed_plan(c, plan)


@case("signed plan whose stage edge names another parent digest",
      r"records parent .* but the plan's k2 fragment is .* \(chain edge broken\)")
def _(c, tmp):
    plan = plan_of(c)
    for f in plan["fragments"]:
        if f["name"] == c.frag("r1", 1, 0):
            f["parent"]["sha256"] = "0" * 64
    write_signed_plan(c, plan)


@case("older plan version", r"plan version 1 is older than version 2 already seen for k2r1r2 \(rollback refused\)",
      via=())
def _(c, tmp):
    state = PlanState(tmp / "state.json")
    old = c.plans["k2r1r2"].read_bytes()
    c.replan("k2r1r2", 2)
    combine(c.plans["k2r1r2"], c.pub, tmp / "a.safetensors", now=NOW, state=state)
    c.plans["k2r1r2"].write_bytes(old)
    msgs = []
    for fn in (lambda: combine(c.plans["k2r1r2"], c.pub, tmp / "b.safetensors", now=NOW, state=state),
               lambda: _verify_raises(c, state)):
        with pytest.raises(FqError) as e:
            fn()
        msgs.append(str(e.value))
    with pytest.raises(FqError, match="older than the required minimum 3"):
        combine(c.plans["k2r1r2"], c.pub, tmp / "b.safetensors", now=NOW, min_version=3)
    return msgs


def _verify_raises(c, state):
    problems = verify_path(c.root, c.pub, now=NOW, state=state).problems
    raise FqError("\n".join(problems))


@case("a different plan under an already-seen version", r"different plan with the same version 1", via=())
def _(c, tmp):
    state = PlanState(tmp / "state.json")
    combine(c.plans["k2r1r2"], c.pub, tmp / "a.safetensors", now=NOW, state=state)
    c.replan("k2r1r2", 1, expires=provkit.EXPIRES - dt.timedelta(days=1))
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1r2"], c.pub, tmp / "b.safetensors", now=NOW, state=state)
    return [str(e.value)]


@case("expired plan", r"plan expired at 2029-12-31T00:00:00Z \(now 2030-01-01T00:00:00Z\)")
def _(c, tmp):
    c.replan("k2r1r2", 2, expires=dt.datetime(2029, 12, 31, tzinfo=dt.timezone.utc))


@case("stage shard without its Hadamard sign vectors, signed by a buggy pipeline",
      r"expert 0 gate_proj: missing suh, svh \(without its Hadamard sign vectors a stage reconstructs nothing\)")
def _(c, tmp):
    p = shard(c)
    from safetensors import safe_open
    from fq.model.shards import RawTensor, write_shard
    with safe_open(p, "pt") as f:
        meta = f.metadata()
        keep = [k for k in f.keys() if not k.endswith((".suh", ".svh"))]
        tensors = {k: f.get_tensor(k) for k in keep}
    order = [k for e in range(4) for pr in STANDARD.projections for k in
             (STANDARD.key(1, e, pr, "trellis"), STANDARD.key(1, e, pr, "mcg"))]
    tmpfile = tmp / "broken.safetensors"
    write_shard(tmpfile, [RawTensor.of(k, tensors[k]) for k in order], meta)
    forge_signed(c, p, tmpfile.read_bytes())


@case("duplicate keys in an attestation's JSON", r"duplicate JSON key 'payload'")
def _(c, tmp):
    p = att_path(shard(c))
    line = p.read_bytes().rstrip(b"\n")
    p.write_bytes(line[:-1] + b',"payload":"e30="}\n')


@case("duplicate keys inside a signed plan", r"duplicate JSON key 'version'")
def _(c, tmp):
    payload = dumps({"_type": "https://in-toto.io/Statement/v1", "predicateType": "https://fq.dev/assembly/v1",
                     "predicate": dict(plan_of(c), version=99), "subject": []})
    payload = payload.replace(b'"version":99', b'"version":1,"version":99')
    write_signed_plan(c, None, raw_payload=payload)


@case("fragment name with '..' in a signed plan", r"contains '\.\.'; names may not leave the tree")
def _(c, tmp):
    plan = plan_of(c)
    victim = plan["fragments"][-1]
    outside = tmp / "outside"
    outside.mkdir()
    shutil.copy(c.root / victim["name"], outside / "x.safetensors")
    victim["name"] = "stages/../../outside/x.safetensors"
    write_signed_plan(c, plan)


@case("absolute fragment name in a signed plan", r"absolute path '/.*' refused")
def _(c, tmp):
    plan = plan_of(c)
    plan["fragments"][-1]["name"] = str(c.root / plan["fragments"][-1]["name"])
    write_signed_plan(c, plan)


@case("symlink where a shard should be", r"r1-layer001-block000\.safetensors:? is a symlink")
def _(c, tmp):
    p = shard(c)
    copy = tmp / "elsewhere.safetensors"
    shutil.copy(p, copy)  # identical bytes: only the indirection is wrong
    p.unlink()
    p.symlink_to(copy)


@case("symlinked directory on the way to a shard", r"stages/r1:? is a symlink")
def _(c, tmp):
    d = c.root / "stages/r1"
    shutil.copytree(d, tmp / "r1-copy")
    shutil.rmtree(d)
    d.symlink_to(tmp / "r1-copy")


@case("FIFO where a shard should be", r"r1-layer001-block000\.safetensors:? is a FIFO")
def _(c, tmp):
    p = shard(c)
    p.unlink()
    os.mkfifo(p)


@case("safetensors header lying about offsets (two tensors' offsets exchanged)",
      r"safetensors header differs from the attested one")
def _(c, tmp):
    a, b = STANDARD.key(1, 0, "gate_proj", "trellis"), STANDARD.key(1, 1, "gate_proj", "trellis")

    def swap(h):
        h[a]["data_offsets"], h[b]["data_offsets"] = h[b]["data_offsets"], h[a]["data_offsets"]
    header_edit(shard(c), swap)


@case("safetensors header with overlapping tensors", r"overlaps")
def _(c, tmp):
    k = STANDARD.key(1, 0, "gate_proj", "suh")

    def overlap(h):
        b, e = h[k]["data_offsets"]
        h[k]["data_offsets"] = [b - 64, e - 64]
    header_edit(shard(c), overlap)


@case("safetensors header with a gap (offsets shifted)", r"gap before tensor")
def _(c, tmp):
    def shift(h):
        last = max((v for k, v in h.items() if k != "__metadata__"), key=lambda v: v["data_offsets"][1])
        last["data_offsets"] = [last["data_offsets"][0] + 2, last["data_offsets"][1] + 2]
    header_edit(shard(c), shift)


@case("plan re-signed with another key", r"no valid signature by the pinned key")
def _(c, tmp):
    write_signed_plan(c, plan_of(c), key=Ed25519PrivateKey.generate())


@case("fragment from another campaign under the same key", r"campaign identity differs in 'name'")
def _(c, tmp):
    other = campaign_identity(**{**{k: c.campaign[k] for k in ("name", "block_size", "signer", "encoder")},
                                 "name": "another-campaign", "source_repo": c.campaign["source"]["repo"],
                                 "source_revision": c.campaign["source"]["revision"]})
    p = shard(c)
    parent = attested(c, p)["predicate"]["parent"]
    attest_fragment(p, key=c.priv, campaign=other, source=c.source, encoder=provkit.encoder(),
                    quant_args={"seed": 0, "K": 1, "codebook": "mcg"}, node_digest=provkit.NODES["r1"]["digest"],
                    parent=parent)


@case("plan that states a wrong runtime constant (K) for a stage",
      r"attested stage K=1 mcg, the plan's chain says stage K=3 mcg")
def _(c, tmp):
    plan = plan_of(c)
    plan["chain"][1]["K"] = 3
    write_signed_plan(c, plan)


@case("stage with a transposed linear (geometry differs from its parent)",
      r"expert 0 gate_proj is 128x256, its parent chain has 256x128|is 128x256 \(in x out\)")
def _(c, tmp):
    gen = torch.Generator().manual_seed(5)
    experts = {e: {pr: provkit.random_set(o, i, 1, "mcg", gen) for pr, (o, i) in provkit.DIMS.items()}
               for e in range(4)}
    experts[0]["gate_proj"] = provkit.random_set(256, 128, 1, "mcg", gen)  # (out, in) swapped
    p = shard(c)
    tmpfile = tmp / fragment_filename("r1", 1, 0)
    write_fragment(tmpfile, layout=STANDARD, node="r1", role="stage", layer=1, block=0, K=1, codebook="mcg",
                   experts=experts)
    forge_signed(c, p, tmpfile.read_bytes())
    with pytest.raises(FqError, match="a chain must keep the geometry"):  # the producer refuses to plan it
        c.replan("k2r1", 5)


@case("--base is another base than the plan's", r"manifest sha256 .* is not the base this plan was built on",
      via=("combine",), base="base/k2")
def _(c, tmp):
    (c.root / "base/k2/source_config.json").write_text('{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4}')
    write_derived(c.root / "base/k2", bits=2, codebook="mul1")
    write_base_manifest(c.root / "base/k2", node="k2", campaign=c.campaign, key=c.priv, derived=provkit.DERIVED)


@case("--base whose parent byte ranges differ from the plan's", r"bytes of expert 1 do not match",
      via=("combine",), base="base/k2")
def _(c, tmp):
    p = shard(c, "k2", 1, 0)
    off, n = ranges(c, p)[1]
    data = bytearray(p.read_bytes())
    data[off + 3] ^= 0x80
    p.write_bytes(bytes(data))
    # without --base the base payload is the consumer's own and is not read
    combine(c.plans["k2r1r2"], c.pub, tmp / "nobase.safetensors", now=NOW)


@case("stray file in a published tree", r"stages/r1/notes\.txt: not covered by any attestation", via=("verify",))
def _(c, tmp):
    (c.root / "stages/r1/notes.txt").write_text("hello")


@case("shard without its attestation", r"r1-layer001-block000\.safetensors\.intoto\.jsonl: missing")
def _(c, tmp):
    att_path(shard(c)).unlink()


@case("plan file named for another product", r"file name does not match its product 'k2r1'", via=("verify",))
def _(c, tmp):
    shutil.copy(c.plans["k2r1"], c.plans["k2r1r2"])


@case("leftover temporary file of an interrupted write", r"leftover temporary file", via=("verify",))
def _(c, tmp):
    (c.root / "stages/r1/.tmp-r1-layer001-block000.safetensors.abc123").write_bytes(b"partial")


# --- the runner ---
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    """One valid campaign, built once; each case tampers with a private copy of it (provkit.private_copy)."""
    return provkit.build_campaign(tmp_path_factory.mktemp("pristine"))


@pytest.mark.parametrize("name", list(CASES))
def test_refused(name, pristine, tmp_path):
    fn, pattern, via, kw = CASES[name]
    c = provkit.private_copy(pristine, tmp_path / "c")
    custom = fn(c, tmp_path)
    messages = list(custom or [])
    if "verify" in via:
        problems = verify_path(c.root, c.pub, now=NOW).problems
        assert problems, f"{name}: verify accepted it"
        messages.append("\n".join(problems))
    if "combine" in via:
        base = c.root / kw["base"] if "base" in kw else None
        with pytest.raises(FqError) as e:
            combine(c.plans["k2r1r2"], c.pub, tmp_path / "out.safetensors", now=NOW, base_dir=base)
        messages.append(str(e.value))
        assert not (tmp_path / "out.safetensors").exists(), "nothing written on refusal"
    assert messages
    for m in messages:
        assert re.search(pattern, m), f"{name}: {m!r} does not match {pattern!r}"


def test_suite_size():
    assert len(CASES) == 32


def test_the_untampered_campaign_passes(pristine, tmp_path):
    c = provkit.private_copy(pristine, tmp_path / "c")
    assert verify_path(c.root, c.pub, now=NOW).ok
    combine(c.plans["k2r1r2"], c.pub, tmp_path / "out.safetensors", now=NOW)


def test_fragment_encoded_for_another_node_definition_is_refused(pristine, tmp_path):
    """A recipe change reruns a node and its descendants; a fragment of that node left from the older
    definition (validly signed, same campaign, same bytes, intact chain edges) carries the older
    node_digest. The producer refuses to plan it; a plan naming the current digest anyway (a buggy
    pipeline signed it) is refused by combine and verify."""
    c = provkit.private_copy(pristine, tmp_path / "c")
    p = shard(c)
    current = provkit.NODES["r1"]["digest"]
    stale = provkit.node_digest("r1", {"r1": {**provkit.DEFINITIONS["r1"], "K": 2}})  # r1 was K2
    assert stale != current
    attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                    quant_args={"seed": 7, "K": 1, "codebook": "mcg"}, node_digest=stale,
                    parent=attested(c, p)["predicate"]["parent"])
    msg = (rf"fragment stages/r1/r1-layer001-block000\.safetensors attests node_digest {stale[:16]}…, the chain's "
           rf"digest of node r1 is {current[:16]}…: encoded for another definition of node r1; re-encode it")
    with pytest.raises(FqError, match=r"plan k2r1r2: " + msg):
        c.replan("k2r1r2", 2)

    plan = plan_of(c)  # names the current digest; make it name the re-attested line so only the digest differs
    assert plan["chain"][1]["digest"] == current and plan["recipe_sha256"] == provkit.RECIPE_SHA256
    for f in plan["fragments"]:
        if f["name"] == c.frag("r1", 1, 0):
            f["attestation_sha256"] = sha256_hex(att_path(p).read_bytes())
    write_signed_plan(c, plan)
    with pytest.raises(FqError, match=msg):
        combine(c.plans["k2r1r2"], c.pub, tmp_path / "out.safetensors", now=NOW)
    assert not (tmp_path / "out.safetensors").exists()
    # fq verify: one line, the node's, naming the stale fragment and the digest the plans' chains name as current
    # (the plan that names the stale fragment does not report it again)
    problems = verify_path(c.root, c.pub, now=NOW).problems
    assert problems == [f"node r1: 1 of its 4 fragments was encoded for a stale definition (node_digest {stale[:16]}…: "
                        f"1 (stages/r1/r1-layer001-block000.safetensors)); the current definition is {current[:16]}…, "
                        "the digest the chain of plans k2r1, k2r1r2 names; re-encode the stale one"], problems
