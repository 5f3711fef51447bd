#!/usr/bin/env python3
"""Encode time and GPU memory of a whole-model base's added jobs at GLM-5's shapes (issue 25).

    python benchmarks/linear_encode_cost.py [--device cuda:0] [--K 4] [--head-K 6] [--json OUT.json]
        [--only head] [--chunk-mb MiB | --whole]

One job of each kind, as ``fq.workflow.encode_linears`` runs it (one matrix after another, LDLQ against the input
Hessian of the matrix's group): an MoE layer's MLA attention (q_a, kv_a, q_b, kv_b, o_proj), its shared expert
(gate, up, down), a dense layer's MLP, and lm_head. Shapes are GLM-5's, from ``fq.planning.model_bits.linear_shapes`` of
the GLM-5-shaped synthetic index (transformers' own GlmMoeDsa layer on the meta device); weights and Hessians are
benchmarks/ldlq_quality.py's synthetic ones (heavy-tailed weights, a low-rank-plus-outliers input). Per job: wall
seconds (after one warm-up matrix), seconds per matrix, peak GPU memory (torch.cuda.max_memory_allocated), and the
whole model's count of such jobs (78 attention, 75 shared, 3 dense, 1 head), giving the GPU-hours the added jobs
cost on one GPU. A matrix wider than one chunk of the encoder's memory budget (fq.codec.chunked: $FQ_ENCODE_CHUNK_MB,
default 4096 MiB on CUDA; ``--chunk-mb`` sets it) is encoded by chunks of output channels, to the same bytes: the head
is; ``--whole`` encodes every matrix whole (the encoder before chunking: the head peaked at 90.6 GiB). Each job's
record names the chunk (output channels) each of its matrices ran with.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from fq.codec import chunked  # noqa: E402
from fq.codec.ldlq import encode_ldlq  # noqa: E402
from fq.codec.shape import padded  # noqa: E402
from fq.planning.model_bits import hessian_groups, linear_shapes  # noqa: E402
from fq.model.source import parse_source  # noqa: E402
from fq.model.source_synth import glm5_like  # noqa: E402
from ldlq_quality import hessian, sync, weight  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--K", type=int, default=4)
    ap.add_argument("--head-K", type=int, default=6)
    ap.add_argument("--rows", type=int, default=8192, help="rows of the synthetic calibration input")
    ap.add_argument("--json")
    ap.add_argument("--only", choices=["attention", "shared", "dense", "head"], help="run this class's job only")
    ap.add_argument("--chunk-mb", type=float, help=f"the chunked encoder's budget (sets ${chunked.ENV})")
    ap.add_argument("--whole", action="store_true", help="encode every matrix whole (no chunks)")
    args = ap.parse_args(argv)
    if args.chunk_mb is not None:
        os.environ[chunked.ENV] = str(args.chunk_mb)
    if args.whole:
        os.environ[chunked.ENV] = str(float(1 << 40))  # a chunk wider than any matrix
    dev = torch.device(args.device)
    source = parse_source(*glm5_like(), origin="synthetic GLM-5")
    shapes = linear_shapes(source)
    jobs = {"attention (MoE layer 5)": ("attention", "model.layers.5."),
            "shared expert (layer 5)": ("shared", "model.layers.5."),
            "dense MLP (layer 0)": ("dense", "model.layers.0."), "lm_head": ("head", "lm_head")}
    counts = {}
    for cls in ("attention", "shared", "dense", "head"):
        counts[cls] = len({n.rsplit(".", 2)[0] for n, (c, _) in shapes.items() if c == cls})
    results = {}
    warm = weight(256, 512, 0)
    encode_ldlq(warm, hessian(512, 1024, 16, 4, 0, dev), args.K, "mcg", 0, dev)
    for label, (cls, prefix) in jobs.items():
        if args.only and cls != args.only:
            continue
        mine = {n: s for n, (c, s) in shapes.items() if c == cls and n.startswith(prefix)}
        K = args.head_K if cls == "head" else args.K
        torch.cuda.reset_peak_memory_stats(dev) if dev.type == "cuda" else None
        per = {}
        t_job = time.perf_counter()
        for group in hessian_groups(mine):
            in_f = mine[group[0]][1]
            H = hessian(in_f, max(args.rows, 2 * in_f), 64, 16, 7, dev)
            for n in group:
                out_f = mine[n][0]
                W = weight(out_f, in_f, hash(n) & 0xFFFF)
                sync(dev)
                t = time.perf_counter()
                enc = encode_ldlq(W, H, K, "mcg", 1, dev, name=n)
                sync(dev)
                C = chunked.chunk_columns(padded(in_f), padded(out_f), dev)
                per[n.rsplit(".", 1)[-1]] = {"shape": [out_f, in_f], "seconds": round(time.perf_counter() - t, 3),
                                             "proxy_err": enc.proxy_err,
                                             "chunk": C if C < padded(out_f) else None}
                del enc, W
            del H
        sync(dev)
        seconds = time.perf_counter() - t_job
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        results[label] = {"class": cls, "K": K, "seconds": round(seconds, 2), "matrices": per,
                          "peak_gpu_bytes": peak, "jobs_in_model": counts[cls],
                          "model_gpu_hours": round(seconds * counts[cls] / 3600, 3)}
        print(f"{label}: K{K}, {len(per)} matrices, {seconds:.1f} s, peak {peak / 2**30 if peak else 0:.1f} GiB; "
              f"x{counts[cls]} jobs = {seconds * counts[cls] / 3600:.2f} GPU-h", flush=True)
    total = sum(r["model_gpu_hours"] for r in results.values())
    print(f"added jobs of a GLM-5 whole-model base, one GPU: {total:.2f} GPU-hours")
    doc = {"device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu", "torch": torch.__version__,
           "chunk_budget_bytes": chunked.chunk_budget(dev),
           "jobs": results, "total_gpu_hours": round(total, 3)}
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
