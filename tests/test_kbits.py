"""K per projection and per layer (fq.core.kbits, issue 41's budgeted bases) on the fragment side: an expert fragment
holds one K per projection (exllamav3: one K per projection of a layer, for all its experts), its header and
attestation say so, every consumer checks each linear against its chain node's K at that layer for its projection,
and a uniform spec writes the bytes of a fixed-K fragment."""
from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.kits import provkit
from fq.core import kbits
from fq.errors import FqError
from fq.model.experts import STANDARD
from fq.model.shards import RawTensor, write_shard
from fq.provenance.fragments import describe, fragment_filename, write_fragment

ROOT = Path(__file__).resolve().parents[1]
MIXED = {"gate": 2, "up": 2, "down": 3}
META = '{"down":3,"gate":2,"up":2}'
PROJ_K = {"gate_proj": 2, "up_proj": 2, "down_proj": 3}


# -- the contract -------------------------------------------------------------------------------------------------
def test_half_integer_k_is_one_k_everywhere_a_spec_is():
    """exllamav3's half-integer rates (1.5, 2.5, 3.5: a float, never 2.0) in fragment and node specs, headers and
    JSON alike; the codebook (mul1 only) is checked where it is known (recipes, the encoder: fq.codec.rate)."""
    half = {"gate": 1.5, "up": 1.5, "down": 2.5}
    assert kbits.fragment(1.5) == 1.5 and kbits.is_one(2.5) and not kbits.is_one(half) and not kbits.is_one(True)
    assert kbits.fragment(half) == half and kbits.from_meta(kbits.to_meta(half)) == half
    assert kbits.to_meta(3.5) == "3.5" and kbits.from_meta("3.5") == 3.5 and kbits.from_meta("3") == 3
    assert kbits.node({"1": half, "2": 1.5}) == {1: half, 2: 1.5} and kbits.node({"1": 1.5, "2": 1.5}) == 1.5
    assert kbits.bits(half) == pytest.approx(11 / 6) and kbits.describe(half) == "gate/up K1.5, down K2.5"
    assert kbits.chain_bits([1.5, 1]) == 2.5
    for bad in (2.0, 1.25, 4.5, "1.5"):
        with pytest.raises(FqError, match="half-integer K 1.5, 2.5, 3.5"):
            kbits.fragment(bad)
    for bad in ("1.50", "2.0", "4.5", ".5"):
        with pytest.raises(FqError, match="K"):
            kbits.from_meta(bad)


def test_specs_normalise_and_have_one_header_form():
    assert kbits.fragment({"gate": 3, "up": 3, "down": 3}) == 3
    assert kbits.fragment(MIXED) == MIXED and kbits.to_meta(MIXED) == META and kbits.from_meta(META) == MIXED
    assert kbits.from_meta("3") == 3 and kbits.to_json(kbits.fragment(MIXED)) == MIXED
    for bad in ("03", "0", "9", "\u00b3", '{"gate":2,"up":2,"down":3}', '{"down":2,"gate":2,"up":2}', "[3]", "3.0"):
        with pytest.raises(FqError, match="K"):
            kbits.from_meta(bad)
    node = kbits.node({"1": MIXED, "3": 3})
    assert node == {1: MIXED, 3: 3} and kbits.node_at({"1": MIXED, "3": 3}, 1) == MIXED
    assert kbits.node({"1": 3, "3": 3}) == 3 and kbits.node_at(2, 7) == 2
    for bad in ({"x": 3}, {"01": 3}, {-1: 3}, {True: 3}, {"1": 3, 1: 3}):
        with pytest.raises(FqError, match="layer"):
            kbits.node(bad)
    with pytest.raises(FqError, match="no K for layer 2"):
        kbits.node_at({"1": MIXED}, 2)
    assert kbits.of_layout(MIXED, ("w1", "w3", "w2")) == {"w1": 2, "w3": 2, "w2": 3}
    assert kbits.chain_bits([2, 1]) == 3 and isinstance(kbits.chain_bits([2, 1]), int)
    assert kbits.chain_bits([{"1": MIXED, "3": 3}, 1]) == pytest.approx(1 + (7 / 3 + 3) / 2)


# -- the fragment -------------------------------------------------------------------------------------------------
def _experts(spec, experts=(0, 1), seed=0, codebook="mul1") -> dict:
    g = torch.Generator().manual_seed(seed)
    return {e: {p: provkit.random_set(o, i, kbits.proj(spec, c), codebook, g)
                for (p, (o, i)), c in zip(provkit.DIMS.items(), kbits.PROJECTIONS)} for e in experts}


def test_a_fragment_with_K_per_projection_round_trips(tmp_path):
    path = tmp_path / fragment_filename("kb", 1, 0)
    sets = _experts(MIXED)
    info = write_fragment(path, layout=STANDARD, node="kb", role="base", layer=1, block=0, K=MIXED,
                          codebook="mul1", experts=sets)
    assert info.meta["K"] == MIXED
    assert {(p, lin.K) for (_, p), lin in info.linears.items()} == set(PROJ_K.items())
    with safe_open(str(path), "pt") as f:  # the safetensors library reads it as any fragment
        assert f.metadata()["K"] == META
        for e in sets:
            for p, tset in sets[e].items():
                for s, t in tset.items():
                    assert torch.equal(f.get_tensor(STANDARD.key(1, e, p, s)), t)
    with open(path, "rb") as fh:
        again = describe(fh, path.name)
    assert again.sha256 == info.sha256 and again.meta["K"] == MIXED
    # its JSON form is the same spec, and a uniform mapping is its int: a fixed-K fragment's bytes
    json_path = tmp_path / "json" / path.name
    write_fragment(json_path, layout=STANDARD, node="kb", role="base", layer=1, block=0, K=json.loads(META),
                   codebook="mul1", experts=sets)
    assert json_path.read_bytes() == path.read_bytes()
    uni = _experts(2, seed=1)
    a, b = tmp_path / "a" / path.name, tmp_path / "b" / path.name
    write_fragment(a, layout=STANDARD, node="kb", role="base", layer=1, block=0, K=2, codebook="mul1", experts=uni)
    write_fragment(b, layout=STANDARD, node="kb", role="base", layer=1, block=0, K={"gate": 2, "up": 2, "down": 2},
                   codebook="mul1", experts=uni)
    assert a.read_bytes() == b.read_bytes()
    with safe_open(str(b), "pt") as f:
        assert f.metadata()["K"] == "2"


def test_the_writer_refuses_tensors_not_at_their_projections_K(tmp_path):
    path = tmp_path / fragment_filename("kb", 1, 0)
    with pytest.raises(FqError, match=r"expert 0 down_proj: tensors are K=3 mul1, fragment declares K=2 mul1"):
        write_fragment(path, layout=STANDARD, node="kb", role="base", layer=1, block=0, K=2, codebook="mul1",
                       experts=_experts(MIXED))
    with pytest.raises(FqError, match=r"expert 0 gate_proj: tensors are K=2 mul1, fragment declares K=3 mul1"):
        write_fragment(path, layout=STANDARD, node="kb", role="base", layer=1, block=0,
                       K={"gate": 3, "up": 2, "down": 3}, codebook="mul1", experts=_experts(MIXED))
    with pytest.raises(FqError, match="exactly the projections gate, up, down"):
        write_fragment(path, layout=STANDARD, node="kb", role="base", layer=1, block=0, K={"gate": 2, "up": 2},
                       codebook="mul1", experts=_experts(MIXED))
    assert not path.exists()


@pytest.mark.parametrize("K, message", [
    ("2", r"expert 0 down_proj: tensors imply K=3 codebook=mul1, header metadata says K=2 codebook=mul1"),
    ('{"down":2,"gate":2,"up":3}', r"expert 0 up_proj: tensors imply K=2 codebook=mul1, header metadata says K=3 for "
                                   r"up_proj \(gate K2, up K3, down K2\)"),
    ('{"gate":2,"up":2,"down":3}', r"header metadata K: expected an integer K or the canonical JSON"),
    ('{"down":2,"gate":2,"up":2}', r"header metadata K: expected an integer K or the canonical JSON"),
])
def test_a_header_K_that_is_not_the_tensors_is_refused_naming_file_and_projection(tmp_path, K, message):
    """A fragment written around fq's writer (its header K not its tensors'): every reader refuses it."""
    path = tmp_path / fragment_filename("kb", 1, 0)
    sets = _experts(MIXED, experts=(0,))
    raws = [RawTensor.of(STANDARD.key(1, 0, p, s), sets[0][p][s]) for p in STANDARD.projections
            for s in ("trellis", "suh", "svh", "mul1")]
    meta = {"format": "fq-fragment/1", "kind": "expert", "node": "kb", "role": "base", "layer": "1", "block": "0",
            "K": K, "codebook": "mul1", "layout": json.dumps(STANDARD.to_json(), separators=(",", ":"))}
    write_shard(path, raws, meta)
    with open(path, "rb") as fh, pytest.raises(FqError, match=message) as e:
        describe(fh, path.name, str(path))
    assert str(e.value).startswith(str(path))


# -- an encode job with K per projection, and its consumers ---------------------------------------------------------
sys.path.insert(0, str(ROOT / "benchmarks"))
import encode_job as bench  # noqa: E402


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    return bench.small_campaign(tmp_path_factory.mktemp("synth"))


def _encode(synth, out: Path, K) -> list[dict]:
    from fq.workflow.encode import encode_blocks

    jobs = bench.block_jobs(out, 1, 2, synth["shard"], synth["names"], K, "mul1")
    return encode_blocks(jobs, campaign_json=str(synth["campaign"]), key_path=str(synth["key"]), device="cpu",
                         devices_list=[], lock_dir=str(out / "locks"), seed=0, layout=STANDARD, threads=1)


def _files(out: Path) -> dict:
    return {str(p.relative_to(out)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(out.rglob("*")) if p.is_file() and "locks" not in p.parts}


def _product(att, K) -> "object":
    """A one-node chain whose node has K ``K`` (a node spec as JSON), naming the fragment ``att`` as its plan would."""
    from fq.provenance.assembly import SignedPlan
    from fq.provenance.product import VerifiedProduct

    p = att.predicate
    chain = [{"node": p["node"], "role": "base", "K": K, "codebook": "mul1", "parent": None,
              "digest": p["node_digest"]}]
    entry = {"name": att.name, "sha256": att.sha256, "attestation_sha256": att.attestation_sha256,
             "node": p["node"], "layer": p["layer"], "block": p["block"], "size": p["shard"]["size"],
             "header_sha256": p["shard"]["header_sha256"], "parent": None, "experts": p["experts"]}
    return VerifiedProduct(SignedPlan("plan", "0" * 64, {"chain": chain, "fragments": [entry]}), Path("."), None), entry


def test_an_encode_with_K_per_projection_commits_what_verify_accepts(synth, tmp_path):
    from safetensors.torch import load_file

    from fq.provenance.attest import keys
    from fq.provenance.attest.fragment import verify_shard

    out = tmp_path / "mixed"
    [summary] = _encode(synth, out, {"gate": 1, "up": 1, "down": 2})
    assert summary["K"] == {"gate": 1, "up": 1, "down": 2}
    frag = next(out.rglob("*.safetensors"))
    pub = keys.load_private(synth["key"]).public_key()
    att = verify_shard(frag.parent, frag.name, pub)
    assert att.predicate["K"] == {"gate": 1, "up": 1, "down": 2} == att.predicate["quant_args"]["K"]
    assert {p: t.shape[-1] // 16 for p in STANDARD.projections for k, t in load_file(str(frag)).items()
            if k.endswith(f"{p}.trellis")} == {"gate_proj": 1, "up_proj": 1, "down_proj": 2}
    layer = att.predicate["layer"]
    for node_K in ({str(layer): {"gate": 1, "up": 1, "down": 2}}, {str(layer): {"gate": 1, "up": 1, "down": 2},
                                                                   str(layer + 1): 4}):
        product, entry = _product(att, node_K)
        product.check_fragment(att, entry, "here")
    for node_K, message in (({str(layer): {"gate": 1, "up": 2, "down": 2}}, "attested base gate/up K1, down K2 mul1, "
                             "the plan's chain says base gate K1, up K2, down K2 mul1 at layer"),
                            (2, "attested base gate/up K1, down K2 mul1, the plan's chain says base K=2 mul1"),
                            ({str(layer + 1): {"gate": 1, "up": 1, "down": 2}}, f"no K for layer {layer}")):
        product, entry = _product(att, node_K)
        with pytest.raises(FqError, match=message):
            product.check_fragment(att, entry, "here")


def test_a_uniform_spec_encodes_the_bytes_of_an_int_K(synth, tmp_path):
    a, b = tmp_path / "int", tmp_path / "uniform"
    _encode(synth, a, 2)
    _encode(synth, b, {"gate": 2, "up": 2, "down": 2})
    assert _files(a) == _files(b) and len(_files(a)) == 3  # fragment, attestation, metrics
    frag = next(a.rglob("*.safetensors"))
    with safe_open(str(frag), "pt") as f:
        assert f.metadata()["K"] == "2"
    assert json.loads(next(a.rglob("*.intoto.jsonl")).read_bytes())  # one line


# -- a whole published product with a stage at K per layer and projection ---------------------------------------
R1 = {"1": {"gate": 1, "up": 1, "down": 2}, "2": 2}


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    from tests.kits import runtimekit as rk

    return rk.build(tmp_path_factory.mktemp("rt-mixed"), K={"r1": R1})


def test_a_product_with_K_per_layer_and_projection_verifies_loads_and_combines(kit, tmp_path):
    from tests.kits import runtimekit as rk
    from fq.provenance.adapter import read_adapter
    from fq.provenance.combine import combine
    from fq.provenance.product import open_product
    from fq.provenance.publication import read_publication
    from fq.provenance.verify import verify_path
    from fq.runtime import load as rt
    from fq.runtime.evaluate import effective_bpw

    report = verify_path(kit.root, kit.pub)
    assert report.ok, report.problems
    plan = open_product(kit.plan("k2.r1"), kit.pub).predicate
    assert [n["K"] for n in plan["chain"]] == [2, R1]
    bits_r1 = (4 / 3 + 2) / 2
    assert read_publication(kit.root, kit.pub).predicate["products"]["k2.r1"]["bpw"] == pytest.approx(2 + bits_r1)
    assert read_publication(kit.root, kit.pub).predicate["products"]["k2"]["bpw"] == 2
    assert effective_bpw(plan) == pytest.approx(2 + bits_r1)
    state = rt.product_state(kit.plan("k2.r1"), kit.pub)
    for layer in rk.LAYERS:
        for e in range(rk.N_EXPERTS):
            for proj in rk.DIMS:
                want = kit.chain_weight(["k2", "r1"], layer, e, proj)
                assert torch.equal(state.tensors[state.expert_key(layer, e, proj)], want), (layer, e, proj)
    adapter = tmp_path / "a.safetensors"
    res = combine(kit.plan("k2.r1"), kit.pub, adapter, base_dir=kit.base_dir)
    assert [s["K"] for s in res.stages] == [R1]
    read_adapter(adapter)
    b = rt.adapter_state(kit.base_dir, adapter, kit.plan("k2.r1"), kit.pub)
    for key, t in state.tensors.items():
        assert torch.equal(b.tensors[key], t), key


def test_a_chain_whose_K_is_not_its_fragments_is_refused(kit, tmp_path):
    """The plan builder re-derives each linear's K and compares it with its chain node's at that layer for its
    projection: a chain entry saying K2 everywhere for r1 is refused."""
    from tests.kits import runtimekit as rk
    from fq.provenance.assembly import build_assembly

    chain = [rk.chain_entry("k2"), dict(rk.chain_entry("r1", {**rk.NODES, "r1": {**rk.NODES["r1"], "K": R1}}))]
    names = [kit.frag(n, layer, b) for n in ("k2", "r1") for layer in rk.LAYERS for b in range(rk.N_EXPERTS // rk.BLOCK)]
    kw = dict(product="k2.r1", fragments=names, base_dir="base/k2", campaign=kit.campaign,
              recipe_sha256=rk.RECIPE_SHA256, version=1, expires=provkit.EXPIRES, public_key=kit.pub)
    build_assembly(kit.root, chain=chain, **kw)  # as built
    for K, message in ((2, r"r1-layer001-block000.safetensors: tensors are \[\(1, 'mul1'\)\], the chain says K=2 mul1"),
                       ({"1": {"gate": 1, "up": 2, "down": 2}, "2": 2},
                        r"tensors are \[\(1, 'mul1'\)\], the chain says up_proj at layer 1 K=2 mul1"),
                       ({"1": {"gate": 1, "up": 1, "down": 2}}, r"chain node r1 K: no K for layer 2")):
        with pytest.raises(FqError, match=message):
            build_assembly(kit.root, chain=[chain[0], dict(chain[1], K=K)], **kw)


def test_a_budgeted_base_with_K_per_layer_and_projection_is_published_verified_and_loaded(tmp_path):
    """The base itself at K per layer and projection: its manifest declares the node spec as its derived params' bits
    (fq.provenance.exl3config checks every module's trellis against its layer's projection), fq verify accepts the
    tree, and the CPU runtime loads every chain's weights."""
    from tests.kits import runtimekit as rk
    from fq.provenance.verify import verify_path
    from fq.runtime import load as rt

    base_K = {"1": MIXED, "2": 3}
    kit = rk.build(tmp_path / "kit", K={"k2": base_K})
    report = verify_path(kit.root, kit.pub)
    assert report.ok, report.problems
    for product in ("k2", "k2.r1.h2"):
        state = rt.product_state(kit.plan(product), kit.pub)
        for layer in rk.LAYERS:
            for e in range(rk.N_EXPERTS):
                for proj in rk.DIMS:
                    want = kit.chain_weight(rk.PRODUCTS[product], layer, e, proj)
                    assert torch.equal(state.tensors[state.expert_key(layer, e, proj)], want), (product, layer, e)


def test_a_tp_export_of_a_stage_at_K_per_layer_and_projection_is_admitted(kit, tmp_path):
    """fq tp-export cuts (here: by experts, ep=2) a product whose stage has K per layer and projection: each rank
    shard's record and header carry the fragment's spec, and the export is admitted against the signed plan."""
    from fq.tp.export import tp_export
    from fq.tp.mesh import DeviceMesh, plan
    from fq.tp.moe import moe_manifest
    from fq.tp.sources import ExportSource, ProductSource

    ex = tp_export(kit.plan("k2.r1"), kit.pub, tmp_path / "x", tp=1, ep=2, sign_key=kit.priv)
    src = ProductSource(kit.plan("k2.r1"), kit.pub)
    ExportSource(ex.path, kit.pub, product=src).admit(plan(moe_manifest(src.spec(), "contiguous"),
                                                          DeviceMesh(tp=1, ep=2)), [0, 1])
    shards = sorted(ex.path.glob("rank-*/r1-layer00*-block000.safetensors"))
    assert shards
    for f in shards:
        with safe_open(str(f), "pt") as h:
            assert kbits.from_meta(h.metadata()["K"]) == kbits.node_at(R1, int(f.name[8:11]))
