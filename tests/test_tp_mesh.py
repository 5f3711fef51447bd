"""plan(manifest, mesh): placements with exact slices, stages, the collective schedule; pure and deterministic."""
import builtins
import os

import pytest
import torch

from fq.errors import FqError
from fq.model.experts import STANDARD
from fq.tp.manifest import Collective, TpManifest, Pinned, Replicate, SplitInput, SplitOutput, Tied, WeightEntry
from fq.tp.mesh import DeviceMesh, Slice, check_coverage, describe, plan
from fq.tp.moe import MoeLayer, MoeSpec, moe_manifest, router_name

I, H, E = 512, 128, 8


def manifest(layers=(1, 3, 5, 7), assign="contiguous"):
    return moe_manifest(MoeSpec(STANDARD, tuple(
        MoeLayer(L, tuple(range(E)), ((I, H), (I, H), (H, I)), (router_name(STANDARD, L), "BF16", (E, H)))
        for L in layers)), assign)


MESHES = [(tp, ep, pp) for tp in (1, 2, 4) for ep in (1, 2, 4) for pp in (1, 2)]


def test_mesh_rank_numbering():
    m = DeviceMesh(tp=2, ep=3, pp=2)
    assert m.size == 12
    for r in range(m.size):
        c = m.coords(r)
        assert m.rank(c["pp"], c["ep"], c["tp"]) == r
    assert m.coords(3) == {"pp": 0, "ep": 1, "tp": 1}
    assert m.readmitted().epoch == 1 and m.readmitted(tp=4).tp == 4
    with pytest.raises(FqError, match="rank 12 outside 0..11"):
        m.coords(12)
    with pytest.raises(FqError, match="ep must be a positive integer"):
        DeviceMesh(ep=0)


@pytest.mark.parametrize("tp, ep, pp", MESHES)
def test_slices_cover_every_split_dimension_exactly_once(tp, ep, pp):
    m = manifest()
    p = plan(m, DeviceMesh(tp=tp, ep=ep, pp=pp))
    mesh = p.mesh
    for e in m.entries:
        pls = [pl for pl in p.placements if pl.entry == e.name]
        if e.role == "router":  # replicated on every rank of its stage, whole
            stage = next(s for s in p.stages if e.layer in s.layers)
            assert sorted(pl.rank for pl in pls) == list(stage.ranks) and all(pl.slice is None for pl in pls)
            continue
        dim = 0 if e.role in ("gate", "up") else 1
        owners = {mesh.coords(pl.rank)["ep"] for pl in pls}
        assert len(owners) == 1  # each expert on exactly one ep rank
        for pp_i in {mesh.coords(pl.rank)["pp"] for pl in pls}:
            cover = torch.zeros(e.shape[dim], dtype=torch.int32)
            for pl in pls:
                if mesh.coords(pl.rank)["pp"] == pp_i:
                    assert pl.slice.dim == dim and pl.slice.start % 128 == 0 and pl.slice.stop % 128 == 0
                    cover[pl.slice.start:pl.slice.stop] += 1
            assert bool((cover == 1).all())  # every channel exactly once
        assert len(pls) == tp  # one slice per tp rank, nothing else


def test_tp1_is_the_unsliced_placement():
    p = plan(manifest(), DeviceMesh())
    assert {pl.slice for pl in p.placements} == {None, Slice(0, 0, I), Slice(1, 0, I)}
    assert len(p.placements) == len(p.manifest.entries)


def test_expert_assignment_contiguous_and_strided():
    for assign, want in (("contiguous", [0, 0, 1, 1, 2, 2, 3, 3]), ("strided", [0, 1, 2, 3, 0, 1, 2, 3])):
        p = plan(manifest(assign=assign), DeviceMesh(ep=4))
        owner = {}
        for pl in p.placements:
            e = p.manifest.entry(pl.entry)
            if e.layer == 1 and e.role == "gate":
                owner[e.expert] = p.mesh.coords(pl.rank)["ep"]
        assert [owner[x] for x in range(E)] == want


def test_pipeline_stages_and_boundaries():
    p = plan(manifest(layers=(1, 3, 5, 7, 9)), DeviceMesh(tp=2, pp=2))
    assert [(s.layers, s.ranks) for s in p.stages] == [((1, 3, 5), (0, 1)), ((7, 9), (2, 3))]
    assert [b.to_json() for b in p.boundaries] == [{"after_layer": 5, "before_layer": 7, "from_stage": 0,
                                                   "to_stage": 1}]
    assert {p.manifest.entry(pl.entry).layer for pl in p.for_rank(3)} == {7, 9}
    assert [(s.layer, s.stage, s.groups) for s in p.schedule] == [
        (1, 0, ((0, 1),)), (3, 0, ((0, 1),)), (5, 0, ((0, 1),)), (7, 1, ((2, 3),)), (9, 1, ((2, 3),))]


def test_schedule_has_one_step_per_declared_operation_never_merged():
    # two row-split weights of one layer reducing into two declared ops: two steps, not one per (layer, kind)
    entries = (WeightEntry("attn.o", 0, None, (256, 512), "BF16", "dense", SplitInput("attn.o.reduce")),
               WeightEntry("mlp.down", 0, None, (256, 512), "BF16", "dense", SplitInput("mlp.down.reduce")),
               WeightEntry("mlp.up", 0, None, (512, 256), "BF16", "dense", SplitOutput()))
    m = TpManifest(entries, (Collective("attn.o.reduce", 0), Collective("mlp.down.reduce", 0)))
    p = plan(m, DeviceMesh(tp=2, ep=2))
    assert [(s.index, s.op, s.contributors) for s in p.schedule] == [
        (0, "attn.o.reduce", ("attn.o",)), (1, "mlp.down.reduce", ("mlp.down",))]
    assert p.schedule[0].groups == ((0, 1), (2, 3))  # over tp only: one group per ep coordinate
    assert p.schedule[0].group_of(3) == (2, 3)
    moe = plan(manifest(), DeviceMesh(tp=2, ep=2))
    assert len(moe.schedule) == 4 and all(s.groups == ((0, 1, 2, 3),) for s in moe.schedule)
    assert len(moe.schedule[0].contributors) == E  # every expert's down projection feeds the layer's one op


def test_ties_and_pins():
    entries = (WeightEntry("embed", None, None, (1024, 256), "BF16", "embed", Replicate()),
               WeightEntry("lm_head", None, None, (1024, 256), "BF16", "head", Tied("embed")),
               WeightEntry("w", 0, None, (256, 256), "F16", "dense", Replicate()),
               WeightEntry("w1", 1, None, (256, 256), "F16", "dense", Replicate()),
               WeightEntry("stats", None, None, (4,), "F32", "dense", Pinned(3)))
    m = TpManifest(entries)
    one = plan(m, DeviceMesh(tp=2, ep=2))
    heads = [pl for pl in one.placements if pl.entry == "lm_head"]
    assert [(pl.rank, pl.source, pl.alias) for pl in heads] == [(r, "embed", True) for r in range(4)]
    assert [pl.rank for pl in one.placements if pl.entry == "stats"] == [3]
    two = plan(m, DeviceMesh(tp=2, pp=2))  # embed on the first stage, the tied head on the last: a copy
    heads = [pl for pl in two.placements if pl.entry == "lm_head"]
    assert [(pl.rank, pl.source, pl.alias) for pl in heads] == [(2, "embed", False), (3, "embed", False)]
    assert [pl.rank for pl in two.placements if pl.entry == "stats"] == [3]


def test_plan_is_pure_and_deterministic(monkeypatch):
    m = manifest()
    mesh = DeviceMesh(tp=2, ep=2, pp=2, epoch=7)

    def refuse(*a, **k):
        raise AssertionError("planning touched a file or a device")
    monkeypatch.setattr(builtins, "open", refuse)
    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setattr(torch, "empty", refuse)
    a, b = plan(m, mesh), plan(manifest(), mesh)
    monkeypatch.undo()
    assert a.to_json() == b.to_json() and a.sha256 == b.sha256
    j = a.to_json()
    assert j["format"] == "fq-mesh-plan/1" and j["mesh"] == {"tp": 2, "ep": 2, "pp": 2, "epoch": 7}
    assert j["manifest_sha256"] == m.sha256 and len(j["devices"]) == 8
    assert j["devices"][1]["placements"][1] == {
        "entry": "model.layers.1.mlp.experts.0.gate_proj.weight", "slice": {"dim": 0, "start": 256, "stop": 512},
        "source": "model.layers.1.mlp.experts.0.gate_proj.weight", "alias": False,
        "placements": ["Shard(expert)", "Shard(0)"]}
    assert plan(m, DeviceMesh(tp=2, ep=2, pp=2, epoch=8)).sha256 != a.sha256  # the epoch is part of the plan
    text = describe(a)
    assert "rank 5 (pp 1 ep 0 tp 1):" in text and "layer 5 gate experts 0-3: out[256:512]" in text
    assert "#3 all_reduce model.layers.7.mlp.experts.down_reduce (layer 7, stage 1) over tpxep: groups [[4, 5, 6, 7]]" \
        in text


def test_coverage_check_catches_a_broken_plan():
    p = plan(manifest(layers=(1,)), DeviceMesh(tp=2))
    broken = [pl for pl in p.placements if not (pl.rank == 1 and pl.slice is not None and pl.slice.dim == 0)]
    with pytest.raises(FqError, match="do not tile|end at 256"):
        check_coverage(type(p)(p.mesh, p.manifest, p.stages, p.boundaries, tuple(broken), p.schedule))


def test_plan_refuses_a_mesh_it_cannot_cut():
    with pytest.raises(FqError, match=r"512 / 8 = 64 is not a multiple of 128"):
        plan(manifest(), DeviceMesh(tp=8))
    with pytest.raises(FqError, match="expected a TpManifest"):
        plan({"entries": []}, DeviceMesh())
