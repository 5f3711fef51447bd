#!/usr/bin/env python3
"""Calibrated vs weight-only encode time per matrix, batched the way a layer's matrices arrive (issue 18, section 4).

    python benchmarks/ldlq_speed.py [--device cuda:0] [--K 2] [--batch 32] [--profile] [--json OUT.json]

N GLM-5-shaped gate/up weights (2048 x 6144, other weight seeds) sharing one input Hessian (every token routed to every
expert, so one H per layer), the synthetic inputs of benchmarks/ldlq_quality.py. Times, in one process after a
warm-up: fq.codec.encode_batch (weight-only) and fq.codec.encode_ldlq_batch (LDLQ), seconds per matrix, the LDLQ
stage times, and the ratio. ``--profile``: torch.profiler's top operators of one LDLQ batch (self CPU and CUDA time).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from fq.codec import encode_batch, encode_ldlq_batch  # noqa: E402
from ldlq_quality import FULL, SMALL, hessian, log, sync, weight  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--K", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shape = SMALL if args.small else FULL
    dev = torch.device(args.device)
    H = hessian(shape["in_f"], shape["rows"], shape["rank"], shape["outliers"], args.seed + 1000, dev)
    Ws = [weight(shape["out_f"], shape["in_f"], args.seed + i).to(dev) for i in range(args.batch)]
    seeds = [args.seed + i for i in range(args.batch)]
    K = args.K

    def run(fn):
        sync(dev)
        t = time.perf_counter()
        out = fn()
        sync(dev)
        return out, time.perf_counter() - t

    run(lambda: encode_ldlq_batch(Ws[:2], H, K, "mul1", seeds[:2], dev))  # warm-up: kernels, allocator
    wo, t_wo = run(lambda: encode_batch(Ws, K, "mul1", seeds, dev))
    stages: dict = {}
    cal, t_cal = run(lambda: encode_ldlq_batch(Ws, H, K, "mul1", seeds, dev, timings=stages))
    _, t_cal2 = run(lambda: encode_ldlq_batch(Ws, H, K, "mul1", seeds, dev))  # without the stage syncs
    n = len(Ws)
    res = dict(device=str(dev), gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, K=K, batch=n,
               shape=shape, weight_only_s_per_matrix=t_wo / n, ldlq_s_per_matrix=t_cal2 / n,
               ldlq_timed_s_per_matrix=t_cal / n, ratio=t_cal2 / t_wo,
               ldlq_stages_s_per_matrix={k: round(v / n, 4) for k, v in stages.items()},
               proxy_err_mean=sum(e.proxy_err for e in cal) / n)
    log(json.dumps(res, indent=1))
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
        with profile(activities=acts) as prof:
            encode_ldlq_batch(Ws, H, K, "mul1", seeds, dev)
            sync(dev)
        ka = prof.key_averages()
        log(ka.table(sort_by="self_cpu_time_total", row_limit=25))
        if dev.type == "cuda":
            log(ka.table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
