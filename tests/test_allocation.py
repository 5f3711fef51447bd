"""Allocation by measured sensitivity (issue 41): units under exllamav3's rules, the LDLQ error model, the Fisher
measurement on the trained demo model (against the exact second-order KL where that is computable), and the
knapsack solver against brute force."""
from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from fq.allocation import error_model as em
from fq.allocation import document, inject, sensitivity, solve, units
from fq.errors import FqError


# -- units ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name,unit", [
    ("model.layers.0.self_attn.q_proj", "L0.attention"),
    ("model.layers.3.self_attn.kv_b_proj", "L3.attention"),
    ("model.layers.0.mlp.down_proj", "L0.dense"),
    ("model.layers.1.mlp.shared_experts.up_proj", "L1.shared"),
    ("model.layers.1.mlp.shared_expert.gate_proj", "L1.shared"),
    ("model.layers.2.mlp.experts.7.gate_proj", "L2.routed_gate_up"),
    ("model.layers.2.mlp.experts.7.up_proj", "L2.routed_gate_up"),
    ("model.layers.2.mlp.experts.0.down_proj", "L2.routed_down"),
    ("lm_head", "head"),
])
def test_unit_of(name, unit):
    assert units.unit_of(name).name == unit


def test_units_one_k_per_projection_of_all_experts():
    names = [f"model.layers.1.mlp.experts.{e}.{p}" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")]
    g = units.group_units(names + ["lm_head", "model.layers.1.self_attn.o_proj"])
    assert list(g) == ["L1.attention", "L1.routed_gate_up", "L1.routed_down", "head"]
    assert len(g["L1.routed_gate_up"]) == 8 and len(g["L1.routed_down"]) == 4
    with pytest.raises(ValueError, match="model.embed_tokens"):
        units.unit_of("model.embed_tokens")


# -- solver ----------------------------------------------------------------------------------------------------
def test_linear_bytes_is_exllamav3_storage():
    assert solve.linear_bytes(256, 128, 3) == 256 * 128 * 3 // 8 + 2 * (128 + 256) + 4
    assert solve.linear_bytes(256, 128, 1.5) == 256 * 128 * 3 // 16 + 2 * (128 + 256) + 4  # 24 words a tile
    assert solve.linear_bytes(100, 130, 2) == 128 * 256 * 2 // 8 + 2 * (256 + 128) + 4  # padded to 128
    assert solve.linear_bytes(100, 130, 16) == 100 * 130 * 2


def _random_problem(rng, n_units=5, ks=(1, 2, 3, 4, 5, 6)):
    opts = {}
    for u in range(n_units):
        size = rng.choice([1000, 3000, 8000])
        sens = rng.uniform(0.1, 10.0)
        opts[f"u{u}"] = {K: (sens * 4.0 ** -K * rng.uniform(0.7, 1.4), size * K // 8 + rng.randint(0, 50)) for K in ks}
    return opts


def _brute(opts, budget):
    names = list(opts)
    best = None
    for combo in itertools.product(*(sorted(opts[u]) for u in names)):
        b = sum(opts[u][K][1] for u, K in zip(names, combo))
        if b <= budget:
            kl = sum(opts[u][K][0] for u, K in zip(names, combo))
            best = kl if best is None or kl < best else best
    return best


@pytest.mark.parametrize("seed", range(12))
def test_solver_within_its_certificate_of_brute_force(seed):
    rng = random.Random(seed)
    opts = _random_problem(rng)
    lo = sum(min(b for _, b in o.values()) for o in opts.values())
    hi = sum(max(b for _, b in o.values()) for o in opts.values())
    budget = rng.randint(lo, hi)
    a = solve.solve(opts, budget, weights=1000)
    opt = _brute(opts, budget)
    assert a.bytes <= budget
    assert a.predicted_kl >= opt - 1e-12
    assert a.predicted_kl <= opt + a.gap_bound + 1e-12
    assert a.predicted_kl == pytest.approx(sum(opts[u][K][0] for u, K in a.ks.items()))
    assert solve.solve(opts, budget, weights=1000).ks == a.ks  # deterministic


def test_solver_spends_where_it_saves_most():
    # same sizes; unit b is 100x as sensitive: at a budget for one upgrade, b gets it
    opts = {u: {K: (s * 4.0 ** -K, 1000 * K) for K in (2, 3, 4)} for u, s in (("a", 1.0), ("b", 100.0))}
    a = solve.solve(opts, 5000, weights=4000)
    assert a.ks == {"a": 2, "b": 3} and a.bits == pytest.approx(10.0)
    assert solve.solve(opts, 10**9, weights=4000).ks == {"a": 4, "b": 4}


def test_budget_below_the_smallest_allocation_is_refused():
    opts = {"a": {2: (1.0, 2000), 3: (0.5, 3000)}, "b": {2: (1.0, 2000)}}
    with pytest.raises(FqError, match=r"budget .* below the smallest allocation.*every unit at its fewest bits"):
        solve.solve(opts, 3999, weights=8000)
    with pytest.raises(FqError, match="bits -1"):
        solve.budget_from_bits(-1, 100)


# -- error model ---------------------------------------------------------------------------------------------
def test_direction_is_ldlq_shaped_and_seeded():
    g = torch.Generator().manual_seed(0)
    X = torch.randn(2048, 256, generator=g, dtype=torch.float64) @ torch.randn(256, 256, generator=g,
                                                                                dtype=torch.float64)
    H = X.T @ X / 2048
    W = torch.randn(64, 256, generator=g, dtype=torch.float64)
    E = em.direction(W, H, seed=3)
    assert torch.equal(E, em.direction(W, H, seed=3)) and not torch.equal(E, em.direction(W, H, seed=4))
    # LDLQ puts the error where H is small: far less proxy error than an i.i.d. error of the same size
    iid = torch.randn(64, 256, generator=g, dtype=torch.float64) * W.pow(2).mean(1, keepdim=True).sqrt()
    iid *= E.norm() / iid.norm()
    assert em.proxy(E, W, H) < 0.5 * em.proxy(iid, W, H)
    # the same matrix encoded by fq's LDLQ encoder: its proxy error at K is d(K) times the direction's, within 2x
    from fq.codec.ldlq import encode_ldlq

    for K in (2, 4):
        rho = encode_ldlq(W.float(), H, K, "mul1", seed=1).proxy_err
        ratio = rho / (em.distortion(K, "mul1") * em.proxy(E, W, H))
        assert 0.5 < ratio < 2.0, (K, ratio)


def test_distortion_table():
    assert em.distortion(16, "mul1") == 0.0
    d = [em.distortion(K, "mcg") for K in range(1, 9)]
    assert all(3.0 < a / b < 4.5 for a, b in zip(d, d[1:]))  # about 6 dB a bit
    with pytest.raises(FqError, match="K 9"):
        em.distortion(9, "mul1")
    # the half-integer rates (mul1 only): about 3 dB from each integer neighbour
    assert em.candidate_ks("mul1") == (1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8)
    assert em.candidate_ks("mcg") == tuple(range(1, 9))
    for K in (1.5, 2.5, 3.5):
        lo, mid, hi = em.distortion(int(K), "mul1"), em.distortion(K, "mul1"), em.distortion(int(K) + 1, "mul1")
        assert 1.8 < lo / mid < 2.2 and 1.8 < mid / hi < 2.2
    with pytest.raises(FqError, match="K 1.5 codebook 'mcg'"):
        em.distortion(1.5, "mcg")


def test_half_k_distortion_is_the_encoders():
    """HALF_DISTORTION is what fq's weight-only encoder leaves of a Gaussian matrix at K 1.5 (the table's recipe, on
    a smaller matrix: within a few percent)."""
    from fq.codec.encoder import encode

    torch.manual_seed(0)
    got = encode(torch.randn(128, 256), 1.5, "mul1", seed=0).rel_mse
    assert got == pytest.approx(em.distortion(1.5, "mul1"), rel=0.05)


# -- the measurement, on the trained demo model ----------------------------------------------------------------
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from fq.model import demo_model
    from fq.runtime.evaluate import tokenize
    from fq.runtime.quality import token_windows

    d = tmp_path_factory.mktemp("demo")
    demo_model.write(d / "model", d / "text")
    model = AutoModelForCausalLM.from_pretrained(d / "model", dtype=torch.float32).eval()
    ids, _ = tokenize(d / "model", (d / "text" / "calibration.txt").read_text())
    return model, token_windows(ids, 64, 4 * 64), d


def test_measure_covers_every_linear_and_is_deterministic(demo):
    model, windows, _ = demo
    with torch.random.fork_rng():
        a = sensitivity.measure(model, windows[:2], samples=1, seed=5)
        b = sensitivity.measure(model, windows[:2], samples=1, seed=5)
    assert a.positions == 2 * 63
    names = set(a.linears)
    assert "lm_head" in names and "model.layers.1.mlp.experts.7.down_proj" in names
    assert "model.layers.1.mlp.shared_experts.gate_proj" in names and "model.layers.0.mlp.up_proj" in names
    assert not any(n.endswith(".gate") for n in names)  # routers stay
    assert {n: s.to_json() for n, s in a.linears.items()} == {n: s.to_json() for n, s in b.linears.items()}
    assert all(s.fisher > 0 for n, s in a.linears.items() if s.tokens)
    # an expert sees its routed tokens only: top-2 of 8, so each layer's experts see 2x the positions together
    routed = sum(s.tokens for n, s in a.linears.items() if ".layers.1.mlp.experts." in n and n.endswith("down_proj"))
    assert routed == 2 * 2 * 64
    assert not any(p.requires_grad for p in model.parameters())  # left as found


def test_quadratic_form_predicts_the_heads_kl(demo):
    """For the head the KL of a small error is exactly quadratic at the output: the Fisher estimate in that error's
    direction must match the measured KL(source || perturbed) on the same windows."""
    model, windows, _ = demo
    head = model.lm_head.weight
    g = torch.Generator().manual_seed(0)
    E = torch.randn(head.shape, generator=g) * head.detach().pow(2).mean().sqrt() * 0.02
    s = sensitivity.measure(model, windows, samples=8, seed=1, directions={"lm_head": [E]})
    predicted = s.linears["lm_head"].quad[0] / (2 * s.positions)
    with torch.no_grad():
        ref = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
        head += E
        try:
            q = torch.log_softmax(model(input_ids=windows).logits[:, :-1].double(), -1)
        finally:
            head -= E
    measured = float((ref.exp() * (ref - q)).sum(-1).mean())
    assert predicted == pytest.approx(measured, rel=0.35), (predicted, measured)
    assert math.isfinite(s.beta("lm_head")) and s.beta("lm_head") > 0


def test_injected_curve_fit():
    d = [em.distortion(K, "mul1") for K in (2, 4, 6)]
    a, b = inject.curve(d, [inject.at(0.03, 0.012, x) for x in d])  # both terms: recovered
    assert a == pytest.approx(0.03, rel=1e-9) and b == pytest.approx(0.012, rel=1e-9)
    a, b = inject.curve(d, [0.5 * x for x in d])  # purely second order (a unit no router reads)
    assert a == pytest.approx(0.5, rel=1e-9) and b == pytest.approx(0.0, abs=1e-12)
    a, b = inject.curve(d, [2.0 * math.sqrt(x) * (1.3 if i == 1 else 1.0) for i, x in enumerate(d)])
    assert a >= 0 and b > 0  # a negative second-order term is clipped, not fitted
    assert inject.curve(d, [0.0, 0.0, 0.0]) == (0.0, 0.0)
    # parts: the curve at every K, a measured K1 point as measured (split as the curve splits it)
    D = {K: em.distortion(K, "mul1") for K in range(1, 9)}
    pts = {K: inject.at(0.03, 0.012, D[K]) for K in (2, 4, 6)}
    pts[1] = 3 * inject.at(0.03, 0.012, D[1])
    p = inject.parts(pts, D)
    assert sum(p[3]) == pytest.approx(inject.at(0.03, 0.012, D[3]))
    assert sum(p[1]) == pytest.approx(pts[1]) and p[1][0] / p[1][1] == pytest.approx(0.03 * D[1] / (0.012 * D[1] ** .5))
    # K1.5 lies between K1's measured point and K2's curve value (log-linear in log D), not on the extrapolated curve
    D[1.5] = em.distortion(1.5, "mul1")
    p = inject.parts(pts, D)
    t = math.log(D[1.5] / D[1]) / math.log(D[2] / D[1])
    for i in (0, 1):
        assert p[1.5][i] == pytest.approx(p[1][i] ** (1 - t) * p[2][i] ** t)
    assert sum(p[2]) < sum(p[1.5]) < sum(p[1]) and sum(p[1.5]) > inject.at(0.03, 0.012, D[1.5])


def _pooled_problem(rng, n=5, ks=range(1, 7)):
    D = {K: em.distortion(K, "mul1") for K in ks}
    curves = {f"u{i}": (rng.uniform(0, 1), rng.uniform(0, 0.3) if rng.random() < 0.7 else 0.0) for i in range(n)}
    parts = {u: {K: (a * D[K], b * math.sqrt(D[K])) for K in ks} for u, (a, b) in curves.items()}
    sizes = {u: {K: rng.choice([1000, 3000, 8000]) * K for K in ks} for u in curves}
    total = sum(s[1] for s in sizes.values())
    return parts, sizes, int(total * rng.uniform(2.2, 5.0)), 8 * total


@pytest.mark.parametrize("seed", range(8))
def test_pooled_solver_never_worse_than_the_additive_start(seed):
    parts, sizes, budget, weights = _pooled_problem(random.Random(seed))
    a, least = solve.solve_pooled(parts, sizes, budget, weights, 1)
    assert a.bytes <= budget and least == 1
    assert a.predicted_kl == pytest.approx(solve.pooled_kl(parts, a.ks))
    start, _ = solve.solve_from({u: {K: (sum(v), sizes[u][K]) for K, v in p.items()} for u, p in parts.items()},
                                budget, weights, 1)
    assert a.predicted_kl <= solve.pooled_kl(parts, start.ks) + 1e-15
    # exhaustive: within what the additive knapsack itself reaches (the same granularity), usually the optimum
    ks = list(next(iter(parts.values())))
    best = min(solve.pooled_kl(parts, dict(zip(parts, c))) for c in itertools.product(ks, repeat=len(parts))
               if sum(sizes[u][K] for u, K in zip(parts, c)) <= budget)
    assert a.predicted_kl <= 1.4 * best


def test_pooled_solver_without_flips_is_the_knapsack():
    parts, sizes, budget, weights = _pooled_problem(random.Random(3))
    parts = {u: {K: (v[0], 0.0) for K, v in p.items()} for u, p in parts.items()}
    a, _ = solve.solve_pooled(parts, sizes, budget, weights, 1)
    plain, _ = solve.solve_from({u: {K: (v[0], sizes[u][K]) for K, v in p.items()} for u, p in parts.items()},
                                budget, weights, 1)
    assert a.ks == plain.ks and a.predicted_kl == pytest.approx(plain.predicted_kl)


def test_ldlq_efficiency_measures_the_encoder(demo, allocated):
    """c(K) as fq allocate measures it (error_model.ldlq_efficiency over these samples, the encodes seeded): near 1
    where the error model holds, exactly 1 at K16."""
    from fq.allocation.measure import efficiency_samples, hessians, weights
    from fq.core import canonical

    model, windows, _ = demo
    W = weights(model)
    samples = efficiency_samples(W, hessians(model, windows[:2], windows.device))
    assert len(samples) == 5  # attention, dense, shared, routed gate/up, routed down: not the head
    c = {document.k_of(K): v for K, v in canonical.load(allocated)["efficiency"].items()}
    assert sorted(c) == [2, 2.5, 3, 3.5, 4, 16] and c[16] == 1.0 and all(0.3 < c[K] < 3 for K in (2, 3, 4))
    # a half-integer K is not encoded: its neighbours' geometric mean
    assert c[2.5] == pytest.approx(math.sqrt(c[2] * c[3])) and c[3.5] == pytest.approx(math.sqrt(c[3] * c[4]))


def test_injection_measures_real_kl_and_restores_the_model(demo):
    model, windows, _ = demo
    from fq.allocation.measure import hessians, weights

    W = weights(model)
    before = {n: t.clone() for n, t in W.items()}
    H = hessians(model, windows[:2], windows.device)
    groups = {u: ns for u, ns in units.group_units(sorted(W)).items() if u in ("L0.attention", "L2.routed_down", "head")}
    dirs = {n: em.direction(W[n], H[n], seed=i) for i, n in enumerate(sorted(n for ns in groups.values() for n in ns))}
    D = {K: em.distortion(K, "mul1") for K in range(1, 9)}
    from fq.allocation.measure import apply

    pts = inject.measure(model, windows[:2], dirs, groups, D, W, apply)
    assert set(pts) == set(groups) and all(list(p) == list(inject.INJECT_KS) for p in pts.values())
    for u, p in pts.items():
        kl = list(p.values())
        assert all(x > 0 for x in kl) and kl == sorted(kl, reverse=True), (u, p)
    assert all(torch.equal(W2, before[n]) for n, W2 in weights(model).items())  # restored exactly
    # the head: no router reads its error, so its KL is second order: x d(K) from K to K (0.25-0.27 a bit)
    h = pts["head"]
    for K0, K1 in zip(inject.INJECT_KS[1:], inject.INJECT_KS[2:]):
        ratio = h[K1] / h[K0]
        assert ratio == pytest.approx(em.distortion(K1, "mul1") / em.distortion(K0, "mul1"), rel=0.15), (K0, ratio)


# -- fq allocate -----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def allocated(demo, tmp_path_factory):
    """fq allocate on the demo model, once: its output file. The efficiency test reads c(K) from it (the encodes are
    the expensive part of a measurement)."""
    from fq.cli import main

    _, _, d = demo
    out = tmp_path_factory.mktemp("allocate")
    args = ["allocate", "--model", str(d / "model"), "--text", str(d / "text" / "calibration.txt"), "--rows", "2",
            "--columns", "32", "--samples", "1", "--ks", "2-4,16", "--bits", "2.5", "--bits", "4", "--threads", "1"]
    before = torch.get_num_threads()
    try:
        assert main(args + ["--out", str(out / "a.json")]) == 0
    finally:
        torch.set_num_threads(before)
    return out / "a.json"


def test_fq_allocate_writes_the_allocation_document(allocated):
    from fq.core import canonical

    a = allocated.read_bytes()
    doc = canonical.loads(a)
    assert b'"timestamp"' not in a and b'"time"' not in a  # nothing of the run but what it measured
    assert doc["format"] == "fq-allocation/1" and doc["ks"] == [2, 2.5, 3, 3.5, 4, 16]  # mul1: 2-4 holds 2.5, 3.5
    assert set(doc["units"]) == {"L0.attention", "L0.dense", "L1.attention", "L1.shared", "L1.routed_gate_up",
                                 "L1.routed_down", "L2.attention", "L2.shared", "L2.routed_gate_up",
                                 "L2.routed_down", "head"}
    assert doc["units"]["head"]["16"] == {"predicted_kl": 0.0, "bytes": 512 * 256 * 2}
    low, high = doc["allocations"]
    assert low["bits"] <= 2.5 and high["bits"] <= 4 and low["predicted_kl"] > high["predicted_kl"]
    assert set(low["ks"].values()) <= {2, 2.5, 3, 3.5, 4, 16}
    assert doc["units"]["L1.routed_down"]["2.5"]["bytes"] == 8 * solve.linear_bytes(256, 128, 2.5)


def test_fq_allocate_refuses_bad_input_before_measuring(demo, tmp_path, capsys):
    from fq.cli import main

    _, _, d = demo
    base = ["allocate", "--model", str(d / "model"), "--text", str(d / "text" / "calibration.txt"),
            "--out", str(tmp_path / "a.json"), "--rows", "1", "--columns", "16", "--samples", "1"]
    assert main(base + ["--bits", "3", "--ks", "2-9"]) == 2
    assert "K must be 1..8, 16 (kept as published) or, with codebook mul1, 1.5, 2.5, 3.5" in capsys.readouterr().err
    assert main(base + ["--bits", "3", "--ks", "1.5,2", "--codebook", "mcg"]) == 2
    assert "got [1.5]" in capsys.readouterr().err
    assert main(base + ["--bits", "0"]) == 2
    assert "bits 0.0" in capsys.readouterr().err
    assert main(base + ["--bits", "1", "--ks", "2-3"]) == 2
    assert "below the smallest allocation" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()


def test_a_measurement_from_scratch_is_byte_identical(demo):
    """The sensitivity job's measurement (fq.workflow.allocation.measure: Hessians, c(K)'s encodes, the Fisher
    pass, the injections, the document) twice from the same inputs: the same bytes. Small: one window of 32
    tokens, c(K) at K2 only."""
    from fq.core import canonical
    from fq.workflow.allocation import measure

    _, _, d = demo
    text = (d / "text" / "calibration.txt").read_text()
    a, b = (canonical.dumps(measure(d / "model", text, ks=(2, 16), rows=1, columns=32, samples=1, seed=3))
            for _ in range(2))
    assert a == b and b'"efficiency"' in a
