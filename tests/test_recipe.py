"""fq-cartridge/2 recipes: shipped graphs, derived numbers, and every validation refusal."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from fq.errors import FqError
from fq.model.usage import parse_usage
from fq.planning.recipe import load_recipe, parse_recipe, resolve_selections, selection_counts

RECIPES = Path(__file__).resolve().parents[1] / "recipes"


def doc(nodes, products=None, **extra):
    """A recipe document; products default to every node's chain."""
    if products is None:
        parent = {n["name"]: n.get("parent") for n in nodes}
        products = []
        for n in nodes:
            chain = [n["name"]]
            while parent.get(chain[-1]) is not None and len(chain) < 20:
                chain.append(parent[chain[-1]])
            products.append({"name": n["name"], "chain": chain[::-1]})
    return {"format": "fq-cartridge/2", "name": "t", "nodes": nodes, "products": products, **extra}


def base(name, K=2, cb="mul1"):
    return {"name": name, "kind": "base", "K": K, "codebook": cb}


def stage(name, parent, K=1, experts="all", cb="mul1"):
    return {"name": name, "kind": "stage", "parent": parent, "K": K, "codebook": cb, "experts": experts}


def refuse(d, *needles):
    with pytest.raises(FqError) as e:
        parse_recipe(d, "r.json")
    msg = str(e.value)
    for n in needles:
        assert n in msg, msg
    return msg


# -- shipped recipes -------------------------------------------------------------------------


def test_dag_and_lean_numbers():
    dag = load_recipe(RECIPES / "glm52-k2k3-dag.json")
    lean = load_recipe(RECIPES / "glm52-k2k3-lean.json")
    assert (dag.passes, dag.encoded_bpw, len(dag.products), dag.nominal_bpw) == (9, 14, 9, 35)
    assert (lean.passes, lean.encoded_bpw, len(lean.products), lean.nominal_bpw) == (7, 12, 7, 26)
    # lean is dag without the two K1-on-K1 stages, and nothing else
    assert set(dag.node_names) - set(lean.node_names) == {"k2.r1.r1", "k3.r1.r1"}
    for n in lean.nodes:
        assert n == dag.node(n.name)


def test_dag_graph_shape():
    dag = load_recipe(RECIPES / "glm52-k2k3-dag.json")
    assert [n.name for n in dag.bases] == ["k2", "k3"]
    assert set(dag.edges) == {("k2", "k2.r1"), ("k2", "k2.r2"), ("k2.r1", "k2.r1.r1"), ("k2.r2", "k2.r2.r1"),
                              ("k3", "k3.r1"), ("k3", "k3.r2"), ("k3.r1", "k3.r1.r1")}
    order = dag.node_names
    for parent, child in dag.edges:
        assert order.index(parent) < order.index(child)
    assert dag.chain("k2.r2.r1") == ("k2", "k2.r2", "k2.r2.r1")
    assert set(dag.descendants("k2")) == {"k2.r1", "k2.r2", "k2.r1.r1", "k2.r2.r1"}
    assert {(p.name, dag.product_bpw(p)) for p in dag.products} >= {("k2", 2), ("k3.r1.r1", 5), ("k2.r2.r1", 5)}


def test_hot_and_demo_recipes():
    hot = load_recipe(RECIPES / "glm52-k2-hot96.json")
    assert [(n.name, n.K, n.experts.to_json()) for n in hot.stages] == [("k2.r1", 1, "all"), ("k2.r1.h96", 2, {"hot": 96})]
    assert hot.uses_hot
    demo = load_recipe(RECIPES / "demo.json")
    assert len(demo.bases) == 5 and {n.codebook for n in demo.nodes} == {"mul1"}
    # one budgeted base (bits), whose K per unit comes from the campaign's allocation; not resolved here
    assert [(n.name, n.bits, n.K) for n in demo.budgeted] == [("b3", 3.0, None)] and not demo.resolved
    # the two whole-model bases share one encoding of each non-expert class
    assert [n.name for n in demo.linear_nodes] == ["attention-K4-mul1", "shared-K4-mul1", "dense-K4-mul1",
                                                   "head-K6-mul1"]
    assert any(n.experts.mode == "hot" and n.experts.hot <= 8 for n in demo.stages)
    assert any(n.experts.mode == "all" for n in demo.stages)
    # works with the demo model's 8 experts per layer (and any larger model)
    with pytest.raises(FqError, match="b3.up.*measured allocation"):  # a budgeted stage's experts are measured
        selection_counts(demo, [1, 2], 8)
    demo = parse_recipe({**json.loads((RECIPES / "demo.json").read_text()),
                         "nodes": [n for n in json.loads((RECIPES / "demo.json").read_text())["nodes"]
                                   if n["name"] != "b3.up"],
                         "products": [p for p in json.loads((RECIPES / "demo.json").read_text())["products"]
                                      if p["name"] != "b3.up"]})
    counts = selection_counts(demo, [1, 2], 8)
    assert all(v in (2, 8) for sel in counts.values() for v in sel.values())


def test_recipe_sha256_ignores_formatting(tmp_path):
    d = json.loads((RECIPES / "glm52-k2k3-lean.json").read_text())
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(d, indent=4))
    b.write_text(json.dumps(d, separators=(",", ":")))
    assert load_recipe(a).sha256 == load_recipe(b).sha256
    d["nodes"][0]["K"] = 3
    b.write_text(json.dumps(d))
    assert load_recipe(a).sha256 != load_recipe(b).sha256


def test_node_digest_changes_for_node_and_descendants_only():
    d = json.loads((RECIPES / "glm52-k2k3-dag.json").read_text())
    before = parse_recipe(d)
    changed = copy.deepcopy(d)
    next(n for n in changed["nodes"] if n["name"] == "k2.r2")["K"] = 3
    after = parse_recipe(changed)
    moved = {n for n in before.node_names if before.node_digest(n) != after.node_digest(n)}
    assert moved == {"k2.r2", "k2.r2.r1"}


def test_topological_order_even_when_file_lists_children_first():
    r = parse_recipe(doc([stage("a.r1", "a"), base("a")]))
    assert r.node_names == ("a", "a.r1")


# -- schema refusals --------------------------------------------------------------------------


@pytest.mark.parametrize("K", [0, 9, 2.25, 4.5, "2"])
def test_K_outside_1_to_8(K):
    d = doc([base("a"), stage("a.r1", "a", K=K)])
    refuse(d, "r.json", "nodes[1].K", "'a.r1'")


def test_half_integer_K_with_mul1_only():
    """exllamav3's half-integer rates: a node's K and its skeleton classes at 1.5, 2.5, 3.5 with mul1; refused by
    name with another codebook."""
    r = parse_recipe(doc([{**base("h", K=1.5), "skeleton": {"attention": 3.5, "head": 6}}, stage("h.r", "h", K=2.5)]),
                     "r.json")
    assert r.node("h").K == 1.5 and r.node("h").skeleton == (("attention", 3.5), ("head", 6))
    assert [n.name for n in r.linear_nodes] == ["attention-K3.5-mul1", "head-K6-mul1"]
    refuse(doc([base("a", K=2.5, cb="mcg")]), "nodes[0] ('a') K 2.5", "needs codebook mul1", "'mcg'")
    refuse(doc([{**base("a", cb="3inst"), "skeleton": {"attention": 3.5}}]), "skeleton.attention 3.5", "mul1")


def test_schema_errors_name_the_field():
    refuse(doc([base("a", cb="int4")]), "nodes[0].codebook", "'int4'", "mul1")
    refuse({**doc([base("a")]), "format": "fq-cartridge/1"}, "format", "fq-cartridge/2")
    refuse(doc([{**base("a"), "colour": 1}]), "nodes[0]", "colour")
    refuse(doc([base("a"), stage("a.r1", "a", experts="al")]), "nodes[1].experts", "all", "hot")
    refuse(doc([base("a"), stage("a.r1", "a", experts={"hot": 0})]), "nodes[1].experts")
    refuse(doc([base("a"), {k: v for k, v in stage("a.r1", "a").items() if k != "parent"}]), "nodes[1]", "parent")
    refuse(doc([base("a/b")]), "nodes[0].name")


# -- graph refusals ---------------------------------------------------------------------------


def test_duplicate_node_name():
    refuse(doc([base("a"), base("a", K=3)], products=[{"name": "p", "chain": ["a"]}]),
           "'a' is used twice", "nodes[0]", "nodes[1]")


def test_unknown_parent():
    refuse(doc([base("a"), stage("b.r1", "b")], products=[{"name": "a", "chain": ["a"]}]),
           "'b.r1'", "parent 'b'", "not a node")


def test_cycle():
    d = doc([base("a"), stage("x", "y"), stage("y", "x")], products=[{"name": "a", "chain": ["a"]}])
    refuse(d, "cycle", "x -> y -> x")
    refuse(doc([base("a"), stage("x", "x")], products=[{"name": "a", "chain": ["a"]}]), "cycle", "x -> x")


def test_product_not_a_chain():
    nodes = [base("a"), stage("a.r1", "a"), stage("a.r2", "a"), stage("a.r1.r1", "a.r1")]
    prods = [{"name": n["name"], "chain": c} for n, c in zip(nodes, [["a"], ["a", "a.r1"], ["a", "a.r2"], ["a", "a.r1", "a.r1.r1"]])]
    parse_recipe(doc(nodes, prods))
    bad = prods + [{"name": "skip", "chain": ["a", "a.r1.r1"]}]
    refuse(doc(nodes, bad), "product 'skip' is not a chain", "'a.r1.r1' has parent 'a.r1'", "'a'")
    refuse(doc(nodes, prods + [{"name": "mix", "chain": ["a", "a.r2", "a.r1.r1"]}]), "product 'mix' is not a chain")
    refuse(doc(nodes, prods + [{"name": "s", "chain": ["a.r1"]}]), "product 's'", "starts with 'a.r1', a stage")
    refuse(doc(nodes, prods + [{"name": "u", "chain": ["a", "zz"]}]), "product 'u'", "'zz' is not a node")
    refuse(doc(nodes, prods + [{"name": "a", "chain": ["a"]}]), "product name 'a' is used twice")
    refuse(doc(nodes, prods + [{"name": "again", "chain": ["a", "a.r1"]}]), "'again' repeats the chain of product 'a.r1'")


def test_node_in_no_product():
    refuse(doc([base("a"), stage("a.r1", "a")], products=[{"name": "a", "chain": ["a"]}]),
           "'a.r1'", "no product")


def test_stage_experts_not_subset_of_parent_static():
    lay = lambda m: {"layers": {str(k): v for k, v in m.items()}}  # noqa: E731
    refuse(doc([base("a"), stage("h", "a", experts={"hot": 8}), stage("h.all", "h", experts="all")]),
           "'h.all' selects all experts", "parent 'h'", "8 hottest")
    refuse(doc([base("a"), stage("h", "a", experts={"hot": 8}), stage("h.h", "h", experts={"hot": 9})]),
           "'h.h'", "only the 8 hottest", "hot <= 8")
    parse_recipe(doc([base("a"), stage("h", "a", experts={"hot": 8}), stage("h.h", "h", experts={"hot": 8})]))
    refuse(doc([base("a"), stage("l", "a", experts=lay({3: [0, 1]})), stage("l.l", "l", experts=lay({3: [1, 2]}))]),
           "'l.l'", "layer 3 experts 2", "parent 'l'")
    refuse(doc([base("a"), stage("l", "a", experts=lay({3: [0, 1]})), stage("l.l", "l", experts=lay({4: [0]}))]),
           "'l.l'", "layer 4", "no experts")


# -- selections against a model ---------------------------------------------------------------


def usage_doc(layers, n, hot_first=()):
    """Counts where ``hot_first`` experts are hottest (descending), the rest by index."""
    counts = {}
    for layer in layers:
        c = [float(n - e) for e in range(n)]
        for rank, e in enumerate(hot_first):
            c[e] = 1000.0 - rank
        counts[str(layer)] = c
    return {"format": "fq-expert-usage/1", "layers": counts}


def test_hot_selection_needs_statistics():
    r = load_recipe(RECIPES / "glm52-k2-hot96.json")
    with pytest.raises(FqError, match=r"'k2.r1.h96' selects the 96 hottest.*no expert-usage statistics.*--usage"):
        resolve_selections(r, range(3, 6), 256)
    sel = resolve_selections(r, range(3, 6), 256, parse_usage(usage_doc(range(3, 6), 256, hot_first=[200, 201])))
    assert len(sel["k2.r1.h96"][3]) == 96 and {200, 201} <= set(sel["k2.r1.h96"][3])
    assert sel["k2"][4] == tuple(range(256))


def test_hot_more_than_experts_refused():
    r = load_recipe(RECIPES / "glm52-k2-hot96.json")
    with pytest.raises(FqError, match="96 hottest.*64 experts per layer"):
        selection_counts(r, [1], 64)


def test_hot_ranking_deterministic_and_ties_by_index():
    u = parse_usage({"format": "fq-expert-usage/1", "layers": {"0": [5, 7, 7, 1, 7]}})
    assert u.hottest(0, 2, 5) == (1, 2)
    assert u.hottest(0, 3, 5) == (1, 2, 4)
    with pytest.raises(FqError, match="layers.0 has 5 counts; expected one per expert \\(6\\)"):
        u.hottest(0, 2, 6)
    with pytest.raises(FqError, match="no counts for layer 1"):
        u.hottest(1, 2, 5)
    with pytest.raises(FqError, match="layers.0"):
        parse_usage({"format": "fq-expert-usage/1", "layers": {"0": [1, -2]}})


def test_listed_experts_checked_against_model_and_hot_parent():
    lay = {"layers": {"3": [0, 5]}}
    r = parse_recipe(doc([base("a"), stage("l", "a", experts=lay)]))
    assert resolve_selections(r, [3, 4], 8)["l"] == {3: (0, 5)}
    with pytest.raises(FqError, match="lists expert\\(s\\) 5; the model has experts 0..3"):
        resolve_selections(r, [3, 4], 4)
    with pytest.raises(FqError, match="lists layer\\(s\\) 3, which are not MoE layers"):
        resolve_selections(r, [4, 5], 8)
    # listed under hot: only decidable with usage data
    r2 = parse_recipe(doc([base("a"), stage("h", "a", experts={"hot": 2}), stage("h.l", "h", experts=lay)]))
    ok = parse_usage(usage_doc([3, 4], 8, hot_first=[0, 5]))
    resolve_selections(r2, [3, 4], 8, ok)
    bad = parse_usage(usage_doc([3, 4], 8, hot_first=[0, 6]))
    with pytest.raises(FqError, match="'h.l' selects layer 3 experts 5, which its parent 'h' does not encode"):
        resolve_selections(r2, [3, 4], 8, bad)


# -- whole-model bases: skeleton bits --------------------------------------------------------


def test_skeleton_bits_parse_and_16_is_as_published():
    r = parse_recipe(doc([{**base("w"), "skeleton": {"attention": 4, "head": 6, "dense": 16}}, base("a")]), "r.json")
    w, a = r.node("w"), r.node("a")
    assert w.skeleton == (("attention", 4), ("head", 6))  # LINEAR_CLASSES order; 16 dropped
    assert (w.skeleton_bits("attention"), w.skeleton_bits("dense"), w.skeleton_bits("shared")) == (4, 16, 16)
    assert a.skeleton == () and r.base_linears("a") == {}
    # the skeleton is not part of the experts' node: the same K and codebook encode the same expert fragments (here
    # a's: w takes the experts-only base's encoding, Node.experts_from)
    other = parse_recipe(doc([{**base("w"), "skeleton": {"attention": 3}}, base("a")]), "r.json")
    assert r.node_digest("w") == other.node_digest("w") and w.experts_from == "a"


def test_bases_with_the_same_skeleton_bits_share_one_linear_node():
    r = parse_recipe(doc([{**base("k2", K=2), "skeleton": {"attention": 4, "shared": 4}},
                          {**base("k3", K=3), "skeleton": {"attention": 4, "shared": 5}},
                          {**base("k3b", K=3, cb="mcg"), "skeleton": {"attention": 4}}]), "r.json")
    assert [n.name for n in r.linear_nodes] == ["attention-K4-mcg", "attention-K4-mul1", "shared-K4-mul1",
                                                "shared-K5-mul1"]
    assert r.base_linears("k2")["attention"] is not None
    assert r.base_linears("k2")["attention"] == r.base_linears("k3")["attention"]
    assert r.base_linears("k2")["shared"] != r.base_linears("k3")["shared"]
    digests = {n.digest for n in r.linear_nodes}
    assert len(digests) == 4  # K and codebook are in the definition
    assert r.linear_node("attention-K4-mul1").K == 4
    with pytest.raises(FqError, match="attention-K3-mul1"):
        r.linear_node("attention-K3-mul1")


def test_skeleton_refusals_name_the_field():
    refuse(doc([{**base("w"), "skeleton": {"attention": 9}}]), "nodes[0].skeleton.attention", "9")
    refuse(doc([{**base("w"), "skeleton": {"attention": 0}}]), "nodes[0].skeleton.attention")
    refuse(doc([{**base("w"), "skeleton": {"embeddings": 4}}]), "nodes[0].skeleton", "embeddings")
    refuse(doc([base("a"), {**stage("a.r1", "a"), "skeleton": {"attention": 4}}]), "nodes[1]", "skeleton")


# -- bases sharing one expert encoding (Node.experts_from) ---------------------------------------------------------


def whole(name, K=2, cb="mul1", **skel):
    return dict(base(name, K, cb), skeleton=skel or {"attention": 4})


def test_bases_of_one_K_and_codebook_share_one_expert_encoding():
    demo = load_recipe(RECIPES / "demo.json")
    assert {n.name: n.experts_from for n in demo.bases} == {"k2": None, "k3": None, "k2.w4": "k2", "k3.w4": "k3",
                                                            "b3": None}
    assert demo.expert_owner("k2.w4") == "k2" and demo.expert_owner("k2.r1") == "k2.r1"
    assert [n.name for n in demo.encoding_nodes] == ["k2", "k3", "b3", "b3.up", "k2.r1", "k2.r1.h2"]
    with pytest.raises(FqError, match="not resolved into K per unit"):  # b3's bits need its allocation
        demo.encoded_bpw
    # passes and encoded bits count the shared encode once (6 nodes, 4 passes; 2+3+1+2 bits)
    d = json.loads((RECIPES / "demo.json").read_text())
    d["nodes"] = [n for n in d["nodes"] if not n["name"].startswith("b3")]
    d["products"] = [p for p in d["products"] if not p["name"].startswith("b3")]
    demo = parse_recipe(d)
    assert (demo.passes, demo.encoded_bpw, demo.nominal_bpw) == (4, 8, 18)
    assert "experts encoded once, as k2's" in __import__("fq.planning.recipe", fromlist=["x"]).recipe_table(demo)
    # the owner is the first experts-only base of that (K, codebook), wherever the whole-model base is listed; with
    # none, the first; another K or codebook is its own encoding
    r = parse_recipe(doc([whole("w"), whole("v"), base("e"), base("m", cb="mcg"), base("k3", 3)]))
    assert {n.name: n.experts_from for n in r.bases} == {"w": "e", "v": "e", "e": None, "m": None, "k3": None}
    r = parse_recipe(doc([whole("w"), whole("v", head=6)]))
    assert {n.name: n.experts_from for n in r.bases} == {"w": None, "v": "w"}


def test_sharing_leaves_other_recipes_as_they_were_and_binds_the_owner_into_the_digest():
    import hashlib

    lean = load_recipe(RECIPES / "glm52-k2k3-lean.json")
    assert all(n.experts_from is None for n in lean.nodes) and lean.passes == len(lean.nodes)
    # the digest of a node that shares nothing is the one it always was: its chain's definitions, nothing added
    for n in lean.nodes:
        chain = [{"name": m.name, "kind": m.kind, "K": m.K, "codebook": m.codebook,
                  **({"parent": m.parent, "experts": m.experts.to_json()} if m.parent else {})}
                 for m in map(lean.node, lean.chain(n.name))]
        want = hashlib.sha256(json.dumps({"format": "fq-cartridge/2", "chain": chain}, sort_keys=True,
                                         separators=(",", ":")).encode()).hexdigest()
        assert lean.node_digest(n.name) == want
    # a sharing base's definition names its owner: renaming the owner changes it and every stage on it
    d = doc([base("e"), whole("w"), stage("w.r1", "w")])
    r = parse_recipe(d)
    assert r.node("w").to_json()["experts_from"] == "e" and "experts_from" not in r.node("e").to_json()
    renamed = parse_recipe(json.loads(json.dumps(d).replace('"e"', '"e2"')))
    assert renamed.node_digest("w") != r.node_digest("w") and renamed.node_digest("w.r1") != r.node_digest("w.r1")
    # the skeleton stays outside the digest: the whole-model base's experts do not change with its linear bits
    more = parse_recipe(doc([base("e"), whole("w", attention=3), stage("w.r1", "w")]))
    assert more.node_digest("w") == r.node_digest("w")
