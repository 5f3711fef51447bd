"""The weight store on CUDA devices: a published product fulfilled onto the GPU (tp=1 and tp=2, and one
GPU per rank where there are two) reconstructs bit-identically to the CPU, an MoE layer matches the CPU
within float tolerance, and a rollback or unload gives the device memory back; the same for a whole-model base's
linears (tpkit.build_whole) from both sources. Skipped without CUDA."""
import gc

import pytest
import torch

from tests.kits import provkit
from tests.kits import tpkit
from tests.conftest import cuda
from fq.codec import reconstruct
from fq.tp.moe import moe_forward
from fq.tp.slicing import assemble
from fq.tp.store import InjectedFault, WeightStore

pytestmark = cuda


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-cuda")
    c = tpkit.build(tmp)
    export = tpkit.export(c, tmp / "export-tp2", 2)
    return c, export.path


def experts(loaded, rank, layer):
    out = {}
    for pl in loaded.plan.for_rank(rank):
        e = loaded.plan.manifest.entry(pl.entry)
        if e.layer == layer and e.expert is not None:
            out.setdefault(e.expert, {})[e.role] = loaded.weight(rank, pl.entry)
    return {x: (w["gate"], w["up"], w["down"]) for x, w in out.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_fulfill_onto_the_gpu_matches_the_cpu_reconstruction(world, tp):
    c, export = world
    devices = [f"cuda:{r % torch.cuda.device_count()}" for r in range(tp)]
    for source in (tpkit.product_source(c), tpkit.export_source(c, export) if tp == 2 else None):
        if source is None:
            continue
        p = tpkit.mesh_plan(source, tp)
        gpu = WeightStore(p.mesh).fulfill(p, source, devices)
        cpu = WeightStore(p.mesh).fulfill(p, source, ["cpu"] * tp)
        for r in range(tp):
            for pl in p.for_rank(r):
                parts = gpu.tensors(r, pl.entry)
                for t in (parts if isinstance(parts, list) else [{"w": parts}]):
                    assert all(v.device == torch.device(devices[r]) for v in t.values())
                w = gpu.weight(r, pl.entry)
                assert w.device == torch.device(devices[r])
                assert torch.equal(w.cpu(), cpu.weight(r, pl.entry))  # bit-identical across devices
        for layer in provkit.LAYERS:
            for x in (0, 5):
                for proj in provkit.DIMS:
                    name = tpkit.wname(layer, x, proj)
                    pieces = [(pl.slice, gpu.weight(pl.rank, name).cpu()) for pl in p.placements if pl.entry == name]
                    assert torch.equal(assemble(pieces), tpkit.full_weight(c, layer, x, proj))
        x = torch.randn(32, 128, generator=torch.Generator().manual_seed(1))
        for r in range(tp):
            y_gpu = moe_forward(x.to(devices[r]), gpu.weight(r, tpkit.rname(3)), experts(gpu, r, 3), 2).cpu()
            y_cpu = moe_forward(x, cpu.weight(r, tpkit.rname(3)), experts(cpu, r, 3), 2)
            torch.testing.assert_close(y_gpu, y_cpu, rtol=1e-3, atol=1e-6 * float(y_cpu.abs().max()))


def test_rollback_and_unload_give_device_memory_back(world):
    c, export = world
    source = tpkit.export_source(c, export)
    p = tpkit.mesh_plan(source, 2)
    devices = ["cuda:0", f"cuda:{1 % torch.cuda.device_count()}"]
    gc.collect()
    torch.cuda.synchronize()
    base = [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]
    store = WeightStore(p.mesh)
    total = len(source.admit(p, range(2)))
    for n in (1, total // 2, total):
        with pytest.raises(InjectedFault):
            store.fulfill(p, source, devices, fault_after=n)
        gc.collect()
        assert store.allocations == store.releases
        assert [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())] == base
    loaded = store.fulfill(p, source, devices)
    assert torch.cuda.memory_allocated(0) > base[0]
    del loaded
    store.unload()
    gc.collect()
    assert store.allocations == store.releases
    assert [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())] == base


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-cuda-whole")
    c = tpkit.build_whole(tmp)
    return c, tpkit.export(c, tmp / "export-tp2", 2).path


def _memory() -> list[int]:
    gc.collect()
    torch.cuda.synchronize()
    return [torch.cuda.memory_allocated(i) for i in range(torch.cuda.device_count())]


def _check_linears(c, p, gpu, cpu, devices) -> None:
    """Every linear on its rank's GPU reconstructs as on the CPU, and the ranks' pieces are the whole linear."""
    for prefix in [x for shapes in tpkit.LINEARS.values() for x in shapes]:
        name, pieces = f"{prefix}.weight", []
        for pl in (pl for pl in p.placements if pl.entry == name):
            w = gpu.weight(pl.rank, name)
            assert w.device == torch.device(devices[pl.rank])
            assert torch.equal(w.cpu(), cpu.weight(pl.rank, name))
            pieces.append((pl.slice, w.cpu()))
        full = reconstruct(c.sets[prefix])
        if pieces[0][0] is None:
            assert all(torch.equal(w, full) for _, w in pieces), prefix
        else:
            assert torch.equal(assemble(pieces), full), prefix


def test_a_whole_model_bases_linears_on_the_gpu_match_the_cpu_and_roll_back(whole):
    c, export = whole
    devices = [f"cuda:{r % torch.cuda.device_count()}" for r in range(2)]
    for source in (tpkit.product_source(c), tpkit.export_source(c, export)):
        p = tpkit.whole_plan(source, 2)
        base = _memory()
        store = WeightStore(p.mesh)
        total = len(source.admit(p, range(2)))
        for n in (1, total // 2, total):
            with pytest.raises(InjectedFault):
                store.fulfill(p, source, devices, fault_after=n)
            assert store.allocations == store.releases and _memory() == base
        gpu = store.fulfill(p, source, devices)
        _check_linears(c, p, gpu, WeightStore(p.mesh).fulfill(p, source, ["cpu"] * 2), devices)
        del gpu
        store.unload()
        assert store.allocations == store.releases and _memory() == base
