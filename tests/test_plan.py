"""Campaign plans on a GLM-5-shaped index: windows, staging/retirement, peak disk, identity, purity."""
from __future__ import annotations

import builtins
import io
import json
import os
from pathlib import Path

import pytest

from fq.cli import main
from fq.core import canonical
from fq.errors import FqError
from fq.model.source import parse_source
from fq.model.source_synth import glm5_like, synthetic_checkpoint, write_synthetic
from fq.model.usage import parse_usage
from fq.planning.budget import resolve_budgets
from fq.planning.plan import load_plan, make_plan, plan_table, write_plan
from fq.planning.recipe import load_recipe, parse_recipe

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
TB = 10**12


@pytest.fixture(scope="module")
def lean():
    return load_recipe(RECIPES / "glm52-k2k3-lean.json")


@pytest.fixture(scope="module")
def dag():
    return load_recipe(RECIPES / "glm52-k2k3-dag.json")


def replay(plan, source):
    """Walk the plan as the workflow would, checking every staging/retirement rule independently."""
    W = plan.windows_on_disk
    on_disk, staged, retired = set(), set(), set()
    for w in plan.windows:
        if w.index - W >= 0:
            on_disk -= set(plan.windows[w.index - W].retire)
        assert not set(w.stage) & staged, "a shard is fetched twice"
        on_disk |= set(w.stage)
        staged |= set(w.stage)
        assert set(w.keep) <= on_disk and not set(w.keep) & set(w.stage)
        for b in plan.blocks:
            if b.window == w.index:
                assert set(b.shards) <= on_disk, f"block {b.name} runs without its shards"
        assert sum(source.shard_sizes[s] for s in on_disk) == w.source_bytes
        assert not set(w.retire) & retired, "a shard is retired twice"
        retired |= set(w.retire)
        later = {s for b in plan.blocks if b.window > w.index for s in b.shards}
        assert not set(w.retire) & later, "a shard is retired before its last use"
    assert staged == retired == set(source.shards)


def test_glm5_lean_operator_windows(glm5, lean):
    plan = make_plan(lean, glm5, windows="3-20,21-50,51-77", windows_on_disk=1)
    assert [w.layers for w in plan.windows] == [tuple(range(3, 21)), tuple(range(21, 51)), tuple(range(51, 78))]
    assert len(plan.blocks) == 75 * 8 and all(b.count == 32 for b in plan.blocks)
    assert len(plan.fragments()) == 7 * 600
    # skeleton-only shards are staged with window 0 although no block needs them
    assert plan.skeleton_only_shards and set(plan.skeleton_only_shards) <= set(plan.windows[0].stage)
    assert set(plan.windows[0].skeleton_only) == set(plan.skeleton_only_shards)
    assert not set(plan.skeleton_only_shards) & {s for b in plan.blocks for s in b.shards}
    # shards straddling a window boundary are kept, not fetched again
    assert plan.straddling, "the GLM-5 index has shards straddling these boundaries"
    for shard, (first, last) in plan.straddling.items():
        assert first < last
        assert shard in plan.windows[first].stage and shard in plan.windows[last].retire
        assert all(shard in plan.windows[w].keep and shard not in plan.windows[w].stage for w in range(first + 1, last + 1))
    replay(plan, glm5)
    # W = 1: on disk is one window's shards plus straddlers still needed, never two windows
    for w in plan.windows:
        assert w.source_bytes == sum(glm5.shard_sizes[s] for s in set(w.stage) | set(w.keep))
    assert plan.bytes["peak_source"] == max(w.source_bytes for w in plan.windows)
    assert plan.bytes["peak_local"] == plan.windows[-1].local_bytes  # outputs accumulate until finalize


def test_two_windows_on_disk(glm5, lean):
    one = make_plan(lean, glm5, windows="3-20,21-50,51-77", windows_on_disk=1)
    two = make_plan(lean, glm5, windows="3-20,21-50,51-77", windows_on_disk=2)
    replay(two, glm5)
    assert two.bytes["peak_source"] > one.bytes["peak_source"]
    assert two.identity == one.identity  # W changes disk, not what is encoded


@pytest.mark.parametrize("spec,needles", [
    ("3-12,14-77", ["layer(s) 13 in no window"]),
    ("3-13,13-77", ["layer(s) 13 named twice", "3-13 and 13-77"]),
    ("3-40,41-78", ["layer(s) 78 not encoded by the recipe", "3-77"]),
    ("0-40,41-77", ["layer(s) 0-2 not encoded"]),
    ("3-8 8-13 15-80", ["14 in no window", "78-80 not encoded", "8 named twice"]),
    ("41-77,3-40", ["ascending"]),
    ("3-40,x", ["'x' is not a layer range"]),
    ("40-3", ["runs backwards"]),
    ("", ["empty"]),
])
def test_window_partition_refusals_name_layers(glm5, lean, spec, needles):
    with pytest.raises(FqError) as e:
        make_plan(lean, glm5, windows=spec)
    for n in needles:
        assert n in str(e.value), str(e.value)


def test_windows_from_disk_budget(glm5, dag, lean):
    plan = make_plan(dag, glm5, disk_budget=int(1.6 * TB))
    assert plan.bytes["peak_local"] <= 1.6 * TB
    assert [l for w in plan.windows for l in w.layers] == list(range(3, 78))
    replay(plan, glm5)
    tighter = make_plan(dag, glm5, disk_budget=int(1.45 * TB))
    assert len(tighter.windows) > len(plan.windows) and tighter.bytes["peak_local"] <= 1.45 * TB
    # the dag writes more than the lean graph, so it needs more windows on the same disk
    assert len(make_plan(lean, glm5, disk_budget=int(1.6 * TB)).windows) < len(plan.windows)
    with pytest.raises(FqError, match="below the peak of even one-layer windows.*outputs and skeleton alone"):
        make_plan(dag, glm5, disk_budget=1 * TB)
    with pytest.raises(FqError, match="alternatives"):
        make_plan(dag, glm5, disk_budget=2 * TB, windows="3-77")


def test_default_is_one_window(glm5, lean):
    plan = make_plan(lean, glm5)
    assert len(plan.windows) == 1 and not plan.straddling
    assert plan.bytes["peak_source"] == glm5.total_bytes


def test_block_size_and_partial_blocks(glm5, lean):
    plan = make_plan(lean, glm5, block_size=48)
    per_layer = [(b.first_expert, b.count) for b in plan.blocks if b.layer == 3]
    assert per_layer == [(0, 48), (48, 48), (96, 48), (144, 48), (192, 48), (240, 16)]
    for bad in (0, -1, True, "32", 2.0):
        with pytest.raises(FqError, match="block_size: expected a positive integer"):
            make_plan(lean, glm5, block_size=bad)
    with pytest.raises(FqError, match="windows_on_disk"):
        make_plan(lean, glm5, windows_on_disk=0)


def hot16_recipe():
    """The demo recipe with its hot stage widened to the 16 hottest experts (a 64-expert model)."""
    doc = json.loads((RECIPES / "demo.json").read_text().replace("k2.r1.h2", "k2.r1.h16"))
    for n in doc["nodes"]:
        if n["name"] == "k2.r1.h16":
            n["experts"] = {"hot": 16}
    return parse_recipe(doc, "demo.json with hot 16")


def test_hot_stage_fragments_only_where_hot_experts_are():
    c, i, s = synthetic_checkpoint("deepseek", hidden=256, inter=128, n_experts=64, n_layers=5, first_dense=1,
                                   vocab=1024, shard_bytes=3_000_000)
    src = parse_source(c, i, s, origin="demo-like")
    demo = hot16_recipe()
    with pytest.raises(FqError, match="b3, b3.up have no K per unit or experts yet"):  # its budgeted base, before resolve_budgets
        make_plan(demo, src, usage=parse_usage({"format": "fq-expert-usage/1",
                                                 "layers": {str(l): [1.0] * 64 for l in src.moe_layers}}))
    demo = resolve_budgets(demo, src, None)  # provisional: every unit at the budget's nearest K
    with pytest.raises(FqError, match="16 hottest.*--usage"):
        make_plan(demo, src)
    # the 16 hottest experts of every layer sit in experts 0..15 except one at 40
    counts = {str(l): [100.0 if (e < 15 or e == 40) else 1.0 for e in range(64)] for l in src.moe_layers}
    usage = parse_usage({"format": "fq-expert-usage/1", "layers": counts})
    plan = make_plan(demo, src, usage=usage, block_size=16)
    hot = [f for f in plan.fragments() if f.node == "k2.r1.h16"]
    assert {(f.block.first_expert, f.experts) for f in hot} == {(0, tuple(range(15))), (32, (40,))}
    assert len(hot) == 2 * 4
    assert plan.identity["usage_sha256"] == usage.sha256
    assert plan.selections["k2"] is None and plan.selections["k2.r1.h16"][1] == tuple(range(15)) + (40,)
    replay(plan, src)


def test_plan_file_round_trip_deterministic_and_tamper_evident(tmp_path, glm5, lean):
    plan = make_plan(lean, glm5, windows="3-30,31-77")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    da = write_plan(a, plan)
    db = write_plan(b, make_plan(lean, glm5, windows="3-30,31-77"))
    assert da == db and a.read_bytes() == b.read_bytes()
    back = load_plan(a)
    assert back.to_json() == plan.to_json()
    assert back.identity_sha256 == plan.identity_sha256
    assert [f.experts for f in back.fragments()] == [f.experts for f in plan.fragments()]
    doc = canonical.load(a)
    doc["windows"][0]["retire"] = []
    b.write_bytes(canonical.dumps(doc))
    with pytest.raises(FqError, match="plan_sha256 .* does not match the content"):
        load_plan(b)


def test_run_identity(glm5, lean, dag):
    ident = lambda **kw: make_plan(kw.pop("recipe", lean), glm5, **kw).identity_sha256  # noqa: E731
    base = ident(windows="3-30,31-77")
    assert base == ident(windows="3-30 31-77")  # same partition, other spelling
    assert base != ident(windows="3-31,32-77")
    assert base != ident(windows="3-30,31-77", block_size=16)
    assert base != ident(windows="3-30,31-77", recipe=dag)
    plan = make_plan(lean, glm5, windows="3-30,31-77")
    assert plan.identity["recipe_sha256"] == lean.sha256 and plan.identity["source_revision"] == glm5.revision
    assert plan.identity["block_size"] == 32 and plan.identity["windows"][1][0] == 31


def test_planning_is_pure(monkeypatch, glm5, dag):
    """make_plan reads no file and writes none: it works on the data it is given."""
    def forbidden(*a, **k):
        raise AssertionError("file I/O inside the planner")

    monkeypatch.setattr(builtins, "open", forbidden)
    monkeypatch.setattr(io, "open", forbidden)
    monkeypatch.setattr(os, "open", forbidden)
    monkeypatch.setattr(os, "stat", forbidden)
    plan = make_plan(dag, glm5, disk_budget=int(1.6 * TB))
    assert plan.recipe["passes"] == 9


def test_fq_plan_cli(tmp_path, capsys):
    src = write_synthetic(tmp_path / "glm5", *glm5_like())
    out = tmp_path / "campaign" / "plan.json"
    rc = main(["plan", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(src), "--sizes", str(src / "sizes.json"),
               "--disk-budget", "1.6TB", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.exists()
    assert "7 passes emitting 12 bpw" in text and "skeleton-only" in text and "straddle" in text
    assert f"wrote {out}" in text
    assert load_plan(out).bytes["peak_local"] <= 1.6 * TB
    rc = main(["plan", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(src), "--sizes", str(src / "sizes.json"),
               "--windows", "3-12,14-78"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("fq plan: windows '3-12,14-78': layer(s) 13 in no window")
    assert "78 not encoded" in err and err.count("\n") == 1
    rc = main(["plan", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(src), "--sizes", str(src / "sizes.json"),
               "--disk-budget", "lots"])
    assert rc == 2 and "--disk-budget: 'lots' is not a byte quantity" in capsys.readouterr().err
    assert json.loads(out.read_text())["format"] == "fq-plan/1"


def test_whole_model_bases_plan_one_linear_job_per_class_and_layer(glm5):
    """Two bases naming attention at K4 share one linear node; the plan lists what each job encodes (MLA's five
    attention linears per layer, the shared expert of each MoE layer, the dense MLPs, lm_head), the MTP layer's
    linears stay as published, and each base's entry names the nodes its directory takes."""
    r = parse_recipe({"format": "fq-cartridge/2", "name": "wm", "nodes": [
        {"name": "k2", "kind": "base", "K": 2, "codebook": "mul1",
         "skeleton": {"attention": 4, "shared": 4, "dense": 4, "head": 6}},
        {"name": "k3", "kind": "base", "K": 3, "codebook": "mul1", "skeleton": {"attention": 4}}],
        "products": [{"name": "k2", "chain": ["k2"]}, {"name": "k3", "chain": ["k3"]}]}, "wm.json")
    plan = make_plan(r, glm5)
    nodes = {n["name"]: n for n in plan.linears}
    assert sorted(nodes) == ["attention-K4-mul1", "dense-K4-mul1", "head-K6-mul1", "shared-K4-mul1"]
    att = nodes["attention-K4-mul1"]["layers"]
    assert sorted(att, key=int) == [str(L) for L in range(78)]
    assert [n.rsplit(".", 1)[-1] for n in att["5"]] == ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj",
                                                         "q_b_proj"]
    assert sorted(nodes["dense-K4-mul1"]["layers"], key=int) == ["0", "1", "2"]
    assert sorted(nodes["shared-K4-mul1"]["layers"], key=int) == [str(L) for L in range(3, 78)]
    assert nodes["head-K6-mul1"]["layers"] == {"head": ["lm_head"]}
    assert len(plan.linear_jobs()) == 78 + 3 + 75 + 1
    bases = {n["name"]: n for n in plan.to_json()["nodes"]}
    assert bases["k3"]["skeleton"] == {"attention": "attention-K4-mul1"}
    assert bases["k2"]["skeleton"]["head"] == "head-K6-mul1"
    assert load_plan_json(plan).linears == plan.linears
    # bits over the experts and over the whole model, side by side
    from fq.planning.plan import plan_table

    by = {p["name"]: p for p in plan.products}
    assert by["k2"]["bpw"] == 2 and 2 < by["k2"]["model_bpw"] < 2.1 and by["k2"]["head_bits"] == 6
    assert by["k3"]["bpw"] == 3 and by["k3"]["model_bpw"] > 3 and by["k3"]["head_bits"] == 16
    text = plan_table(plan)
    assert "bpw experts" in text and "bpw model" in text and "attention-K4-mul1 (78)" in text


def load_plan_json(plan):
    from fq.planning.plan import CampaignPlan

    return CampaignPlan.from_json(canonical.loads(canonical.dumps(plan.to_json())))


def test_a_class_the_source_lacks_is_refused_by_name():
    cfg, index, sizes = synthetic_checkpoint("deepseek", hidden=64, inter=32, n_experts=4, n_layers=2, first_dense=0,
                                             vocab=128, dense_inter=64, shard_bytes=10**6, model_type="deepseek_v3",
                                             extra_config={"architectures": ["DeepseekV3ForCausalLM"],
                                                           "n_shared_experts": 1, "tie_word_embeddings": False})
    source = parse_source(cfg, index, sizes, origin="synthetic")  # every layer MoE: no dense MLP
    r = parse_recipe({"format": "fq-cartridge/2", "name": "wm", "nodes": [
        {"name": "k2", "kind": "base", "K": 2, "codebook": "mul1", "skeleton": {"dense": 4}}],
        "products": [{"name": "k2", "chain": ["k2"]}]}, "wm.json")
    with pytest.raises(FqError, match="has no dense linears.*skeleton.dense to 16"):
        make_plan(r, source)


def test_a_base_sharing_another_bases_experts_is_planned_with_its_owner(glm5, lean):
    """Bases of one K and codebook: the plan names the owner of the shared encoding on the sharing base's node entry
    (its digest binds it), still lists the sharing base's fragments (it publishes them: a copy, not an encode) and
    counts the encode once in passes and encoded bpw; a recipe without such a pair plans as it did (no new field)."""
    doc = json.loads((RECIPES / "glm52-k2k3-lean.json").read_text())
    doc["nodes"].append({"name": "k2.w4", "kind": "base", "K": 2, "codebook": doc["nodes"][0]["codebook"],
                         "skeleton": {"attention": 4}})
    doc["products"].append({"name": "k2.w4", "chain": ["k2.w4"]})
    r = parse_recipe(doc, "lean+w4")
    plan = make_plan(r, glm5, block_size=32)
    nodes = {n["name"]: n for n in plan.nodes}
    assert nodes["k2.w4"]["experts_from"] == "k2" and plan.experts_from("k2.w4") == "k2"
    assert plan.experts_from("k2") is None and "experts_from" not in nodes["k2"]
    assert nodes["k2.w4"]["digest"] == r.node_digest("k2.w4") != r.node_digest("k2")
    frags = plan.fragments()
    assert len([f for f in frags if f.node == "k2.w4"]) == len([f for f in frags if f.node == "k2"]) == len(plan.blocks)
    assert (plan.recipe["passes"], plan.recipe["encoded_bpw"]) == (lean.passes, lean.encoded_bpw)
    assert "k2.w4 takes k2's" in plan_table(plan)
    old = make_plan(lean, glm5, block_size=32)
    assert not any("experts_from" in n for n in old.nodes) and "copied from another base" not in plan_table(old)


# fq plan, fq price and the workflow's load_campaign, each in bounded memory (a 1 GiB address-space cap): a count that
# reached a list per (layer, expert) ends in a MemoryError here instead of exhausting the machine (uncapped, it grew
# without bound). One line per call: [exit status, stderr] of the CLI, [2, message] of load_campaign's FqError.
_CAPPED = r"""
import contextlib, io, json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from fq.cli import main
from fq.errors import FqError
from fq.workflow.campaign import load_campaign
for kind, arg in json.loads(sys.stdin.read()):
    err = io.StringIO()
    if kind == "cli":
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            rc = main(arg)
        print(json.dumps([rc, err.getvalue()]))
    else:
        try:
            load_campaign(arg)
            print(json.dumps([0, ""]))
        except FqError as e:
            print(json.dumps([2, str(e)]))
"""


def _capped(calls: list) -> list:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _CAPPED], input=json.dumps(calls), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    return [json.loads(line) for line in run.stdout.splitlines()]


def test_hostile_configs_and_shards_are_refused_by_plan_price_and_the_workflow(tmp_path):
    """Issue 42: a config claiming 10^9 experts or layers (anyone who publishes a checkpoint writes its config) and a
    shard whose header claims 2^40 bytes are refused by fq plan, fq price and the workflow's DAG (load_campaign: what
    `snakemake -n` runs) in one line naming the file and the field, at once and in bounded memory."""
    from fq.model.source_synth import write_sparse_shards

    c, i, s = synthetic_checkpoint("deepseek", hidden=256, inter=128, n_experts=8, n_layers=2, vocab=1024,
                                   shard_bytes=2_000_000)
    recipe = str(RECIPES / "glm52-k2k3-lean.json")
    calls, wants = [], []
    for field, claim in (("n_routed_experts", "1000000000 routed experts per MoE layer, but "),
                         ("num_hidden_layers", "1000000000 decoder layers, but ")):
        src = write_synthetic(tmp_path / field, {**c, field: 10**9}, i, s)
        write_sparse_shards(src, c, i)
        calls += [["cli", [command, recipe, "--model", str(src)]] for command in ("plan", "price")]
        wants += [f"fq {command}: {src}/config.json: field '{field}': {claim}" for command in ("plan", "price")]
        calls.append(["campaign", {"campaign": "t", "out": str(tmp_path / "out"), "recipe": recipe,
                                   "source": {"kind": "local", "path": str(src)}}])
        wants.append(f"{src}/config.json: field '{field}': {claim}")
    src = write_synthetic(tmp_path / "header", c, i, s)
    write_sparse_shards(src, c, i)
    shard = sorted(s)[2]
    with open(src / shard, "r+b") as fh:
        fh.write((2**40).to_bytes(8, "little"))
    calls += [["cli", [command, recipe, "--model", str(src)]] for command in ("plan", "price")]
    wants += [f"fq {command}: {src / shard}: header length 1099511627776 does not fit in the file"
              for command in ("plan", "price")]
    calls.append(["campaign", {"campaign": "t", "out": str(tmp_path / "out"), "recipe": recipe,
                               "source": {"kind": "local", "path": str(src)}}])
    wants.append(f"{src / shard}: header length 1099511627776 does not fit in the file")
    for (rc, err), want in zip(_capped(calls), wants, strict=True):
        assert rc == 2 and err.startswith(want) and err.count("\n") <= 1, (want, err)


def test_the_workflow_refuses_a_hostile_config_in_one_line(tmp_path):
    """`snakemake -n` on a source whose config claims 10^9 experts: fq's one line on stderr and a failing exit, not a
    traceback through the Snakefile (rules/common.smk plans the campaign at parse time)."""
    import subprocess
    import sys

    from fq.model.source_synth import write_sparse_shards

    c, i, s = synthetic_checkpoint("deepseek", hidden=256, inter=128, n_experts=8, n_layers=2, vocab=1024,
                                   shard_bytes=2_000_000)
    src = write_synthetic(tmp_path / "src", {**c, "n_routed_experts": 10**9}, i, s)
    write_sparse_shards(src, c, i)
    cfg = tmp_path / "config.yaml"
    cfg.write_text(json.dumps({"campaign": "t", "out": str(tmp_path / "out"),
                               "recipe": str(RECIPES / "glm52-k2k3-lean.json"),
                               "source": {"kind": "local", "path": str(src)}}))
    p = subprocess.run([sys.executable, "-m", "snakemake", "-n", "--configfile", str(cfg)], cwd=RECIPES.parent,
                       capture_output=True, text=True)
    assert p.returncode != 0
    assert f"fq: {src}/config.json: field 'n_routed_experts': 1000000000 routed experts" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and 'File "' not in p.stderr, p.stderr
