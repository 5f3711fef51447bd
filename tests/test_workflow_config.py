"""Config handling of the workflow that needs no Snakemake run."""
import pytest

from fq.errors import FqError
from fq.workflow.campaign import load_campaign, normalize_config


def test_config_strings_from_the_command_line_become_integers():
    cfg = {"encode": {"device": "cuda", "devices": ["0", "3"], "threads": "2", "seed": "7"}, "block_size": "8",
           "windows_on_disk": "1", "assembly": {"version": "4", "expires": "2030-01-01T00:00:00Z"}}
    normalize_config(cfg)
    assert cfg["encode"] == {"device": "cuda", "devices": [0, 3], "threads": 2, "seed": 7}
    assert cfg["block_size"] == 8 and cfg["windows_on_disk"] == 1 and cfg["assembly"]["version"] == 4


def _cfg(**over):
    cfg = {"campaign": "t", "out": "o", "source": {"kind": "demo"}, "recipe": "recipes/demo.json", "block_size": 4,
           "windows": "1,2", "windows_on_disk": 1, "encode": {"device": "cpu"}, "compare_native": True,
           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}
    cfg.update(over)
    return cfg


def test_demo_campaign_plan_and_native_jobs():
    c = load_campaign(_cfg())
    assert c.source.moe_layers == (1, 2) or list(c.source.moe_layers) == [1, 2]
    # the budgeted base b3 has no allocation in this campaign yet: the allocation is its only target, and the plan
    # (parsed for the DAG's measurement phase) resolves b3 provisionally, every unit at K3
    assert c.allocation_pending and c.alloc.measures and c.alloc.budgets == [3.0]
    assert c.recipe.node("b3").K == 3 and dict(c.recipe.node("b3").skeleton) == {
        "attention": 3, "shared": 3, "dense": 3, "head": 3}
    # k2, k3, k2.w4, k3.w4, b3, k2.r1 over 2 layers x 2 blocks; k2.r1.h2 on hot experts; b3.up provisionally on
    # the first 2 experts of each layer (+0.5 bits buy K2 on a quarter of the experts' weights)
    assert c.recipe.node("b3.up").experts.layer_map() == {1: (0, 1), 2: (0, 1)}
    assert len(c.fragments) == 6 * 4 + 2 + 2
    # the whole-model bases publish the experts of the experts-only bases of their K (Node.experts_from): copied
    # by share jobs, never encoded again (b3 at its provisional K3 too: k3's experts)
    assert {f.node for f in c.shared_fragments} == {"k2.w4", "k3.w4", "b3"} and len(c.shared_fragments) == 3 * 4
    assert len(c.encoded_fragments) == 3 * 4 + 2 + 2 and c.share_spec("k2.w4", 1, 0).owner == "k2"
    assert c.shard_consumers_window(0) == [p for p in c.shard_consumers_window(0) if "/k2.w4/" not in p]
    # attention, shared, dense, head: K4 shared by k2.w4 and k3.w4, K3 b3's
    assert len(c.linears.jobs) == 2 * (3 + 2 + 1 + 1)
    # k2.r1 (3 bits) is compared with the k3 base (experts-only, as k2.r1: not k3.w4, whose linears are K4); k2.r1.h2
    # (5 bits) needs a native K5 encode of its experts
    assert c.compare.native_bases == {"k2.r1": "k3"} and list(c.compare.native_jobs) == [(5, "mul1")]
    assert c.skeleton_shards == ("model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                                 "model-00004-of-00004.safetensors")
    assert c.plan.straddling == {"model-00003-of-00004.safetensors": (0, 1)}


def test_wrong_windows_and_missing_local_source_are_refused(tmp_path):
    with pytest.raises(FqError, match=r"layer\(s\) 2 in no window"):
        load_campaign(_cfg(windows="1"))
    with pytest.raises(FqError, match="not a directory|config.json"):
        load_campaign(_cfg(source={"kind": "local", "path": str(tmp_path / "nope")}))


def test_layer_rules_cover_every_node_and_layer_once_with_its_blocks():
    """per_job: layer: each rule serves nodes x layers with one block set (outputs are patterns), exactly."""
    c = load_campaign(_cfg())
    rules = c.layer_rules
    assert [r.name for r in rules] == ["encode_layer", "encode_layer_2", "encode_layer_3", "encode_layer_4"]
    # the whole-model bases encode no layer: they publish the experts of k2 and k3 (share jobs, one per block)
    assert rules[0].nodes == ("k2", "k3", "k2.r1") and rules[0].layers == (1, 2) and rules[0].blocks == (0, 1)
    served = [(n, l, r.blocks) for r in rules for n in r.nodes for l in r.layers]
    want = {(n, l): tuple(c.block_index(f.block) for f in c.layer_fragments(n, l))
            for n, l in {(f.node, f.block.layer) for f in c.encoded_fragments}}
    assert len(served) == len(want) and {(n, l): b for n, l, b in served} == want
    assert c.per_job == "block" and load_campaign(_cfg(encode={"device": "cpu", "per_job": "layer"})).per_job == "layer"


def test_eval_config():
    """eval: an eval job (fq eval after finalize) only where the source is on disk; the demo brings its own text."""
    c = load_campaign(_cfg())
    assert c.evals.settings is None and c.evals.files() == []
    c = load_campaign(_cfg(eval={"text": None, "tokens": 1024, "seq_len": 128}))
    assert c.evals.settings == {"text": None, "tokens": 1024, "seq_len": 128}
    assert c.evals.text == "o/demo-text/heldout.txt" and c.evals.files() == ["o/eval/eval.json", "o/eval/eval.tsv"]
    cfg = _cfg(eval={"tokens": "512"})
    normalize_config(cfg)
    assert cfg["eval"]["tokens"] == 512
    c = load_campaign(_cfg(eval={"text": None}))
    c.config["source"] = {"kind": "local", "path": "x"}
    with pytest.raises(FqError, match="eval.text"):
        c.evals.settings
    c.config["source"] = {"kind": "hub", "repo": "a/b", "revision": "0" * 40}
    with pytest.raises(FqError, match="local disk"):
        c.evals.settings
