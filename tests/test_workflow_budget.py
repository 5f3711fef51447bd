"""A campaign with a budgeted base and a budgeted stage, run for real (Snakemake as a subprocess, twice: the first
run measures the allocation and stops there, the second plans from it and publishes) on the embedded demo model.

Weight-only and a small sensitivity measurement (4 x 64 tokens, one label sample) keep it short; what it checks is
the DAG's two phases, the allocation's byte-identical rerun, and that what the allocation chose is what is encoded,
attested, published in quantization_config and verified."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fq.core import canonical, kbits
from fq.provenance.fragments import describe

from tests.test_workflow import REPO, campaign, smk, write_config

pytestmark = pytest.mark.slow

RECIPE = {
    "format": "fq-cartridge/2", "name": "budget", "description": "a budgeted base and a budgeted stage on it",
    "nodes": [
        {"name": "b", "kind": "base", "bits": 3, "codebook": "mul1"},
        {"name": "b.up", "kind": "stage", "parent": "b", "K": 3, "codebook": "mul1", "bits": "+0.4"},
    ],
    "products": [{"name": "b", "chain": ["b"]}, {"name": "b.up", "chain": ["b", "b.up"]}],
}
# the candidates: the integer and half-integer K around the budget (c(K) encodes at K2..4 only; K1 and K1.5, the
# slowest to encode on the CPU, left out); the allocation gives some units a half-integer K, which goes through the
# campaign to exllamav3's config
SMALL = {"rows": 4, "columns": 64, "samples": 1, "ks": [2, 2.5, 3, 3.5, 4]}
# No hot stage reads the expert usage here (the budgeted stage buys its experts by measured gain per byte): the usage
# recorded with the demo model (config usage:) instead of the usage job, which test_workflow.py runs and checks
USAGE = str(REPO / "fq" / "data" / "demo" / "usage.json")
# The eval job on the demo's own held-out split (the module campaigns of test_workflow.py and
# test_calibration_workflow.py run on demokit's cut of the demo): 4 windows of 128
EVAL = {"text": None, "tokens": 512, "seq_len": 128}


@pytest.fixture(scope="module")
def phases(tmp_path_factory):
    d = tmp_path_factory.mktemp("budget")
    # one block per layer: fewer jobs
    write_config(d, RECIPE, allocation=SMALL, block_size=8, windows="1-2", usage=USAGE, eval=EVAL)
    first = smk(d)
    out = d / "campaign"
    snapshot = {name: (out / "allocation" / name).read_bytes() for name in ("sensitivity.json", "allocation.json")}
    fragments_after_first = sorted((out / "fragments").rglob("*")) if (out / "fragments").exists() else []
    # solved again from the measurement, by the allocate job's own code in this process: the same bytes (that the
    # measurement itself is byte-identical when it runs again is test_allocation.py's, in-process at a smaller size:
    # the same code as the sensitivity job)
    from fq.workflow.allocation import allocate_job

    again = d / "allocation-again.json"
    allocate_job(str(out / "allocation" / "sensitivity.json"), campaign(d).alloc.budgets, str(again))
    rerun = {"sensitivity.json": (out / "allocation" / "sensitivity.json").read_bytes(),
             "allocation.json": again.read_bytes()}
    fragments_after_rerun = sorted((out / "fragments").rglob("*")) if (out / "fragments").exists() else []
    second = smk(d)  # the second phase: planned from the allocation, encoded and published
    return (d, first.stdout + first.stderr, snapshot, rerun, fragments_after_first + fragments_after_rerun,
            second.stdout + second.stderr)


def test_the_first_run_measures_the_allocation_and_nothing_else(phases):
    d, first, snapshot, rerun, fragments, _ = phases
    assert fragments == [] and "run snakemake again to encode the budgeted bases" in first
    doc = json.loads(snapshot["allocation.json"])
    assert doc["format"] == "fq-allocation/1" and [a["budget_bits"] for a in doc["allocations"]] == [3]
    assert doc["calibration"]["rows"] == 4 and doc["experts"]  # each expert's own measurement, for b.up
    assert rerun == snapshot  # byte-identical on rerun


def test_the_second_run_encodes_what_the_allocation_chose_and_publishes_it_verified(phases):
    d, *_ = phases
    c = campaign(d)
    out = d / "campaign"
    alloc = canonical.load(out / "allocation" / "allocation.json")
    ks = alloc["allocations"][0]["ks"]
    assert any(isinstance(k, float) for k in ks.values())  # a half-integer unit goes through the campaign
    b = c.recipe.node("b")
    assert not c.allocation_pending and c.plan.identity["allocation_sha256"]
    # every fragment of b holds, per projection, the K the allocation gave its layer's unit; its attestation says so
    for f in c.fragments:
        if f.node != "b" or b.experts_from:
            continue
        path = Path(c.fragment("b", f.block))
        with open(path, "rb") as fh:
            info = describe(fh, path.name, str(path))
        want = kbits.fragment({"gate": ks[f"L{f.block.layer}.routed_gate_up"], "up": ks[f"L{f.block.layer}.routed_gate_up"],
                               "down": ks[f"L{f.block.layer}.routed_down"]})
        assert kbits.fragment(info.meta["K"]) == want
    # the stage encodes the experts the plan recorded, chosen by measured gain per byte
    chosen = c.recipe.node("b.up").experts.layer_map()
    assert chosen and {f.node for f in c.fragments} == {"b", "b.up"}
    assert {(f.block.layer, e) for f in c.fragments if f.node == "b.up" for e in f.experts} == \
        {(l, e) for l, es in chosen.items() for e in es}
    # published: quantization_config states the allocation; fq verify accepts the publication
    cfg = canonical.load(out / "published" / "base" / "b" / "config.json")["quantization_config"]
    assert kbits.node(cfg["expert_bits"]) == b.K and cfg["head_bits"] == ks["head"]
    for layer in c.source.moe_layers:
        lin = cfg["linear_bits"]["shared"]
        assert (lin if isinstance(lin, int) else lin[str(layer)]) == ks[f"L{layer}.shared"]
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(out / "published"), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (out / "report" / "allocation.png").stat().st_size > 0


def test_plan_and_price_show_the_allocation_before_a_gpu_is_rented(phases, capsys):
    from fq.cli import main  # the commands in this process (their exit code, their output): no torch start-up each

    d, *_ = phases
    out = d / "campaign"
    args = ["--model", str(out / "demo-model"), "--allocation", str(out / "allocation" / "allocation.json")]
    capsys.readouterr()
    assert main(["plan", str(d / "recipe.json"), *args]) == 0, capsys.readouterr().err
    plan = capsys.readouterr().out
    assert "budgeted base b: 3 bits; K per unit" in plan and "stage b.up: +0.4 bits buy" in plan
    assert main(["price", str(d / "recipe.json"), *args]) == 0, capsys.readouterr().err
    price = capsys.readouterr().out
    assert "sensitivity (budgeted bases' allocation" in price
    ks = canonical.load(out / "allocation" / "allocation.json")["allocations"][0]["ks"].values()
    # a half-integer K is priced with its search on the host's cores, and says so (no CUDA kernel for it yet)
    assert ("half-integer K (1.5, 2.5, 3.5): the next integer K's cost plus their search on the host's" in price) == \
        any(isinstance(k, float) for k in ks)


def test_eval_measures_the_budgeted_products_on_the_trained_demo(phases):
    """The eval job after finalize, on the demo model itself and its held-out split: each product's KL to the source,
    the stage closer than its base; quantizing the trained model costs perplexity (the source's is below the base's:
    on a model cut from it, as test_workflow.py's campaign is, off its trained optimum, the base's noise can lower it
    by a hair)."""
    d, *_ = phases
    doc = canonical.load(d / "campaign" / "eval" / "eval.json")
    assert doc["text"]["file"] == "heldout.txt" and doc["text"]["positions"] == 4 * 127
    kl = {p: r["kl"] for p, r in doc["products"].items()}
    assert set(kl) == {"b", "b.up"} and kl["b"] > kl["b.up"] > 0
    assert doc["source"]["ppl"] < doc["products"]["b"]["ppl"]
