"""Stages that also upgrade non-expert classes (recipe ``skeleton`` on a stage: a residual on attention, ...): the
recipe fields and refusals, one linear stage node per (class, K, codebook, linear ancestry) with its digest chained
from its parent's, the plan's entries and bits over the whole model, the price, the plan's chain-edge check of the
residual fragments, and the consumers that refuse them. The campaign that encodes, publishes, verifies and loads
them is test_calibration_workflow.py's (its stage names skeleton {"attention": 2}), whose module holds those tests."""
from __future__ import annotations

import pytest

from fq.errors import FqError
from fq.planning.plan import make_plan
from fq.planning.recipe import parse_recipe

FULL = {"attention": 4, "shared": 4, "dense": 4, "head": 6}


def recipe(stages, base_skeleton=FULL, products=None):
    nodes = [{"name": "a", "kind": "base", "K": 2, "codebook": "mul1", "skeleton": base_skeleton}, *stages]
    parent = {n["name"]: n.get("parent") for n in nodes}
    if products is None:
        products = []
        for n in nodes:
            chain = [n["name"]]
            while parent.get(chain[-1]):
                chain.append(parent[chain[-1]])
            products.append({"name": n["name"], "chain": chain[::-1]})
    return {"format": "fq-cartridge/2", "name": "ls", "nodes": nodes, "products": products}


def stage(name, parent, skeleton=None, K=1, cb="mul1"):
    out = {"name": name, "kind": "stage", "parent": parent, "K": K, "codebook": cb, "experts": "all"}
    return out if skeleton is None else dict(out, skeleton=skeleton)


def test_a_stage_skeleton_is_a_linear_node_on_its_chains_linear_ancestry():
    r = parse_recipe(recipe([stage("a.r1", "a", {"attention": 2, "head": 1}), stage("a.r2", "a", {"attention": 2}),
                             stage("a.r1.r1", "a.r1", {"attention": 1}), stage("a.x", "a"),
                             stage("a.x.r1", "a.x", {"attention": 2})]), "r.json")
    assert r.node("a.r1").skeleton == (("attention", 2), ("head", 1))
    names = [n.name for n in r.linear_nodes]
    assert names == ["attention-K4-mul1", "attention-K4-mul1+K2-mul1", "attention-K4-mul1+K2-mul1+K1-mul1",
                     "shared-K4-mul1", "dense-K4-mul1", "head-K6-mul1", "head-K6-mul1+K1-mul1"]
    # shared by every stage on the same linear ancestry: siblings, and a stage under one that does not touch attention
    assert r.linear_users("attention-K4-mul1+K2-mul1") == ("a.r1", "a.r2", "a.x.r1")
    assert r.node_linears("a.x") == {}
    deep = r.node_linears("a.r1.r1")["attention"]
    assert deep.parent == r.node_linears("a.r1")["attention"] and deep.role == "stage" and deep.depth == 2
    assert [ln.name for ln in r.chain_linears("a.r1.r1")["attention"]] == names[:3]
    assert [ln.name for ln in r.chain_linears("a.r1.r1")["head"]] == ["head-K6-mul1", "head-K6-mul1+K1-mul1"]
    # the stage's skeleton is not part of its experts' node digest; the linear node's digest binds its parent's
    plain = parse_recipe(recipe([stage("a.r1", "a"), stage("a.r2", "a"), stage("a.r1.r1", "a.r1"), stage("a.x", "a"),
                                 stage("a.x.r1", "a.x")]), "r.json")
    assert all(r.node_digest(n) == plain.node_digest(n) for n in r.node_names)
    other = parse_recipe(recipe([stage("a.r1", "a", {"attention": 2})], dict(FULL, attention=5)), "r.json")
    mine, theirs = r.node_linears("a.r1")["attention"], other.node_linears("a.r1")["attention"]
    assert (mine.K, mine.codebook) == (theirs.K, theirs.codebook) and mine.digest != theirs.digest
    assert mine.to_json()["parent"] == "attention-K4-mul1"


@pytest.mark.parametrize("skeleton, needles", [
    ({"attention": 2}, ["r.json", "stage 'a.r1'", "skeleton.attention", "base 'a' leaves attention unquantized"]),
    ({"attention": 16}, ["nodes[1].skeleton.attention", "at most 8"]),
    ({"attention": 0}, ["nodes[1].skeleton.attention", "at least 1"]),
    ({"embeddings": 2}, ["nodes[1].skeleton", "embeddings"]),
])
def test_stage_skeleton_refusals_name_the_file_stage_and_field(skeleton, needles):
    with pytest.raises(FqError) as e:
        parse_recipe(recipe([stage("a.r1", "a", skeleton)], {"head": 6}), "r.json")
    for n in needles:
        assert n in str(e.value), str(e.value)
    # a stage deeper in the chain is refused by its chain's base too
    with pytest.raises(FqError, match="stage 'a.r1.r1'.*skeleton.dense: its chain's base 'a' leaves dense"):
        parse_recipe(recipe([stage("a.r1", "a"), stage("a.r1.r1", "a.r1", {"dense": 2})], {"attention": 4}), "r.json")


def test_plan_lists_the_residual_linear_node_and_counts_its_bits(glm5):
    r = parse_recipe(recipe([stage("a.r1", "a", {"attention": 2}), stage("a.r2", "a")]), "r.json")
    plan = make_plan(r, glm5)
    lin = {n["name"]: n for n in plan.linears}
    res = lin["attention-K4-mul1+K2-mul1"]
    assert res["parent"] == "attention-K4-mul1" and res["parent_digest"] == lin["attention-K4-mul1"]["digest"]
    assert res["layers"] == lin["attention-K4-mul1"]["layers"] and res["digest"] == r.linear_nodes[1].digest
    assert {n["name"]: n.get("skeleton") for n in plan.to_json()["nodes"]}["a.r1"] == {
        "attention": "attention-K4-mul1+K2-mul1"}
    by = {p["name"]: p for p in plan.products}
    assert by["a.r1"]["bpw"] == by["a.r2"]["bpw"] == 3
    from fq.planning.model_bits import class_bits, linear_weights

    w = linear_weights(glm5)
    gain = by["a.r1"]["model_bpw"] - by["a.r2"]["model_bpw"]  # attention's 2 extra bits over the whole model
    assert gain == pytest.approx(2 * w["attention"] / (w["experts"] + w["attention"] + w["shared"] + w["dense"]
                                                       + w["other"]), abs=1e-3)
    assert class_bits(r, r.products[1]) == {"attention": 6, "shared": 4, "dense": 4, "head": 6}

    from fq.planning.price import load_cost_table, price_recipe

    price = price_recipe(r, glm5, load_cost_table())
    pl = {ln.name: ln for ln in price.linears}
    assert pl["attention-K4-mul1+K2-mul1"].replaced_bytes == 0 < pl["attention-K4-mul1+K2-mul1"].output_bytes
    pp = {p.name: p for p in price.products}
    assert pp["a.r1"].bytes - pp["a.r2"].bytes == pl["attention-K4-mul1+K2-mul1"].output_bytes
    assert pp["a.r1"].increment_bytes - pp["a.r2"].increment_bytes == pl["attention-K4-mul1+K2-mul1"].output_bytes


def _plan(stage_linears, linears=None):
    d = lambda c: c * 64  # noqa: E731
    chain = [{"node": "a", "role": "base", "K": 2, "codebook": "mul1", "parent": None, "digest": d("0")},
             {"node": "a.r1", "role": "stage", "K": 1, "codebook": "mul1", "parent": "a", "digest": d("1")}]
    linears = linears if linears is not None else [
        {"name": "base/a/attention-K4-mul1-layer000.safetensors", "sha256": d("a"), "class": "attention", "layer": 0}]
    return {"chain": chain, "linears": linears, "stage_linears": stage_linears}


def _res(**over):
    return {"name": "stages/a.r1/attention-K4-mul1+K2-mul1-layer000.safetensors", "sha256": "b" * 64, "stage": "a.r1",
            "class": "attention", "layer": 0,
            "parent": {"name": "attention-K4-mul1-layer000.safetensors", "sha256": "a" * 64}, **over}


@pytest.mark.parametrize("entry, linears, needle", [
    (_res(parent={"name": "attention-K4-mul1-layer000.safetensors", "sha256": "c" * 64}), None, "chain edge broken"),
    (_res(layer=1), None, "which the chain before stage a.r1 does not quantize"),
    (_res(), [], "does not quantize"),
    (_res(stage="a"), None, "not a stage of the chain"),
    (_res(name="stages/b/attention-K4-mul1+K2-mul1-layer000.safetensors"), None, "outside stages/a.r1/"),
])
def test_a_plans_stage_linears_must_chain_onto_the_linears_they_correct(entry, linears, needle):
    from fq.provenance.assembly import check_stage_linears, plan_subjects

    check_stage_linears(_plan([_res()]), "plan")
    with pytest.raises(FqError, match=needle):
        check_stage_linears(_plan([entry], linears), "plan")
    with pytest.raises(FqError, match="two linear fragments of stage a.r1"):
        check_stage_linears(_plan([_res(), _res()]), "plan")
    signed = plan_subjects({**_plan([_res()]), "fragments": [], "base": {"manifest": {"name": "m", "sha256": "d" * 64}}})
    assert signed == [(_res()["name"], "b" * 64), ("m", "d" * 64)]  # the residuals are signed subjects of the plan


def test_consumers_of_expert_stages_only_refuse_a_product_with_stage_linears():
    from fq.provenance.assembly import SignedPlan
    from fq.provenance.product import VerifiedProduct

    p = VerifiedProduct(SignedPlan("x/assemblies/a.r1.assembly.intoto.jsonl", "0" * 64, {"product": "a.r1",
                                                                           "stage_linears": [_res()]}), None, None)
    with pytest.raises(FqError, match="stage.s. a.r1 also correct non-expert linears.*fq combine's adapter carries "
                                      "routed-expert stages only.*CPU runtime"):
        p.refuse_stage_linears("fq combine's adapter")
    VerifiedProduct(SignedPlan("p", "0" * 64, {"product": "a"}), None, None).refuse_stage_linears("anything")
