"""A chain's native comparison, like with like (fq.planning.native): the one rule fq eval, the report and the
campaign's native jobs share. Pure data (recipes, plan-shaped dicts) except the last test, which plans the demo
campaign (no Snakemake)."""
from __future__ import annotations

import copy
import json
from pathlib import Path

from fq.planning.model_bits import class_bits
from fq.planning.native import Like, native_bases, plan_likes, recipe_likes
from fq.planning.recipe import parse_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
DEMO = json.loads((RECIPES / "demo.json").read_text())
HOT = {1: (0, 1), 2: (6, 7)}  # a resolved hot selection: some experts of each MoE layer
FULL = {"attention": 4, "shared": 4, "dense": 4, "head": 6}


def recipe(nodes=(), products=(), base=DEMO):
    doc = copy.deepcopy(base)
    doc["nodes"] += list(nodes)
    doc["products"] += list(products)
    return parse_recipe(doc, "demo.json + test nodes")


def selections(r):
    """node -> None (every expert), or a resolved hot selection for a node that takes the hottest."""
    return {n.name: HOT if n.experts.mode == "hot" else None for n in r.nodes}


def pairs(r):
    return native_bases(recipe_likes(r, selections(r)))


def stage(name, parent, K=1, **over):
    return {"name": name, "kind": "stage", "K": K, "codebook": "mul1", "parent": parent, "experts": "all", **over}


def product(name, *chain):
    return {"name": name, "chain": list(chain)}


def test_the_demos_residual_chain_is_compared_with_the_experts_only_k3_not_the_whole_model_one():
    """k3 and k3.w4 are both K3 mul1; k2.r1 (an experts-only chain) is k3's like: the same bf16 linears. The hot
    chain (5 bits on 2 experts per layer) has no base: the one-pass K5 encode."""
    r = recipe()
    likes = recipe_likes(r, selections(r))
    assert likes["k2.r1"][1] == likes["k3"][1] != likes["k3.w4"][1]
    assert likes["k3.w4"][1].linears == {ln.digest for ln in r.base_linears("k3.w4").values()}
    assert pairs(r) == {"k2.r1": "k3"}


def test_a_chain_on_the_whole_model_base_is_compared_with_the_whole_model_base_of_its_bits():
    r = recipe([stage("k2.w4.r1", "k2.w4")], [product("k2.w4.r1", "k2.w4", "k2.w4.r1")])
    assert pairs(r) == {"k2.r1": "k3", "k2.w4.r1": "k3.w4"}


def test_a_chain_whose_stage_corrects_linears_has_no_base_even_at_equal_bits_per_class():
    """attention K4 + a K2 residual is 6 bits over attention, as a base's attention K6 is, but other weights: no
    published base is its like (the one-pass encode over the chain's own linears is)."""
    six = {"name": "k3.a6", "kind": "base", "K": 3, "codebook": "mul1", "skeleton": dict(FULL, attention=6)}
    r = recipe([stage("k2.w4.a2", "k2.w4", skeleton={"attention": 2}), six],
               [product("k2.w4.a2", "k2.w4", "k2.w4.a2"), product("k3.a6", "k3.a6")])
    prods = {p.name: p for p in r.products}
    assert class_bits(r, prods["k2.w4.a2"]) == class_bits(r, prods["k3.a6"])
    assert "k2.w4.a2" not in pairs(r)


def test_a_partial_last_stage_has_no_base_and_two_identical_bases_give_the_first_name():
    """A K1 stage on the 2 hottest experts is 3 bits there and 2 elsewhere: not a K3 base's like. Two bases alike in
    everything but their names: the alphabetically first (k3 before k3b)."""
    r = recipe([stage("k2.h1", "k2", experts={"hot": 2}), {"name": "k3b", "kind": "base", "K": 3, "codebook": "mul1"}],
               [product("k2.h1", "k2", "k2.h1"), product("k3b", "k3b")])
    assert pairs(r) == {"k2.r1": "k3"}
    # another codebook is not alike either
    r = recipe([{"name": "m2", "kind": "base", "K": 2, "codebook": "mcg"}, stage("m2.r1", "m2", codebook="mcg")],
               [product("m2", "m2"), product("m2.r1", "m2", "m2.r1")])
    assert pairs(r) == {"k2.r1": "k3"}


def _plan(chain, covers, linears=(), stage_linears=()):
    """A product plan's predicate, as far as the pairing reads it (fq.provenance.assembly.build_assembly's fields)."""
    return {"chain": [{"node": n, "K": K, "codebook": "mul1"} for n, K in chain],
            "fragments": [{"node": n, "layer": l, "experts": [{"expert": e} for e in es]}
                          for n, per_layer in covers.items() for l, es in per_layer.items()],
            "linears": [{"name": f"base/x/{d}-{i}", "digest": d} for i, d in enumerate(linears)],
            **({"stage_linears": [{"name": f"stages/y/{d}", "digest": d, "stage": "y"} for d in stage_linears]}
               if stage_linears else {})}


def test_signed_plans_pair_by_the_same_rule():
    every = {1: range(8), 2: range(8)}
    att, res = "a" * 64, "b" * 64
    plans = {"k2": _plan([("k2", 2)], {"k2": every}),
             "k3": _plan([("k3", 3)], {"k3": every}),
             "k3.w4": _plan([("k3.w4", 3)], {"k3.w4": every}, linears=[att, att]),  # one fragment per layer
             "k2.r1": _plan([("k2", 2), ("k2.r1", 1)], {"k2": every, "k2.r1": every}),
             "k2.w4.r1": _plan([("k2.w4", 2), ("r1", 1)], {"k2.w4": every, "r1": every}, linears=[att]),
             "k2.w4.a2": _plan([("k2.w4", 2), ("a2", 1)], {"k2.w4": every, "a2": every}, linears=[att],
                               stage_linears=[res]),
             "k2.h1": _plan([("k2", 2), ("h1", 1)], {"k2": every, "h1": HOT})}
    likes = plan_likes(plans)
    assert likes["k3.w4"] == (1, Like(3, "mul1", frozenset({att}), True))
    assert likes["k2.h1"][1].whole is False and likes["k2.w4.a2"][1].linears == {att, res}
    assert native_bases(likes) == {"k2.r1": "k3", "k2.w4.r1": "k3.w4"}


def test_the_campaign_encodes_a_native_point_for_a_chain_no_base_is_like(tmp_path):
    """The demo campaign's native jobs (compare_native): with a K1 stage on k2.w4 that also corrects attention, the
    K3 bases do not serve it, so a one-pass K3 encode of its experts is planned beside the hot chain's K5."""
    from fq.workflow.campaign import load_campaign

    doc = copy.deepcopy(DEMO)
    doc["nodes"].append(stage("k2.w4.a2", "k2.w4", skeleton={"attention": 2}))
    doc["products"].append(product("k2.w4.a2", "k2.w4", "k2.w4.a2"))
    (tmp_path / "r.json").write_text(json.dumps(doc))
    cfg = {"campaign": "t", "out": str(tmp_path / "o"), "source": {"kind": "demo"}, "recipe": str(tmp_path / "r.json"),
           "block_size": 4, "windows": "1,2", "windows_on_disk": 1, "encode": {"device": "cpu"},
           "compare_native": True, "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}
    c = load_campaign(cfg)
    assert c.compare.native_bases == {"k2.r1": "k3"}
    assert list(c.compare.native_jobs) == [(3, "mul1"), (5, "mul1")]
    assert all(e == (0, 1, 2, 3) or e == (4, 5, 6, 7) for e in c.compare.native_jobs[(3, "mul1")].values())
