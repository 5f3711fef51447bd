"""A real collective on CPU: 2 and 4 spawned processes (torch.distributed, gloo) each load their rank of a
TP export through the weight store, run one MoE layer's forward (router top-k, SiLU-gated MLP over their
experts' slices) and all-reduce exactly where the plan's schedule says; the result matches the unsliced
layer computed in this process from the published product (within float tolerance: the partial sums
are added in another order)."""
import json
import os

import pytest
import torch
import torch.multiprocessing as mp

import provkit
import tpkit
from fq.tp.moe import moe_forward
from fq.tp.store import WeightStore
from tpkit import one_thread  # noqa: F401  (autouse fixture)

LAYER, TOP_K, TOKENS = 3, 2, 24


def local_experts(loaded, rank: int, layer: int) -> dict:
    """{expert: (gate, up, down)} dense float weights (this rank's slices) of the experts it holds."""
    m = loaded.plan.manifest
    out: dict = {}
    for pl in loaded.plan.for_rank(rank):
        e = m.entry(pl.entry)
        if e.layer == layer and e.expert is not None:
            out.setdefault(e.expert, {})[e.role] = loaded.weight(rank, pl.entry)
    return {x: (w["gate"], w["up"], w["down"]) for x, w in out.items()}


def worker(rank: int, world: int, tp: int, ep: int, export_dir: str, pub: str, init: str, x_path: str, out: str):
    import torch.distributed as dist

    from fq.attest import keys
    from fq.tp.mesh import DeviceMesh, plan
    from fq.tp.moe import moe_manifest, router_name
    from fq.tp.sources import ExportSource

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        src = ExportSource(export_dir, keys.load_public(pub))
        p = plan(moe_manifest(src.spec(), src.index["assign"]), DeviceMesh(tp=tp, ep=ep))
        # every process creates every group of the schedule, in schedule order (new_group is collective)
        groups = {(s.index, g): dist.new_group(list(g)) for s in p.schedule for g in s.groups}
        store = WeightStore(p.mesh)
        loaded = store.fulfill(p, src, {rank: "cpu"})  # this process's rank only
        x = torch.load(x_path)
        router = loaded.weight(rank, router_name(src.layout, LAYER))
        y = moe_forward(x, router, local_experts(loaded, rank, LAYER), TOP_K)
        reductions = 0
        for s in p.schedule:
            if s.layer != LAYER:
                continue
            g = s.group_of(rank)
            dist.all_reduce(y, op=dist.ReduceOp.SUM, group=groups[(s.index, g)])
            reductions += 1
        torch.save(y, f"{out}/y{rank}.pt")
        with open(f"{out}/rank{rank}.json", "w") as fh:
            json.dump({"reductions": reductions, "experts": sorted(local_experts(loaded, rank, LAYER)),
                       "allocations": store.allocations}, fh)
        store.unload()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-collective")
    c = tpkit.build(tmp)
    src = tpkit.product_source(c)
    p = tpkit.mesh_plan(src)  # the unsliced product, one rank
    loaded = WeightStore(p.mesh).fulfill(p, src, ["cpu"])
    router = loaded.weight(0, tpkit.rname(LAYER))
    x = torch.randn(TOKENS, 128, generator=torch.Generator().manual_seed(5))
    ref = moe_forward(x, router, local_experts(loaded, 0, LAYER), TOP_K)
    torch.save(x, tmp / "x.pt")
    return c, tmp, ref


@pytest.mark.parametrize("tp, ep", [(2, 1), (2, 2)])  # 2 processes (tp), 4 processes (tp x ep); tp=4 slicing: test_tp_store
def test_gloo_moe_layer_from_the_tp_export_matches_the_unsliced_layer(world, tp, ep):
    c, tmp, ref = world
    export = tpkit.export(c, tmp / f"export-tp{tp}-ep{ep}", tp, ep)
    out = tmp / f"run-tp{tp}-ep{ep}"
    out.mkdir()
    n = tp * ep
    mp.start_processes(worker, args=(n, tp, ep, str(export.path), str(c.pub_path), str(out / "init"),
                                     str(tmp / "x.pt"), str(out)), nprocs=n, join=True, start_method="spawn")
    infos = [json.loads((out / f"rank{r}.json").read_text()) for r in range(n)]
    assert all(i["reductions"] == 1 for i in infos)  # the schedule's one reduction of this layer, nothing more
    owned = [set(i["experts"]) for i in infos]
    assert set().union(*owned) == set(range(provkit.N_EXPERTS))
    for r in range(n):
        y = torch.load(out / f"y{r}.pt")
        torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-6 * float(ref.abs().max()))
    assert float(ref.abs().max()) > 0 and not os.path.exists(out / f"y{n}.pt")
