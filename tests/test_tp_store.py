"""The weight store: admission before allocation, exact per-rank bytes, rollback under fault injection at
every step, origin (mesh epoch) checks, unload, and parity of per-rank loads with the unsliced product."""
import pytest
import torch

from tests.kits import provkit
from tests.kits import tpkit
from fq.codec import reconstruct_chain
from fq.errors import FqError
from fq.model.shards import torch_dtype
from fq.tp import sources
from fq.tp.manifest import TpManifest, Pinned, Replicate, SplitOutput, Tied, WeightEntry
from fq.tp.mesh import DeviceMesh, plan
from fq.tp.slicing import assemble
from fq.tp.sources import ExportSource, TensorSource
from fq.tp.store import InjectedFault, WeightStore, fulfill
from tests.kits.tpkit import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-store")
    c = tpkit.build(tmp)
    exports = {(tp, ep): tmp / f"export-tp{tp}-ep{ep}" for tp, ep in ((1, 1), (2, 1), (4, 1), (2, 2))}
    for (tp, ep), path in exports.items():
        tpkit.export(c, path, tp, ep)
    return c, exports


@pytest.fixture(scope="module")
def full(world):
    """The unsliced reconstruction of every expert linear, from the fragments' own tensor sets."""
    c, _ = world
    return {(layer, x, proj): tpkit.full_weight(c, layer, x, proj)
            for layer in provkit.LAYERS for x in range(provkit.N_EXPERTS) for proj in provkit.DIMS}


def load(source, tp=1, ep=1, pp=1, devices=None, **kw):
    p = tpkit.mesh_plan(source, tp, ep, pp)
    store = WeightStore(p.mesh)
    return store, store.fulfill(p, source, devices or ["cpu"] * p.mesh.size, **kw)


def test_tp1_equals_the_unsliced_load(world):
    c, exports = world
    for source in (tpkit.product_source(c), ExportSource(exports[(1, 1)], c.pub)):
        store, loaded = load(source)
        for layer in provkit.LAYERS:
            for x in range(provkit.N_EXPERTS):
                for proj in provkit.DIMS:
                    got = loaded.tensors(0, tpkit.wname(layer, x, proj))
                    want = tpkit.chain_sets(c, layer, x, proj)
                    assert len(got) == len(want) == (3 if x in provkit.HOT else 2)
                    for g, w in zip(got, want):
                        assert g.keys() == w.keys() and all(torch.equal(g[k], w[k]) for k in w)
            router = loaded.tensors(0, tpkit.rname(layer))
            assert router.dtype == torch.bfloat16 and router.shape == (provkit.N_EXPERTS, 128)
        store.unload()
        assert store.allocations == store.releases > 0


@pytest.mark.parametrize("tp, ep", [(2, 1), (4, 1), (2, 2)])
def test_per_rank_reconstructions_assemble_bit_identically(world, full, tp, ep):
    c, exports = world
    for source in (tpkit.product_source(c), ExportSource(exports[(tp, ep)], c.pub)):
        store, loaded = load(source, tp, ep)
        p = loaded.plan
        for layer in provkit.LAYERS:
            for x in range(provkit.N_EXPERTS):
                for proj in provkit.DIMS:
                    name = tpkit.wname(layer, x, proj)
                    pieces = [(pl.slice, loaded.weight(pl.rank, name)) for pl in p.placements if pl.entry == name]
                    assert len(pieces) == tp
                    assert torch.equal(assemble(pieces), full[(layer, x, proj)])
        store.unload()


def test_export_and_product_sources_hand_the_store_the_same_bytes(world):
    c, exports = world
    p = tpkit.mesh_plan(tpkit.product_source(c), 2, 2)
    a = tpkit.product_source(c).admit(p, range(4))
    b = ExportSource(exports[(2, 2)], c.pub).admit(p, range(4))
    assert tpkit.unit_bytes(a) == tpkit.unit_bytes(b)


def test_each_rank_reads_only_its_byte_ranges(world, monkeypatch):
    c, exports = world
    reads = []
    real = sources.read_range

    def spy(fh, offset, length, source):
        reads.append((source, offset, length))
        return real(fh, offset, length, source)
    monkeypatch.setattr(sources, "read_range", spy)
    src = ExportSource(exports[(2, 2)], c.pub)
    p = tpkit.mesh_plan(src, 2, 2)
    WeightStore(p.mesh).fulfill(p, src, {3: "cpu"})  # one process's load: rank 3 = ep 1, tp 1
    shards = {s for s, _, _ in reads}
    assert all("/rank-ep1-tp1/" in s or s.endswith("/replicated.safetensors") for s in shards)
    expert_bytes = sum(n for s, _, n in reads if "/rank-" in s)
    index = src.index
    attested = 0
    for f in index["files"]:
        if f["coords"] == {"ep": 1, "tp": 1}:
            attested += sum(e["length"] for e in src._shard(f)["experts"])
    assert expert_bytes == attested  # exactly its experts' ranges, each once
    reads.clear()
    src = tpkit.product_source(c)  # the product: whole expert ranges (the digest unit), only owned experts
    WeightStore(p.mesh).fulfill(p, src, {3: "cpu"})
    experts = {(s.rsplit("/", 1)[-1], o) for s, o, _ in reads if "/base/k2/k2-" in s or "/stages/" in s}
    plan_ranges = {(f["name"].rsplit("/", 1)[-1], e["offset"]): e["expert"]
                   for f in src.predicate["fragments"] for e in f["experts"]}
    assert {plan_ranges[k] for k in experts} == {4, 5, 6, 7}


def test_fault_injection_at_every_step_rolls_back_and_retry_succeeds(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    p = tpkit.mesh_plan(src, 2)
    store = WeightStore(p.mesh)
    total = len(src.admit(p, range(2)))
    assert total == 2 * (2 + 2 * provkit.N_EXPERTS * 2 + 2 * len(provkit.HOT))  # routers + expert units per rank
    for n in range(total + 1):
        with pytest.raises(InjectedFault):
            store.fulfill(p, src, ["cpu", "cpu"], fault_after=n)
        assert store.allocations == store.releases  # every allocation released, exactly once
        assert store.loaded is None
    before = store.allocations
    loaded = store.fulfill(p, src, ["cpu", "cpu"])  # immediate retry
    assert store.allocations - before == total and store.releases == before
    assert all(not a.released for a in loaded.journal.entries)
    name = tpkit.wname(3, 5, "down_proj")
    assert torch.equal(assemble([(pl.slice, loaded.weight(pl.rank, name)) for pl in p.placements if pl.entry == name]),
                       tpkit.full_weight(c, 3, 5, "down_proj"))
    store.unload()
    assert store.allocations == store.releases


def test_a_failure_mid_load_releases_in_reverse_order_once(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    p = tpkit.mesh_plan(src, 2)
    store = WeightStore(p.mesh)
    seen = []

    def boom(a):
        seen.append(a)
        if a.seq == 5:
            raise RuntimeError("device copy failed")
    with pytest.raises(RuntimeError, match="device copy failed"):
        store.fulfill(p, src, ["cpu", "cpu"], on_allocate=boom)
    assert [a.seq for a in seen] == list(range(6)) and all(a.released and a.buffer is None for a in seen)
    assert (store.allocations, store.releases) == (6, 6)

    def interrupt(a):
        if a.seq == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # not only Exceptions: an interrupted load is rolled back too
        store.fulfill(p, src, ["cpu", "cpu"], on_allocate=interrupt)
    assert (store.allocations, store.releases) == (9, 9) and store.loaded is None
    store.fulfill(p, src, ["cpu", "cpu"])


def test_stale_mesh_epoch_is_refused(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    old = tpkit.mesh_plan(src, 2, epoch=0)
    store = WeightStore(DeviceMesh(tp=2, epoch=0))
    store.readmit(DeviceMesh(tp=2, epoch=1))
    with pytest.raises(FqError, match="plan was made for mesh epoch 0, the admitted mesh is at epoch 1 \\(stale plan\\)"):
        store.fulfill(old, src, ["cpu", "cpu"])
    assert store.allocations == 0  # refused before admission
    with pytest.raises(FqError, match="plan is for tp=2 ep=1 pp=1 epoch 1, the admitted mesh is tp=4"):
        WeightStore(DeviceMesh(tp=4, epoch=1)).fulfill(tpkit.mesh_plan(src, 2, epoch=1), src, ["cpu"] * 2)
    with pytest.raises(FqError, match="not newer"):
        store.readmit(DeviceMesh(tp=2, epoch=1))

    # re-admitted while loading: the origin check refuses to publish, everything is released
    cur = tpkit.mesh_plan(src, 2, epoch=1)
    with pytest.raises(FqError, match="allocated for mesh epoch 1, the mesh was re-admitted at epoch 2"):
        store.fulfill(cur, src, ["cpu", "cpu"],
                      on_allocate=lambda a: a.seq == 3 and store.readmit(DeviceMesh(tp=2, epoch=2)))
    assert store.allocations == store.releases and store.loaded is None

    # published, then re-admitted: handles refuse to serve stale weights
    loaded = store.fulfill(tpkit.mesh_plan(src, 2, epoch=2), src, ["cpu", "cpu"])
    loaded.tensors(0, tpkit.rname(1))
    store.readmit(DeviceMesh(tp=2, epoch=3))
    with pytest.raises(FqError, match="loaded for mesh epoch 2, the mesh is now at epoch 3 \\(stale\\)"):
        loaded.tensors(0, tpkit.rname(1))
    store.unload()
    with pytest.raises(FqError, match="unloaded"):
        loaded.tensors(0, tpkit.rname(1))
    assert store.allocations == store.releases


def test_admission_comes_before_any_allocation(world, tmp_path):
    c, exports = world
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(exports[(2, 1)], bad)
    src = ExportSource(bad, c.pub)
    p = tpkit.mesh_plan(src, 2)
    f = next(f for f in src.index["files"] if f["name"].startswith("rank-ep0-tp1/r1-layer003"))
    e = src._shard(f)["experts"][2]
    path = bad / f["name"]
    data = bytearray(path.read_bytes())
    data[e["offset"] + 7] ^= 1
    path.write_bytes(bytes(data))
    store = WeightStore(p.mesh)
    with pytest.raises(FqError, match=r"rank-ep0-tp1/r1-layer003-block000.safetensors: bytes of expert 2 do not match"):
        store.fulfill(p, src, ["cpu", "cpu"])
    assert store.allocations == 0
    path.unlink()
    with pytest.raises(FqError, match=r"rank-ep0-tp1/r1-layer003-block000.safetensors: missing"):
        store.fulfill(p, src, ["cpu", "cpu"])
    assert store.allocations == 0
    store.fulfill(p, src, {0: "cpu"})  # rank 0 needs nothing from the damaged rank's files
    with pytest.raises(FqError, match="cut for tp=2 ep=1, the plan is for tp=4 ep=1; export again"):
        load(ExportSource(exports[(2, 1)], c.pub), 4)
    with pytest.raises(FqError, match="cut for manifest .*assign='contiguous'"):
        p2 = tpkit.mesh_plan(src, 2, assign="strided")
        WeightStore(p2.mesh).fulfill(p2, ExportSource(exports[(2, 1)], c.pub), ["cpu", "cpu"])


def test_declared_dtypes_and_shapes_are_enforced(world):
    c, _ = world
    src = tpkit.product_source(c)
    p = tpkit.mesh_plan(src, 2)
    m = TpManifest(tuple(e if e.role != "router" else WeightEntry(e.name, e.layer, None, e.shape, "F16", e.role,
                                                                  e.policy)
                         for e in p.manifest.entries), p.manifest.collectives)
    lying = plan(m, p.mesh)
    store = WeightStore(p.mesh)
    with pytest.raises(FqError, match=r"admission: model.layers.1.mlp.gate.weight on rank 0: source has BF16 \[8, 128\], "
                                      r"declared F16 \[8, 128\]"):
        store.fulfill(lying, src, ["cpu", "cpu"])
    assert store.allocations == 0


def test_devices_are_never_guessed(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    p = tpkit.mesh_plan(src, 2)
    store = WeightStore(p.mesh)
    with pytest.raises(FqError, match="1 given, the mesh has 2 ranks"):
        store.fulfill(p, src, ["cpu"])
    with pytest.raises(FqError, match="names no index; say cuda:N"):
        store.fulfill(p, src, ["cpu", "cuda"])
    with pytest.raises(FqError, match="rank 2 outside 0..1"):
        store.fulfill(p, src, {2: "cpu"})
    with pytest.raises(FqError, match="not a torch device"):
        store.fulfill(p, src, ["cpu", "gpu please"])
    assert store.allocations == 0
    fulfill(p, src, {1: "cpu"}, mesh=p.mesh)
    store.fulfill(p, src, ["cpu", "cpu"])
    with pytest.raises(FqError, match="already published; unload it first"):
        store.fulfill(p, src, ["cpu", "cpu"])


def test_ties_pins_and_aliases_from_tensors_in_memory():
    gen = torch.Generator().manual_seed(0)
    embed = torch.randn(256, 128, generator=gen).bfloat16()
    up = torch.randn(256, 128, generator=gen).half()
    stats = torch.arange(4, dtype=torch.float32)
    entries = (WeightEntry("embed", None, None, (256, 128), "BF16", "embed", Replicate()),
               WeightEntry("lm_head", None, None, (256, 128), "BF16", "head", Tied("embed")),
               WeightEntry("up", 0, None, (256, 128), "F16", "dense", SplitOutput()),
               WeightEntry("stats", None, None, (4,), "F32", "dense", Pinned(1)),
               WeightEntry("norm", 1, None, (128,), "F32", "dense", Replicate()))
    src = TensorSource({"embed": embed, "up": up, "stats": stats, "norm": torch.ones(128)})
    p = plan(TpManifest(entries), DeviceMesh(tp=2))
    store = WeightStore(p.mesh)
    loaded = store.fulfill(p, src, ["cpu", "cpu"])
    assert store.allocations == 2 + 2 + 1 + 2  # embed, up and norm per rank, stats once; lm_head is an alias
    for r in (0, 1):
        h = loaded.handle(r, "lm_head")
        assert h.alias_of == "embed" and h.tensor.data_ptr() == loaded.handle(r, "embed").tensor.data_ptr()
        assert torch.equal(loaded.tensors(r, "up"), up[r * 128:(r + 1) * 128])
    assert torch.equal(loaded.tensors(1, "stats"), stats)
    with pytest.raises(FqError, match="not placed on rank 0"):
        loaded.tensors(0, "stats")
    p2 = plan(TpManifest(entries), DeviceMesh(tp=2, pp=2))  # head on the last stage: a real copy of embed's bytes
    loaded2 = WeightStore(p2.mesh).fulfill(p2, src, ["cpu"] * 4)
    assert torch.equal(loaded2.tensors(3, "lm_head"), embed) and loaded2.handle(3, "lm_head").alias_of is None
    with pytest.raises(FqError, match="no tensor for entry 'up'"):
        WeightStore(p.mesh).fulfill(p, TensorSource({"embed": embed, "stats": stats}), ["cpu", "cpu"])
    assert torch_dtype("BF16") == torch.bfloat16


def test_pipeline_stages_load_only_their_layers(world):
    c, exports = world
    src = ExportSource(exports[(2, 1)], c.pub)
    store, loaded = load(src, tp=2, pp=2)
    layers = {r: {loaded.plan.manifest.entry(name).layer for (rr, name) in loaded.handles if rr == r} for r in range(4)}
    assert layers == {0: {1}, 1: {1}, 2: {3}, 3: {3}}
    w = [(pl.slice, loaded.weight(pl.rank, tpkit.wname(3, 1, "gate_proj"))) for pl in loaded.plan.placements
         if pl.entry == tpkit.wname(3, 1, "gate_proj")]
    assert torch.equal(assemble(w), reconstruct_chain(tpkit.chain_sets(c, 3, 1, "gate_proj")))
