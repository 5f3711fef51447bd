"""Weight manifest declarations and their validation (pure: no file, no device)."""
import pytest

from fq.errors import FqError
from fq.model.experts import MIXTRAL, STANDARD
from fq.tp.manifest import (EXL3, Collective, ExpertParallel, TpManifest, Pinned, Replicate, SplitInput, SplitOutput,
                            Tied, WeightEntry, check_mesh, split_sizes_that_work)
from fq.tp.moe import MoeLayer, MoeSpec, moe_manifest, moe_prefix, router_name


def spec(I=1536, H=256, experts=8, layers=(1,), layout=STANDARD):
    return MoeSpec(layout, tuple(MoeLayer(L, tuple(range(experts)), ((I, H), (I, H), (H, I)),
                                          (router_name(layout, L), "BF16", (experts, H))) for L in layers))


def dense(name, shape=(256, 256), policy=None, layer=0, role="dense", dtype="BF16", expert=None):
    return WeightEntry(name, layer, expert, shape, dtype, role, policy or Replicate())


def test_moe_manifest_declares_router_experts_and_one_reduction_per_layer():
    m = moe_manifest(spec(layers=(1, 3)))
    by_role = {}
    for e in m.entries:
        by_role.setdefault(e.role, []).append(e)
    assert [e.name for e in by_role["router"]] == ["model.layers.1.mlp.gate.weight", "model.layers.3.mlp.gate.weight"]
    assert all(isinstance(e.policy, Replicate) for e in by_role["router"])
    assert all(e.policy == ExpertParallel(SplitOutput()) for e in by_role["gate"] + by_role["up"])
    assert all(e.policy == ExpertParallel(SplitInput("model.layers.%d.mlp.experts.down_reduce" % e.layer))
               for e in by_role["down"])
    assert len(by_role["gate"]) == len(by_role["down"]) == 16
    assert [(c.name, c.layer, c.axes) for c in m.collectives] == [
        ("model.layers.1.mlp.experts.down_reduce", 1, ("tp", "ep")),
        ("model.layers.3.mlp.experts.down_reduce", 3, ("tp", "ep"))]
    assert m.entry("model.layers.3.mlp.experts.7.down_proj.weight").shape == (256, 1536)
    assert m.sha256 == moe_manifest(spec(layers=(1, 3))).sha256  # deterministic identity
    assert m.sha256 != moe_manifest(spec(layers=(1, 3)), "strided").sha256


def test_mixtral_names():
    assert moe_prefix(MIXTRAL, 4) == "model.layers.4.block_sparse_moe"
    m = moe_manifest(spec(layout=MIXTRAL))
    assert m.entries[0].name == "model.layers.1.block_sparse_moe.gate.weight"
    assert m.entries[1].name == "model.layers.1.block_sparse_moe.experts.0.w1.weight"


def test_the_128_rule_says_what_to_do():
    m = moe_manifest(spec(I=1536))
    assert split_sizes_that_work(1536, exl3=True) == [1, 2, 3, 4, 6, 12]
    for tp in (1, 2, 3, 4, 6, 12):
        check_mesh(m, tp, 1, 1)
    with pytest.raises(FqError) as e:
        check_mesh(m, 8, 1, 1)
    msg = str(e.value)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight: out 1536 / 8 = 192 is not a multiple of 128" in msg
    assert "TP sizes that work for this manifest: 1, 2, 3, 4, 6, 12" in msg
    assert "or use expert parallelism (--ep)" in msg
    with pytest.raises(FqError, match=r"out 1536 / 5 is not an integer"):
        check_mesh(m, 5, 1, 1)


def test_sizes_that_work_are_common_to_every_split():
    m = moe_manifest(MoeSpec(STANDARD, (MoeLayer(1, (0, 1), ((1536, 256),) * 2 + ((256, 1536),)),
                                        MoeLayer(2, (0, 1), ((1024, 256),) * 2 + ((256, 1024),)))))
    with pytest.raises(FqError, match="TP sizes that work for this manifest: 1, 2, 4;"):
        check_mesh(m, 3, 1, 1)  # 1536 takes 3, 1024 does not


def test_expert_parallel_sizes():
    m = moe_manifest(spec(experts=8))
    check_mesh(m, 1, 8, 1)
    with pytest.raises(FqError, match="layer 1: 8 experts do not divide over ep=3; EP sizes that work: 1, 2, 4, 8"):
        check_mesh(m, 1, 3, 1)


def test_mesh_sizes_and_stages_checked():
    m = moe_manifest(spec(layers=(1, 2)))
    with pytest.raises(FqError, match="pp=3 stages but only 2 layers"):
        check_mesh(m, 1, 1, 3)
    with pytest.raises(FqError, match="tp must be a positive integer"):
        check_mesh(m, 0, 1, 1)


@pytest.mark.parametrize("entries, collectives, message", [
    ([dense("a"), dense("a")], [], "'a': declared twice"),
    ([dense("a b")], [], "name must be"),
    ([dense("a", role="gate")], [], "role gate needs expert id"),
    ([dense("a", role="router", expert=1)], [], "role router takes no expert id"),
    ([dense("a", role="wizard")], [], "role 'wizard'"),
    ([dense("a", shape=(256, 200), dtype=EXL3)], [], "EXL3 linear is (out, in) with both multiples of 128"),
    ([dense("a", dtype="F17")], [], "dtype 'F17'"),
    ([dense("a", shape=(0, 4))], [], "positive integers"),
    ([dense("a", layer=None)], [], "needs role embed"),
    ([dense("a", policy=SplitInput("r"))], [], "reduces into 'r', which is not a declared collective"),
    ([dense("a", policy=SplitInput("r"))], [Collective("r", 1)], "layer 0 reduces into 'r' of layer 1"),
    ([dense("a", policy=SplitInput("r"))], [Collective("r", 0, ("ep",))], "must reduce over 'tp'"),
    ([dense("a", policy=ExpertParallel(SplitInput("r")), role="down", expert=0)], [Collective("r", 0)],
     "must reduce over 'ep' too"),
    ([dense("a")], [Collective("r", 0)], "no entry reduces into it"),
    ([dense("a", policy=SplitInput("r")), dense("b", policy=SplitInput("r"))],
     [Collective("r", 0), Collective("r", 0)], "'r': declared twice"),
    ([dense("a", policy=SplitInput("r"))], [Collective("r", 0, ("tp", "pp"))], "axes"),
    ([dense("a", policy=Tied("z"))], [], "tied to 'z', which is not declared"),
    ([dense("a", policy=Tied("a"))], [], "which is itself"),
    ([dense("a"), dense("b", policy=Tied("a")), dense("c", policy=Tied("b"))], [], "itself tied; tie to the owner"),
    ([dense("a"), dense("b", shape=(128, 256), policy=Tied("a"))], [], "tied to 'a' but is BF16 [128, 256]"),
    ([dense("a", policy=ExpertParallel(SplitOutput(), "random"), role="gate", expert=0)], [], "assignment 'random'"),
    ([dense("a", policy=Pinned(-1))], [], "pinned rank"),
    ([dense("a", shape=(256,), policy=SplitOutput())], [], "only 2-D weights split"),
])
def test_manifest_validation(entries, collectives, message):
    with pytest.raises(FqError) as e:
        TpManifest(tuple(entries), tuple(collectives))
    assert message in str(e.value)


def test_pinned_rank_must_exist_on_the_mesh():
    m = TpManifest((dense("a", policy=Pinned(5)),))
    check_mesh(m, 2, 3, 1)
    with pytest.raises(FqError, match="pinned to rank 5, the mesh has 4 ranks"):
        check_mesh(m, 2, 2, 1)


def test_spec_geometry_checked():
    with pytest.raises(FqError, match="not an MoE MLP"):
        MoeSpec(STANDARD, (MoeLayer(1, (0,), ((512, 128), (512, 128), (512, 128))),))
    with pytest.raises(FqError, match="ascending and unique"):
        MoeSpec(STANDARD, (MoeLayer(1, (1, 0), ((512, 128), (512, 128), (128, 512))),))
    s = spec(layers=(1, 3))
    assert MoeSpec.from_json(s.to_json(), "x") == s
    with pytest.raises(FqError, match="x: not an MoE spec"):
        MoeSpec.from_json({"layout": STANDARD.to_json()}, "x")
