"""Predicted against measured KL of whole allocations (issue 41): does the sensitivity measurement rank them right?

    python benchmarks/allocation_validate.py MODEL_DIR CAL_TEXT HELDOUT_TEXT OUT.json [--ks 2,3,4,5] \
        [--allocations 24] [--device cpu|cuda] [--cal-rows 16 --cal-cols 128] [--eval-tokens 4096]

1. Calibration windows (``--cal-rows`` x ``--cal-cols`` tokens of CAL_TEXT): fq.allocation.measure.unit_options, as
   ``fq allocate`` runs it, predicts every unit's KL at every K of ``--ks`` from the Fisher quadratic form in an
   LDLQ-shaped error direction (no encode).
2. To measure: every linear is LDLQ-encoded at every K (fq.codec.ldlq, mul1) against its Hessian on the same windows
   (routed experts: the campaign's ``all-experts`` capture).
3. Allocations (a K per unit of fq.allocation.units): each uniform K, and ``--allocations`` seeded random ones.
   Predicted KL = sum of the units' predictions; measured KL = KL(source || model with the allocation's W_hat) on
   HELDOUT_TEXT windows of 256 (mean over positions, as fq eval).
4. Spearman rank correlation; and the solver (fq.allocation.solve) at each uniform allocation's bytes against it,
   measured (paired per window). Everything to OUT.json.

Encodes are cached in OUT's folder (``encodes-*.pt``), keyed by the model's config and the Ks, so a rerun with more
allocations does not encode again.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from fq.allocation import solve, units
from fq.allocation.measure import apply, hessians, unit_options, weights
from fq.codec.ldlq import encode_ldlq
from fq.runtime.evaluate import tokenize
from fq.runtime.quality import token_windows


def log_probs(model, windows, device) -> list[torch.Tensor]:
    out = []
    with torch.no_grad():
        for i in range(0, windows.shape[0], 8):
            out.append(torch.log_softmax(model(input_ids=windows[i: i + 8].to(device)).logits[:, :-1].double(), -1))
    return out


def kl(ref: list, q: list) -> tuple[float, list[float]]:
    rows = []
    for lp, lq in zip(ref, q):
        rows += (lp.exp() * (lp - lq)).sum(-1).mean(-1).tolist()
    return sum(rows) / len(rows), rows


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        for pos, i in enumerate(order):
            r[i] = float(pos)
        return r
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    num = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    den = math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))
    return num / den


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("cal_text")
    ap.add_argument("heldout_text")
    ap.add_argument("out")
    ap.add_argument("--ks", default="2,3,4,5")
    ap.add_argument("--allocations", type=int, default=24)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--cal-rows", type=int, default=16)
    ap.add_argument("--cal-cols", type=int, default=128)
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    ks = [int(k) for k in a.ks.split(",")]
    dev = torch.device(a.device)
    out = Path(a.out)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).to(dev).eval()
    src = Path(a.model)
    cal_ids, _ = tokenize(src, Path(a.cal_text).read_text())
    cal = token_windows(cal_ids, a.cal_cols, a.cal_rows * a.cal_cols).to(dev)
    ev_ids, _ = tokenize(src, Path(a.heldout_text).read_text())
    ev = token_windows(ev_ids, 256, a.eval_tokens)

    t0 = time.time()
    options, n_weights, sens, fit = unit_options(model, cal, ks, "mul1", samples=a.samples)
    sizes = {u: {K: v[1] for K, v in o.items()} for u, o in options.items()}
    t_sens = time.time() - t0
    print(f"sensitivity: {len(sens.linears)} linears, {sens.positions} positions, {t_sens:.1f} s", flush=True)
    W = weights(model)
    key = hashlib.sha256((Path(a.model, "config.json").read_text() + a.ks + f"{a.cal_rows}x{a.cal_cols}").encode())
    cache = out.parent / f"encodes-{key.hexdigest()[:12]}.pt"
    if cache.exists():
        enc = torch.load(cache)
    else:
        H = hessians(model, cal, dev)
        enc = {}
        t0 = time.time()
        names = sorted(W)
        for i, n in enumerate(names):
            for K in ks:
                e = encode_ldlq(W[n].double(), H[n], K, "mul1", seed=i, device=dev)
                enc[(n, K)] = (e.proxy_err, e.W_hat.float().cpu())
            print(f"\rencoded {i + 1}/{len(names)} linears ({time.time() - t0:.0f} s)", end="", file=sys.stderr)
        print(file=sys.stderr)
        torch.save(enc, cache)
    groups = units.group_units(W)
    rng = random.Random(0)
    allocs = [{u: K for u in groups} for K in ks]
    allocs += [{u: rng.choice(ks) for u in groups} for _ in range(a.allocations)]
    ref = log_probs(model, ev, dev)
    orig = {n: t.clone() for n, t in W.items()}

    def measured(alloc):
        apply(model, {n: enc[(n, alloc[u])][1].to(dev) for u, ns in groups.items() for n in ns})
        try:
            return kl(ref, log_probs(model, ev, dev))
        finally:
            apply(model, orig)

    rows = []
    for j, alloc in enumerate(allocs):
        pred = solve.pooled_kl(fit["parts"], alloc)  # fq's prediction (the additive sum: "additive_kl")
        additive = sum(options[u][K][0] for u, K in alloc.items())
        meas, _ = measured(alloc)
        bts = sum(options[u][K][1] for u, K in alloc.items())
        rows.append({"allocation": alloc, "predicted_kl": pred, "additive_kl": additive, "measured_kl": meas,
                     "bits": 8 * bts / n_weights})
        print(f"allocation {j}: predicted {pred:.5f} measured {meas:.5f}", flush=True)
    solved = []  # the solver at each uniform allocation's bytes, against it (paired per window)
    for K in ks[:-1]:
        uni = {u: K for u in groups}
        budget = sum(options[u][K][1] for u in groups)
        s, _ = solve.solve_pooled(fit["parts"], sizes, budget, n_weights, min(ks))
        (mu, wu), (ms, ws) = measured(uni), measured(s.ks)
        d = [x - y for x, y in zip(ws, wu)]
        se = (sum((x - sum(d) / len(d)) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
        solved.append({"uniform_K": K, "bits": 8 * budget / n_weights, "uniform_kl": mu, "solved_bits": s.bits,
                       "solved_kl": ms, "paired_diff": sum(d) / len(d), "paired_se": se, "ks": s.ks})
        print(f"K{K} uniform {8 * budget / n_weights:.3f} bits KL {mu:.5f}; solved {s.bits:.3f} bits KL {ms:.5f} "
              f"({ms / mu:.2f}x)", flush=True)
    rho = spearman([r["predicted_kl"] for r in rows], [r["measured_kl"] for r in rows])
    rho_additive = spearman([r["additive_kl"] for r in rows], [r["measured_kl"] for r in rows])
    ratio = [r["measured_kl"] / r["predicted_kl"] for r in rows]
    doc_solved = solved
    doc = {"model": a.model, "ks": ks, "calibration": [a.cal_rows, a.cal_cols], "eval_windows": int(ev.shape[0]),
           "samples": a.samples, "sensitivity_seconds": round(t_sens, 2), "spearman": rho,
           "spearman_additive": rho_additive, "efficiency": {str(K): c for K, c in fit["efficiency"].items()},
           "measured_over_predicted": [min(ratio), sum(ratio) / len(ratio), max(ratio)],
           "options": {u: {str(K): list(v) for K, v in o.items()} for u, o in options.items()},
           "proxy": {f"{n}@K{K}": v[0] for (n, K), v in sorted(enc.items())}, "rows": rows, "solved": doc_solved}
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    print(f"spearman {rho:.3f} (additive {rho_additive:.3f}); measured/predicted min {min(ratio):.2f} mean {sum(ratio)/len(ratio):.2f} "
          f"max {max(ratio):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
