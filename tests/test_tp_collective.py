"""A real collective: 2 and 4 spawned processes (torch.distributed) each load their rank of a TP export
through the weight store, run one MoE layer's forward (router top-k, SiLU-gated MLP over their experts'
slices) and all-reduce exactly where the plan's schedule says; the result matches the unsliced layer
(within float tolerance: the partial sums are added in another order).

Two backends, one worker:
- gloo on CPU (CI): compared with the unsliced layer computed in this process on the CPU;
- NCCL, one process per GPU (``cuda:<rank>``; skipped unless that many GPUs are visible): compared with
  the single-GPU run (the unsliced layer on ``cuda:0``). Before its real load each process sweeps the
  weight store's fault injection (a failure before the first allocation, after the first, half-way, after
  the last) and checks that every GPU's memory is as it found it: torch's allocated and reserved bytes
  (after ``empty_cache``) on every visible device, after each rollback and after the final unload."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

from tests.kits import provkit
from tests.kits import tpkit
from fq.tp.moe import moe_forward
from fq.tp.store import InjectedFault, WeightStore
from tests.kits.tpkit import one_thread  # noqa: F401  (autouse fixture)

LAYER, TOP_K, TOKENS = 3, 2, 24
# NVLink multicast stays off wherever NCCL runs (a shared host's GPUs can be put out of service by it)
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def local_experts(loaded, rank: int, layer: int) -> dict:
    """{expert: (gate, up, down)} dense float weights (this rank's slices) of the experts it holds."""
    m = loaded.plan.manifest
    out: dict = {}
    for pl in loaded.plan.for_rank(rank):
        e = m.entry(pl.entry)
        if e.layer == layer and e.expert is not None:
            out.setdefault(e.expert, {})[e.role] = loaded.weight(rank, pl.entry)
    return {x: (w["gate"], w["up"], w["down"]) for x, w in out.items()}


def gpu_memory() -> list[tuple[int, int]]:
    """(allocated, reserved) bytes of torch's allocator on every visible GPU, cached blocks returned first."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return [(torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i)) for i in range(torch.cuda.device_count())]


def fault_sweep(store: WeightStore, p, src, rank: int, device: str) -> list[int]:
    """Fail the load at each sweep point; after every rollback nothing is resident and memory is as found."""
    total = len(src.admit(p, [rank]))
    cuda = device.startswith("cuda")
    before = gpu_memory() if cuda else None
    points = sorted({0, 1, total // 2, total})
    for n in points:
        with pytest.raises(InjectedFault):
            store.fulfill(p, src, {rank: device}, fault_after=n)
        assert store.allocations == store.releases and store.loaded is None, n
        if cuda:
            assert gpu_memory() == before, f"rank {rank}: GPU memory changed after a fault at allocation {n}"
    return points


def worker(rank: int, world: int, tp: int, ep: int, backend: str, export_dir: str, pub: str, init: str,
           x_path: str, out: str):
    import torch.distributed as dist

    from fq.provenance.attest import keys
    from fq.tp.mesh import DeviceMesh, plan
    from fq.tp.moe import moe_manifest, router_name
    from fq.tp.sources import ExportSource

    torch.set_num_threads(1)
    device = f"cuda:{rank}" if backend == "nccl" else "cpu"
    if backend == "nccl":
        torch.cuda.set_device(rank)
    kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world, **kw)
    try:
        src = ExportSource(export_dir, keys.load_public(pub))
        p = plan(moe_manifest(src.spec(), src.index["assign"]), DeviceMesh(tp=tp, ep=ep))
        # every process creates every group of the schedule, in schedule order (new_group is collective)
        groups = {(s.index, g): dist.new_group(list(g)) for s in p.schedule for g in s.groups}
        store = WeightStore(p.mesh)
        if backend == "nccl":
            # the runtime's own one-time allocations first (cuBLAS keeps a 32 MiB workspace from the first matmul
            # on, NCCL its buffers from the first collective): "as found" is the process after its warm-up
            warm = torch.ones(8, 8, device=device)
            dist.all_reduce(warm @ warm)
            del warm
        before = gpu_memory() if backend == "nccl" else None
        swept = fault_sweep(store, p, src, rank, device)
        loaded = store.fulfill(p, src, {rank: device})  # this process's rank only, on its own device
        x = torch.load(x_path).to(device)
        router = loaded.weight(rank, router_name(src.layout, LAYER))
        experts = local_experts(loaded, rank, LAYER)
        y = moe_forward(x, router, experts, TOP_K)
        reductions = 0
        for s in p.schedule:
            if s.layer != LAYER:
                continue
            g = s.group_of(rank)
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=groups[(s.index, g)])
            reductions += 1
        devices = sorted({str(w.device) for ws in experts.values() for w in ws} | {str(router.device), str(y.device)})
        torch.save(y.cpu(), f"{out}/y{rank}.pt")
        info = {"reductions": reductions, "experts": sorted(experts), "allocations": store.allocations,
                "devices": devices, "fault_points": swept}
        del loaded, router, experts, x, y
        store.unload()
        info["released"] = store.allocations == store.releases
        if backend == "nccl":
            after = gpu_memory()
            info["memory_before"], info["memory_after"] = before, after
        with open(f"{out}/rank{rank}.json", "w") as fh:
            json.dump(info, fh)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-collective")
    c = tpkit.build(tmp)
    src = tpkit.product_source(c)
    p = tpkit.mesh_plan(src)  # the unsliced product, one rank
    x = torch.randn(TOKENS, 128, generator=torch.Generator().manual_seed(5))
    torch.save(x, tmp / "x.pt")
    refs = {}
    for dev in ("cpu", "cuda:0") if torch.cuda.is_available() else ("cpu",):
        store = WeightStore(p.mesh)
        loaded = store.fulfill(p, src, [dev])
        router = loaded.weight(0, tpkit.rname(LAYER))
        refs[dev] = moe_forward(x.to(dev), router, local_experts(loaded, 0, LAYER), TOP_K).cpu()
        del loaded, router
        store.unload()
    return c, tmp, refs


def run_world(world, backend: str, tp: int, ep: int):
    c, tmp, refs = world
    path = tmp / f"export-tp{tp}-ep{ep}"  # one export per mesh shape, loaded by both backends
    if not path.exists():
        tpkit.export(c, path, tp, ep)
    out = tmp / f"run-{backend}-tp{tp}-ep{ep}"
    out.mkdir()
    n = tp * ep
    mp.start_processes(worker, args=(n, tp, ep, backend, str(path), str(c.pub_path), str(out / "init"),
                                     str(tmp / "x.pt"), str(out)), nprocs=n, join=True, start_method="spawn")
    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(i["reductions"] == 1 for i in infos)  # the schedule's one reduction of this layer, nothing more
    assert all(i["released"] for i in infos)
    owned = [set(i["experts"]) for i in infos]
    assert set().union(*owned) == set(range(provkit.N_EXPERTS))
    ref = refs["cuda:0" if backend == "nccl" else "cpu"]
    for r in range(n):
        y = torch.load(out / f"y{r}.pt")
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
    assert float(ref.abs().max()) > 0 and not os.path.exists(out / f"y{n}.pt")
    return infos


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (2, 2)])  # 2 processes (tp or ep), 4 (tp x ep); tp=4 slicing: test_tp_store
def test_gloo_moe_layer_from_the_tp_export_matches_the_unsliced_layer(world, tp, ep):
    infos = run_world(world, "gloo", tp, ep)
    assert all(i["devices"] == ["cpu"] for i in infos)


@pytest.mark.parametrize("tp, ep", [(2, 1), (1, 2), (4, 1), (2, 2)])
def test_nccl_one_process_per_gpu_matches_the_single_gpu_layer(world, tp, ep, monkeypatch):
    n = tp * ep
    if not torch.cuda.is_available() or torch.cuda.device_count() < n or not torch.distributed.is_nccl_available():
        pytest.skip(f"needs NCCL and {n} CUDA devices")
    for k, v in NCCL_ENV.items():
        monkeypatch.setenv(k, v)  # inherited by the spawned ranks
    infos = run_world(world, "nccl", tp, ep)
    for r, i in enumerate(infos):
        assert i["devices"] == [f"cuda:{r}"]  # every weight and the output on the rank's own GPU
        assert i["memory_after"] == i["memory_before"], f"rank {r}: GPU memory not given back after unload"
        assert len(i["fault_points"]) >= 3
