"""benchmarks/allocation_exl3.py's ``report`` (issue 41): how fq's allocations are read against exllamav3's curves and
fq's hand-made recipes at equal bytes. The docs' ratios come from it, so its arithmetic is checked here on made-up
rows whose answers are known: log-KL linear in bytes between neighbouring conversions, the lower of exllamav3's two
curves as "best", nothing read past a curve's end (beyond 1%), and the recipes' curve (``check --base``) reported
beside exllamav3's, never as part of its best."""
from __future__ import annotations

import importlib.util
import json
import math
from argparse import Namespace
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "allocation_exl3.py"


@pytest.fixture(scope="module")
def alloc():
    spec = importlib.util.spec_from_file_location("allocation_exl3", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def row(name, kind, nbytes, kl, windows=(1.0, 1.0, 1.0, 1.0)):
    """A measure.json row: per-window means ``kl * w`` (their mean is ``kl`` when the windows average 1)."""
    w = [kl * x for x in windows]
    m = sum(w) / len(w)
    return {"name": name, "kind": kind, "bytes": nbytes, "bits": 3.0 if kind == "fq" else None,
            "texts": {"t": {"kl": m, "se_win": 0.0, "se_pos": 0.0, "windows": w}}}


def report(alloc, tmp_path, rows):
    (tmp_path / "m.json").write_text(json.dumps({"texts": {"t": {"positions": 1024, "windows": 4}}, "rows": rows}))
    assert alloc.report(Namespace(measure=[str(tmp_path / "m.json")], json=str(tmp_path / "r.json"), plot=None)) == 0
    return {e["name"]: e for e in json.loads((tmp_path / "r.json").read_text())["comparison"]["t"]}


def test_fq_is_read_against_the_lower_curve_log_linearly_and_never_against_its_own_recipes(alloc, tmp_path):
    rows = [row("b lo", "b", 1000, 0.04), row("b hi", "b", 2000, 0.01),
            row("hq lo", "hq", 1200, 0.02), row("hq hi", "hq", 2200, 0.005),
            # fq's own recipes are better than exllamav3 here: still not "best"
            row("w lo", "base", 1000, 0.001), row("w hi", "base", 2000, 0.0005),
            row("fq mid", "fq", 1500, 0.008, windows=(0.5, 1.5, 1.0, 1.0)),
            row("fq past", "fq", 2500, 0.001)]
    out = report(alloc, tmp_path, rows)
    mid = out["fq mid"]
    assert mid["b"]["kl"] == pytest.approx(0.02)  # halfway in bytes: the geometric mean of 0.04 and 0.01
    want_hq = math.exp(0.7 * math.log(0.02) + 0.3 * math.log(0.005))
    assert mid["hq"]["kl"] == pytest.approx(want_hq)
    assert mid["best"] == "hq" and mid["ratio_best"] == pytest.approx(0.008 / want_hq)
    assert mid["goal_met"] is (0.008 / want_hq <= 0.8)
    assert mid["base"]["ratio"] == pytest.approx(0.008 / math.sqrt(0.001 * 0.0005))
    # paired against the nearest conversion of each curve by bytes
    assert mid["b_nearest"]["name"] in ("b lo", "b hi") and mid["hq_nearest"]["name"] == "hq lo"
    assert mid["hq_nearest"]["paired_diff"] == pytest.approx(0.008 - 0.02)
    # 2500 bytes is past every curve by more than 1%: no ratio
    past = out["fq past"]
    assert past["b"] is None and past["hq"] is None and past["base"] is None and "ratio_best" not in past


def test_a_size_just_past_a_curves_end_takes_that_end(alloc, tmp_path):
    rows = [row("b lo", "b", 1000, 0.04), row("b hi", "b", 2000, 0.01), row("fq", "fq", 2015, 0.005)]
    e = report(alloc, tmp_path, rows)["fq"]
    assert e["b"]["kl"] == pytest.approx(0.01) and e["b"]["from"] == {"b hi": 1.0}
    assert e["ratio_best"] == pytest.approx(0.5) and e["goal_met"] is True


@pytest.mark.parametrize("weighting", ["affinity-down", "affinity"])
def test_weighted_expert_hessians_with_a_flat_router_are_the_all_experts_capture(alloc, tmp_path, weighting):
    """``build --weighting``: a router's scores move the experts' Hessians; with every router logit equal (the same score for every token) the weighted Hessians are
    the all-experts capture's (fq.allocation.measure.hessians), name for name; ``affinity-down`` weights the down
    projections only, ``affinity`` also gives each expert its own gate/up Hessian; the router's declared score is
    checked against what it applied."""
    import torch
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

    from fq.allocation.measure import hessians

    torch.manual_seed(0)
    cfg = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
                        head_dim=16, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
                        topk_group=1, max_position_embeddings=64)
    model = Glm4MoeForCausalLM(cfg).eval()
    model.save_pretrained(tmp_path)
    windows = torch.randint(0, 64, (3, 16), generator=torch.Generator().manual_seed(1))
    routed = alloc.weighted_expert_hessians(model, windows, tmp_path, weighting)  # a router with opinions
    routed_plain = hessians(model, windows, "cpu")
    n = "model.layers.1.mlp.experts.0.down_proj"
    assert (routed[n] - routed_plain[n]).abs().max() > 1e-3 * routed_plain[n].abs().max()
    with torch.no_grad():
        model.model.layers[1].mlp.gate.weight.zero_()
    weighted = alloc.weighted_expert_hessians(model, windows, tmp_path, weighting)
    plain = hessians(model, windows, "cpu")
    want = {n for n in plain if ".experts." in n and (weighting == "affinity" or n.endswith("down_proj"))}
    assert set(weighted) == want and len(want) == (12 if weighting == "affinity" else 4)
    for n, H in weighted.items():
        torch.testing.assert_close(H, plain[n], rtol=1e-10, atol=1e-12)


def test_resolve_solves_an_earlier_measurement_within_the_candidates_given(alloc):
    """``build --from-build --resolve``: fq's pooled solver on the earlier build's options, K only from ``--ks``."""
    n = 4096 * 2  # two units of 4096 weights; bytes = weights x K / 8
    options = {u: {K: (0.0, int(4096 * K / 8)) for K in (1, 1.5, 2, 3, 4)} for u in ("a", "b")}
    parts = {"a": {1: (0.5, 0.0), 1.5: (0.2, 0.0), 2: (0.1, 0.0), 3: (0.03, 0.0), 4: (0.01, 0.0)},
             "b": {1: (0.05, 0.0), 1.5: (0.02, 0.0), 2: (0.01, 0.0), 3: (0.003, 0.0), 4: (0.001, 0.0)}}
    free, _ = alloc.resolve(options, {"parts": parts}, n, [1, 1.5, 2, 3, 4], [2.5], 1)
    assert free[("pooled", 2.5)].ks == {"a": 3, "b": 2}  # the sensitive unit gets the bits
    tight, _ = alloc.resolve(options, {"parts": parts}, n, [1, 1.5, 2, 3, 4], [1.75], 1)
    assert tight[("pooled", 1.75)].ks == {"a": 2, "b": 1.5}
    from fq.errors import FqError

    with pytest.raises(FqError, match="below the smallest allocation"):  # K2 is the least of these candidates
        alloc.resolve(options, {"parts": parts}, n, [2, 3, 4], [1.75], 1)
