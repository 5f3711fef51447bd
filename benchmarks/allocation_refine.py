"""Does measuring whole allocations beat the error model's choice? A greedy search on the trained demo model (issue 41).

    .venv/bin/python benchmarks/allocation_refine.py OUT.json --bits 2.5 [--work /tmp/arefine] [--rounds 4]
        [--eval-windows 32] [--check docs=.a41/text/docs.txt --check heldout=PATH] [--threads 2]

fq's allocation (``fq allocate``'s measurement and pooled solver, as ``allocation_exl3.py build`` runs it: K 1..8
with half-integers, 32 x 256 sensitivity tokens, 8 label samples; Hessians on 65,536 calibration tokens) is the start.
Every linear is LDLQ-encoded at the K its unit got and, lazily, at the neighbouring K (± 0.5); a move raises one unit
by half a bit and lowers another by half a bit (or raises one alone) within the same byte budget, and its KL is
*measured*: transformers in float32 with the encoded weights, against the source, on ``--eval-windows`` windows of
256 calibration tokens that the sensitivity measurement did not use. The best improving move is taken, for
``--rounds`` rounds. Then the start and the refined allocation are scored on each ``--check`` text (held-out: text
neither the search nor calibration saw), per window, with the paired difference.

What it prices: a search step costs the encodes of the neighbouring K (a second and third encode of most linears)
and one calibration forward per move; at GLM-5 scale that is the encode bill again and hundreds of forward passes,
so it is worth building only if it wins by more than the held-out noise.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

CODEBOOK = "mul1"


def main(argv=None) -> int:
    from allocation_exl3 import shared_hessians, tokenize
    from hessian_variants import demo_source, log
    from fq.allocation import solve, units
    from fq.allocation.document import LEAST_K
    from fq.allocation.measure import apply, hessians, unit_options, weights
    from fq.codec.ldlq import encode_ldlq_batch
    from fq.commands.allocate import parse_ks
    from fq.model import demo_model
    from fq.runtime.quality import token_windows

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--bits", type=float, default=2.5)
    ap.add_argument("--work", default="/tmp/arefine")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument("--check", action="append", default=[])
    ap.add_argument("--check-tokens", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_start = time.time()
    src, model = demo_source(a.work)
    cal_ids, _ = tokenize(src, demo_model.text("calibration"))
    sens_w = token_windows(cal_ids, 256, 32 * 256)
    hess_w = token_windows(cal_ids, 512, 65536)
    # evaluation windows from the end of the calibration split, past the sensitivity measurement's 32 x 256 tokens
    tail = cal_ids[len(cal_ids) - a.eval_windows * 256:]
    assert len(cal_ids) - a.eval_windows * 256 >= 32 * 256, "calibration split too short for separate windows"
    eval_w = token_windows(tail, 256, a.eval_windows * 256)

    ks = parse_ks("1-8")
    saved = Path(a.work) / "sensitivity.pt"  # the measurement is the same on a rerun: kept for one
    if saved.exists():
        options, n_weights, fit = torch.load(saved, weights_only=False)
    else:
        log("sensitivity")
        options, n_weights, _, fit = unit_options(model, sens_w, ks, CODEBOOK, samples=8, seed=0)
        torch.save((options, n_weights, fit), saved)
    sizes = {u: {K: v[1] for K, v in o.items()} for u, o in options.items()}
    budget = solve.budget_from_bits(a.bits, n_weights)
    start, _ = solve.solve_pooled(fit["parts"], sizes, budget, n_weights, LEAST_K)
    log(f"start: {start.bits:.4f} bits, predicted {start.predicted_kl:.5f}: {start.ks}")

    log("hessians")
    H = shared_hessians(hessians(model, hess_w, torch.device("cpu")))
    W = weights(model)
    names = sorted(W)
    seed_of = {n: i for i, n in enumerate(names)}  # the build's seeds (--seed 0)
    groups = units.group_units(W)
    cache: dict = {}  # (unit, K) -> {linear: W_hat}

    def encoded(u, K):
        K = int(K) if float(K).is_integer() else K  # an integer K as an int: a float K is the half-integer path
        if (u, K) not in cache:
            cache[(u, K)] = {}
            by_width: dict = {}  # a batch is coded together: one input width (a dense MLP's down is wider)
            for n in groups[u]:
                by_width.setdefault(W[n].shape[1], []).append(n)
            for ns in by_width.values():
                res = encode_ldlq_batch([W[n].double() for n in ns], [H[n] for n in ns], K, CODEBOOK,
                                        seeds=[seed_of[n] for n in ns], names=ns)
                cache[(u, K)].update({n: e.W_hat.float() for n, e in zip(ns, res)})
        return cache[(u, K)]

    orig = {n: t.clone() for n, t in W.items()}

    def log_probs(windows):
        with torch.no_grad():
            return torch.cat([torch.log_softmax(model(input_ids=windows[i:i + 8]).logits.float(), -1)
                              for i in range(0, windows.shape[0], 8)])

    ref_eval = log_probs(eval_w)

    def kl_windows(ks_of, windows, ref):
        apply(model, {n: w for u, K in ks_of.items() for n, w in encoded(u, K).items()})
        try:
            got = log_probs(windows)
        finally:
            apply(model, orig)
        return (ref.exp() * (ref - got)).sum(-1).double().mean(-1)  # per window

    def nbytes(ks_of):
        return sum(sizes[u][K] for u, K in ks_of.items())

    def norm(K):
        return int(K) if float(K).is_integer() else K

    cur = dict(start.ks)
    cur_kl = float(kl_windows(cur, eval_w, ref_eval).mean())
    trail = [{"ks": dict(cur), "bytes": nbytes(cur), "kl_eval": cur_kl}]
    log(f"start measured on {a.eval_windows} calibration windows: {cur_kl:.5f}")
    step = 0.5
    for r in range(a.rounds):
        best = None
        moves = []
        for u in cur:
            up = norm(cur[u] + step)
            if up not in sizes[u]:
                continue
            moves.append({u: up})
            for v in cur:
                down = norm(cur[v] - step)
                if v != u and down in sizes[v]:
                    moves.append({u: up, v: down})
        tried = 0
        for m in moves:
            cand = {**cur, **m}
            if nbytes(cand) > budget:
                continue
            tried += 1
            kl = float(kl_windows(cand, eval_w, ref_eval).mean())
            if best is None or kl < best[1]:
                best = (cand, kl, m)
        log(f"round {r + 1}: {tried} moves measured, best {best[1] if best else None} ({best[2] if best else ''}) "
            f"against {cur_kl:.5f}; {len(cache)} unit encodes cached")
        if best is None or best[1] >= cur_kl:
            break
        cur, cur_kl = best[0], best[1]
        trail.append({"ks": dict(cur), "bytes": nbytes(cur), "kl_eval": cur_kl, "move": dict(best[2])})

    checks = {}
    for spec in a.check:
        name, path = spec.split("=", 1)
        ids, _ = tokenize(src, Path(path).read_text())
        w = token_windows(ids, 256, a.check_tokens)
        ref = log_probs(w)
        s0, s1 = kl_windows(start.ks, w, ref), kl_windows(cur, w, ref)
        d = s1 - s0
        se = float(d.std(unbiased=True) / math.sqrt(d.numel()))
        checks[name] = {"windows": int(w.shape[0]), "start": float(s0.mean()), "refined": float(s1.mean()),
                        "ratio": float(s1.mean() / s0.mean()), "paired_diff": float(d.mean()), "se": se}
        log(f"{name}: start {float(s0.mean()):.5f} refined {float(s1.mean()):.5f} "
            f"({float(s1.mean() / s0.mean()):.3f}x, {float(d.mean()):+.2e} ± {se:.1e})")
    doc = {"what": __doc__.split("\n\n")[0], "bits": a.bits, "budget_bytes": budget, "weights": n_weights,
           "start": {"ks": start.ks, "bytes": start.bytes, "predicted_kl": start.predicted_kl},
           "eval_windows": a.eval_windows, "trail": trail, "checks": checks,
           "unit_encodes": len(cache), "seconds": round(time.time() - t_start, 1), "threads": a.threads,
           "torch": torch.__version__}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
