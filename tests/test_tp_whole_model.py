"""A whole-model base on the mesh: its quantized attention, dense MLP, shared expert and lm_head are declared by the
split rule tp-export cuts them with (fq.tp.linears.split_dims), planned with one all-reduce per row-split linear,
and loaded by the weight store from both sources, with the experts' admission, journal and rollback.

The campaign is tpkit.build_whole: at tp=2 attention (2 heads of 128) and the dense MLP (256) split, the shared
expert (128) and lm_head (384) stay whole. Reconstructions are compared bit for bit (torch.equal): concatenating the
ranks' reconstructions of a split linear is exactly the unsliced reconstruction (fq.tp.slicing); summing a row-split
linear's partial outputs, which the declared all-reduce does, is exact to float32 rounding only."""
import json
import shutil

import pytest
import torch

from tests.kits import provkit
from tests.kits import tpkit
from fq.cli import main
from fq.codec import reconstruct
from fq.core.canonical import loads, sha256_hex
from fq.errors import FqError
from fq.provenance.attest import dsse
from fq.tp import records
from fq.tp.manifest import TpManifest, Replicate, SplitInput, SplitOutput, WeightEntry
from fq.tp.mesh import DeviceMesh, plan
from fq.tp.moe import moe_manifest
from fq.tp.slicing import assemble
from fq.tp.sources import ExportSource
from fq.tp.store import InjectedFault, WeightStore
from tests.kits.tpkit import one_thread  # noqa: F401  (autouse fixture)

PREFIXES = [p for shapes in tpkit.LINEARS.values() for p in shapes]
SPLIT_AT_TP2 = {**{f"model.layers.{L}.self_attn.{x}_proj": 0 for L in range(4) for x in "qkv"},
                **{f"model.layers.{L}.self_attn.o_proj": 1 for L in range(4)},
                **{f"model.layers.{L}.mlp.{x}_proj": 0 for L in (0, 2) for x in ("gate", "up")},
                **{f"model.layers.{L}.mlp.down_proj": 1 for L in (0, 2)}}


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-whole")
    c = tpkit.build_whole(tmp)
    exports = {(tp, ep): tpkit.export(c, tmp / f"export-tp{tp}-ep{ep}", tp, ep).path for tp, ep in ((2, 1), (2, 2))}
    return c, exports


def load(source, tp=1, ep=1, pp=1, devices=None, **kw):
    p = tpkit.whole_plan(source, tp, ep, pp)
    store = WeightStore(p.mesh)
    return store, store.fulfill(p, source, devices or ["cpu"] * p.mesh.size, **kw)


def predicate(path):
    return json.loads(dsse.b64decode(loads(path.read_bytes())["payload"], "x"))["predicate"]


def test_the_manifest_declares_each_linear_as_tp_export_cuts_it(world):
    c, exports = world
    src = tpkit.product_source(c)
    m2 = moe_manifest(src.spec(), "contiguous", 2)
    for prefix in PREFIXES:
        e = m2.entry(f"{prefix}.weight")
        assert e.expert is None and e.dtype == "exl3"
        dim = SPLIT_AT_TP2.get(prefix)
        assert e.policy == (SplitOutput() if dim == 0 else SplitInput(f"{prefix}_reduce") if dim == 1 else Replicate())
    assert m2.entry("lm_head.weight").role == "head" and m2.entry("lm_head.weight").layer is None
    # one all-reduce per row-split linear, besides each MoE layer's: declared, and scheduled once each, never merged
    p = plan(m2, DeviceMesh(tp=2))
    assert [(s.op, s.axes, s.groups) for s in p.schedule] == [
        ("model.layers.1.mlp.experts.down_reduce", ("tp", "ep"), ((0, 1),)),
        ("model.layers.3.mlp.experts.down_reduce", ("tp", "ep"), ((0, 1),)),
        *[(f"model.layers.{L}.self_attn.o_proj_reduce", ("tp",), ((0, 1),)) for L in range(4)],
        *[(f"model.layers.{L}.mlp.down_proj_reduce", ("tp",), ((0, 1),)) for L in (0, 2)]]
    assert [s.contributors for s in p.schedule[2:]] == [
        *[(f"model.layers.{L}.self_attn.o_proj.weight",) for L in range(4)],
        *[(f"model.layers.{L}.mlp.down_proj.weight",) for L in (0, 2)]]
    # at tp=4 the 2 heads and the dense MLP's 256 do not divide: every linear whole, no reduction of its own
    m4 = moe_manifest(src.spec(), "contiguous", 4)
    assert all(m4.entry(f"{x}.weight").policy == Replicate() for x in PREFIXES) and len(m4.collectives) == 2
    # the manifest is bound to its tp; an experts-only product's is not (and keeps its identity)
    assert m2.tp == 2 and m2.sha256 != m4.sha256
    with pytest.raises(FqError, match=r"mesh: tp=4, but the manifest was declared for tp=2 .*declare it for tp=4"):
        plan(m2, DeviceMesh(tp=4))
    with pytest.raises(FqError, match="declare its manifest for one tp"):
        moe_manifest(src.spec())
    spec = src.spec()
    experts_only = type(spec)(spec.layout, spec.layers)
    assert moe_manifest(experts_only, "contiguous", 2).sha256 == moe_manifest(experts_only).sha256
    assert "linears" not in experts_only.to_json() and moe_manifest(experts_only).tp is None
    # tp-export cut each linear exactly as the plan places it, and bound the index to this manifest
    ex = ExportSource(exports[(2, 1)], c.pub)
    assert ex.index["manifest_sha256"] == m2.sha256 and ex.spec() == spec
    for t in (0, 1):
        got = {name: sl for name, (_, sl, _) in ex.linear_sets(t).items()}
        assert got == {pl.entry.removesuffix(".weight"): pl.slice for pl in p.for_rank(t)
                       if pl.entry.removesuffix(".weight") in PREFIXES}


def test_mesh_plan_lists_the_linears_and_their_reductions(world, capsys):
    c, _ = world
    assert main(["mesh-plan", "--key", str(c.pub_path), str(c.plans[tpkit.PRODUCT]), "--tp", "2", "--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 0: layers 0, 1; ranks [0, 1]" in out and "stage 1: layers 2, 3; ranks [2, 3]" in out
    assert "layer 0 attention: in[128:256] [Replicate(), Shard(1)]" in out and "no layer head: whole" in out
    assert "#6 all_reduce model.layers.0.mlp.down_proj_reduce (layer 0, stage 0) over tp: groups [[0, 1]]" in out


@pytest.mark.parametrize("tp, ep, pp", [(2, 1, 1), (2, 2, 1), (2, 1, 2), (4, 1, 1)])
def test_loaded_linears_reconstruct_the_whole_linear_bit_for_bit(world, tp, ep, pp):
    """Split: the ranks' reconstructions, concatenated, are the unsliced reconstruction (torch.equal). Whole: every
    rank of the linear's stage holds the whole linear. The row-split linears' partial outputs, summed over each
    group the plan's all-reduce step names, give the whole output to float32 rounding."""
    c, exports = world
    sources = [tpkit.product_source(c)] + ([ExportSource(exports[(tp, ep)], c.pub)] if (tp, ep) in exports else [])
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    for source in sources:
        store, loaded = load(source, tp, ep, pp)
        p = loaded.plan
        last = p.stages[-1].ranks
        for prefix in PREFIXES:
            name, full = f"{prefix}.weight", reconstruct(c.sets[prefix])
            pls = [pl for pl in p.placements if pl.entry == name]
            layer = p.manifest.entry(name).layer
            assert {pl.rank for pl in pls} == set(last if layer is None else
                                                  next(s.ranks for s in p.stages if layer in s.layers))
            dim = SPLIT_AT_TP2.get(prefix) if tp == 2 else None
            assert {pl.slice.dim if pl.slice else None for pl in pls} == {dim}, prefix
            if dim is None:
                assert all(torch.equal(loaded.weight(pl.rank, name), full) for pl in pls), prefix
                continue
            for group in {tuple(g) for g in _groups(p, pls)}:
                pieces = [(pl.slice, loaded.weight(pl.rank, name)) for pl in pls if pl.rank in group]
                assert len(pieces) == tp and torch.equal(assemble(pieces), full), prefix
            if dim == 1:
                step = next(s for s in p.schedule if s.contributors == (name,))
                for group in step.groups:
                    parts = [x[:, pl.slice.start:pl.slice.stop] @ loaded.weight(pl.rank, name).t()
                             for pl in pls if pl.rank in group]
                    torch.testing.assert_close(sum(parts), x[:, :full.shape[1]] @ full.t(), rtol=1e-5, atol=1e-6)
        store.unload()
        assert store.allocations == store.releases


def _groups(p, pls):
    """The ranks of each (pp, ep) replica of a split linear: one tp group each."""
    out: dict = {}
    for pl in pls:
        co = p.mesh.coords(pl.rank)
        out.setdefault((co["pp"], co["ep"]), []).append(pl.rank)
    return out.values()


def test_both_sources_hand_the_store_the_same_linear_bytes(world):
    c, exports = world
    p = tpkit.whole_plan(tpkit.product_source(c), 2, 2)
    a = tpkit.product_source(c).admit(p, range(4))
    b = ExportSource(exports[(2, 2)], c.pub).admit(p, range(4))
    assert tpkit.unit_bytes(a) == tpkit.unit_bytes(b)
    linear_units = [u for u in a if u.views[0].entry.removesuffix(".weight") in PREFIXES]
    assert len(linear_units) == 4 * len(PREFIXES)  # one unit per linear and rank


def test_fault_injection_at_every_step_of_a_load_with_linears_rolls_back_and_retry_succeeds(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    p = tpkit.whole_plan(src, 2)
    store = WeightStore(p.mesh)
    units = src.admit(p, [1])
    total = len(units)
    assert sum(u.views[0].entry.removesuffix(".weight") in PREFIXES for u in units) == len(PREFIXES)
    # rank 1's load (one process's, as test_tp_collective loads): every allocation, experts' and linears'; the
    # experts-only sweep over both ranks is test_tp_store's
    for n in range(total + 1):
        with pytest.raises(InjectedFault):
            store.fulfill(p, src, {1: "cpu"}, fault_after=n)
        assert store.allocations == store.releases and store.loaded is None
    before = store.allocations
    loaded = store.fulfill(p, src, {1: "cpu"})  # immediate retry
    assert store.allocations - before == total and store.releases == before
    name = "model.layers.3.self_attn.o_proj.weight"
    assert torch.equal(loaded.weight(1, name), reconstruct(c.sets[name.removesuffix(".weight")])[:, 128:])
    store.unload()
    assert store.allocations == store.releases


def test_a_rank_reads_only_its_own_linear_ranges(world, monkeypatch):
    """tp 2 x pp 2, rank 3 (stage 1, tp rank 1): the ranges of tp rank 1's shards of layers 2 and 3 and the head,
    each once, and no other linear shard."""
    from fq.tp import linears

    c, exports = world
    reads = []
    real = linears.read_range

    def spy(fh, offset, length, source):
        reads.append((source.rsplit("/", 2)[-2] + "/" + source.rsplit("/", 1)[-1], offset, length))
        return real(fh, offset, length, source)
    monkeypatch.setattr(linears, "read_range", spy)
    src = ExportSource(exports[(2, 1)], c.pub)
    p = tpkit.whole_plan(src, 2, pp=2)
    WeightStore(p.mesh).fulfill(p, src, {3: "cpu"})
    files = ["linears-tp1/attention-K2-mul1-layer002.safetensors", "linears-tp1/attention-K2-mul1-layer003.safetensors",
             "linears-tp1/dense-K2-mul1-layer002.safetensors", "linears-tp1/shared-K2-mul1-layer003.safetensors",
             "linears-tp1/head-K3-mul1-head.safetensors"]
    want = [(f, x["offset"], x["length"]) for f in files if (exports[(2, 1)] / f).exists()
            for x in predicate(exports[(2, 1)] / (f + ".intoto.jsonl"))["linears"]]
    assert sorted(reads) == sorted(want) and len(want) >= 9


def _resign(out, name, edit, key):
    """Re-sign rank shard ``name``'s record after ``edit(predicate)`` with the exporter's key, and the index over it:
    an exporter that states a wrong geometry, consistently under its own key."""
    att = out / (name + ".intoto.jsonl")
    st = json.loads(dsse.b64decode(loads(att.read_bytes())["payload"], "x"))
    edit(st["predicate"])
    subjects = [(s["name"], s["digest"]["sha256"]) for s in st["subject"]]
    line = records.sign(subjects, records.SHARD, st["predicate"], key)
    att.write_bytes(line)
    index = predicate(out / "export.intoto.jsonl")
    next(f for f in index["files"] if f["name"] == name)["attestation_sha256"] = sha256_hex(line)
    (out / "export.intoto.jsonl").write_bytes(
        records.sign([(f["name"], f["sha256"]) for f in index["files"]], records.EXPORT, index, key))


def test_a_tampered_linear_shard_or_wrong_geometry_is_refused_before_allocation(world, tmp_path):
    c, exports = world
    name = "linears-tp1/attention-K2-mul1-layer001.safetensors"
    o_proj = "model.layers.1.self_attn.o_proj"

    def refused(directory, match, ranks=(0, 1)):
        src = ExportSource(directory, c.pub)
        p = tpkit.whole_plan(src, 2)
        store = WeightStore(p.mesh)
        with pytest.raises(FqError, match=match):
            store.fulfill(p, src, {r: "cpu" for r in ranks})
        assert store.allocations == 0
        store.fulfill(p, src, {0: "cpu"})  # tp rank 0 reads none of tp rank 1's shards

    bad = shutil.copytree(exports[(2, 1)], tmp_path / "flipped")
    lin = next(x for x in predicate(bad / (name + ".intoto.jsonl"))["linears"] if x["name"] == o_proj)
    data = bytearray((bad / name).read_bytes())
    data[lin["offset"] + 11] ^= 1
    (bad / name).write_bytes(bytes(data))
    refused(bad, rf"{name}: bytes of linear {o_proj} do not match the attested sha256")

    def swap(p):  # the slice another tp rank holds
        lin = next(x for x in p["linears"] if x["name"] == o_proj)
        lin["slice"] = {"dim": 1, "start": 0, "stop": 128}
    bad = shutil.copytree(exports[(2, 1)], tmp_path / "slice")
    _resign(bad, name, swap, c.priv)
    refused(bad, rf"{name}: linear {o_proj} slice \{{'dim': 1, 'start': 0, 'stop': 128\}}, rank 1's plan needs "
                 r"\{'dim': 1, 'start': 128, 'stop': 256\}")

    def grow(p):
        next(x for x in p["linears"] if x["name"] == o_proj)["shape"] = [256, 256]
    bad = shutil.copytree(exports[(2, 1)], tmp_path / "shape")
    _resign(bad, name, grow, c.priv)
    refused(bad, rf"{name}: linear {o_proj} shape \[256, 256\] \(padded to 128s\), the plan declares \[128, 256\]")

    # the product's own linear fragment, altered: refused naming it, nothing allocated
    c2 = provkit.private_copy(c, tmp_path / "product")
    frag = c2.root / "base/k2/attention-K2-mul1-layer001.safetensors"
    data = bytearray(frag.read_bytes())
    data[-7] ^= 1
    frag.write_bytes(bytes(data))
    src = tpkit.product_source(c2)
    p = tpkit.whole_plan(src, 2)
    store = WeightStore(p.mesh)
    with pytest.raises(FqError, match="attention-K2-mul1-layer001.safetensors: bytes do not match the sha256 the plan"):
        store.fulfill(p, src, ["cpu", "cpu"])
    assert store.allocations == 0


def test_a_plan_declaring_another_linear_geometry_is_refused_before_allocation(world):
    c, _ = world
    src = tpkit.product_source(c)
    p = tpkit.whole_plan(src, 2)
    name = "lm_head.weight"
    m = TpManifest(tuple(e if e.name != name else WeightEntry(name, None, None, (512, 128), e.dtype, e.role,
                                                              e.policy)
                         for e in p.manifest.entries), p.manifest.collectives, p.manifest.tp)
    store = WeightStore(p.mesh)
    with pytest.raises(FqError, match=r"admission: lm_head.weight on rank 0 part 0: EXL3 tensors are \(out, in\) = "
                                      r"\(384, 128\), the plan needs \(512, 128\)"):
        store.fulfill(plan(m, p.mesh), src, ["cpu", "cpu"])
    assert store.allocations == 0
