"""Predicted against measured KL of whole allocations (issue 41): does the sensitivity measurement rank them right?

    python benchmarks/allocation_validate.py MODEL_DIR CAL_TEXT HELDOUT_TEXT OUT.json [--ks 2,3,4,5] \
        [--allocations 24] [--device cpu|cuda] [--cal-rows 16 --cal-cols 128] [--eval-tokens 4096]

1. Calibration windows (``--cal-rows`` x ``--cal-cols`` tokens of CAL_TEXT): fq.allocation.sensitivity measures every
   linear's beta (Fisher trace x energy ratio), and the same windows give each linear's input Hessian (routed
   experts: gate/up over every token, down over every token's activation of that expert: the campaign's
   ``all-experts`` capture).
2. Every linear is LDLQ-encoded at every K of ``--ks`` (fq.codec.ldlq, mul1): its proxy error rho(K) and W_hat.
3. Allocations (a K per unit of fq.allocation.units): each uniform K, and ``--allocations`` seeded random ones.
   Predicted KL = sum over linears of rho(K_unit) * beta; measured KL = KL(source || model with the allocation's
   W_hat) on HELDOUT_TEXT windows of 256 (mean over positions, as fq eval).
4. Spearman rank correlation and the table, to OUT.json.

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

from fq.allocation import sensitivity, units
from fq.codec.ldlq import encode_ldlq
from fq.runtime.evaluate import tokenize
from fq.runtime.quality import token_windows


def hessians(model, windows, device) -> dict[str, torch.Tensor]:
    """name -> (H float64 sum, count) over the calibration windows for every quantizable linear."""
    sums: dict[str, list] = {}

    def add(name, x):
        x = x.reshape(-1, x.shape[-1]).double()
        s = sums.setdefault(name, [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device), 0])
        s[0] += x.T @ x
        s[1] += x.shape[0]

    handles = [m.register_forward_pre_hook(lambda mod, args, n=n: add(n, args[0]))
               for n, m in sensitivity.quantizable_linears(model).items()]
    origs = {}
    for name, mod in sensitivity.fused_experts(model).items():
        def fwd(hidden_states, top_k_index, top_k_weights, mod=mod, name=name, orig=mod.forward):
            I = mod.gate_up_proj.shape[1] // 2
            for e in range(mod.gate_up_proj.shape[0]):
                gu = torch.nn.functional.linear(hidden_states, mod.gate_up_proj[e])
                a = mod.act_fn(gu[..., :I]) * gu[..., I:]
                add(f"{name}.{e}.gate_proj", hidden_states)
                add(f"{name}.{e}.down_proj", a)
            return orig(hidden_states, top_k_index, top_k_weights)
        origs[name] = (mod, mod.forward)
        mod.forward = fwd
    try:
        with torch.no_grad():
            for i in range(windows.shape[0]):
                model(input_ids=windows[i: i + 1].to(device))
    finally:
        for h in handles:
            h.remove()
        for mod, f in origs.values():
            mod.forward = f
    out = {n: (s / c) for n, (s, c) in sums.items()}
    for n in list(out):
        if n.endswith(".gate_proj") and ".experts." in n and "shared" not in n:
            out[n.replace(".gate_proj", ".up_proj")] = out[n]
    return out


def weights(model) -> dict[str, torch.Tensor]:
    """name -> the float32 weight of every quantizable linear (experts split out of the fused parameters)."""
    out = {n: m.weight.detach() for n, m in sensitivity.quantizable_linears(model).items()}
    for name, mod in sensitivity.fused_experts(model).items():
        I = mod.gate_up_proj.shape[1] // 2
        for e in range(mod.gate_up_proj.shape[0]):
            out[f"{name}.{e}.gate_proj"] = mod.gate_up_proj[e, :I].detach()
            out[f"{name}.{e}.up_proj"] = mod.gate_up_proj[e, I:].detach()
            out[f"{name}.{e}.down_proj"] = mod.down_proj[e].detach()
    return out


def apply(model, tensors: dict[str, torch.Tensor]) -> None:
    """Write W_hat tensors (names as ``weights``) into the model in place."""
    lin = sensitivity.quantizable_linears(model)
    exp = sensitivity.fused_experts(model)
    with torch.no_grad():
        for n, t in tensors.items():
            if n in lin:
                lin[n].weight.copy_(t)
                continue
            prefix, e, proj = n.rsplit(".", 2)
            mod, e = exp[prefix], int(e)
            I = mod.gate_up_proj.shape[1] // 2
            if proj == "gate_proj":
                mod.gate_up_proj[e, :I].copy_(t)
            elif proj == "up_proj":
                mod.gate_up_proj[e, I:].copy_(t)
            else:
                mod.down_proj[e].copy_(t)


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
    ap.add_argument("--samples", type=int, default=2)
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
    sens = sensitivity.measure(model, cal, samples=a.samples)
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
    beta = {n: sens.beta(n) for n in W}
    rng = random.Random(0)
    allocs = [{u: K for u in groups} for K in ks]
    allocs += [{u: rng.choice(ks) for u in groups} for _ in range(a.allocations)]
    ref = log_probs(model, ev, dev)
    orig = {n: t.clone() for n, t in W.items()}
    rows = []
    for j, alloc in enumerate(allocs):
        pred = sum(enc[(n, alloc[u])][0] * beta[n] for u, ns in groups.items() for n in ns)
        apply(model, {n: enc[(n, alloc[u])][1].to(dev) for u, ns in groups.items() for n in ns})
        meas, per_window = kl(ref, log_probs(model, ev, dev))
        apply(model, orig)
        rows.append({"allocation": alloc, "predicted_kl": pred, "measured_kl": meas})
        print(f"allocation {j}: predicted {pred:.5f} measured {meas:.5f}", flush=True)
    rho = spearman([r["predicted_kl"] for r in rows], [r["measured_kl"] for r in rows])
    ratio = [r["measured_kl"] / r["predicted_kl"] for r in rows]
    doc = {"model": a.model, "ks": ks, "calibration": [a.cal_rows, a.cal_cols], "eval_windows": int(ev.shape[0]),
           "samples": a.samples, "sensitivity_seconds": round(t_sens, 2), "spearman": rho,
           "measured_over_predicted": [min(ratio), sum(ratio) / len(ratio), max(ratio)],
           "units": {u: {n: beta[n] for n in ns} for u, ns in groups.items()},
           "proxy": {f"{n}@K{K}": v[0] for (n, K), v in sorted(enc.items())}, "rows": rows}
    out.write_text(json.dumps(doc, indent=1, sort_keys=True))
    print(f"spearman {rho:.3f}; measured/predicted min {min(ratio):.2f} mean {sum(ratio)/len(ratio):.2f} "
          f"max {max(ratio):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
