#!/usr/bin/env python3
"""Tune the CUDA Viterbi kernel: build variants of fq/codec/_viterbi_cuda.cu with extra nvcc defines, time
each on the same Gaussian tiles per K, and check its states against the CPU kernel.

    python benchmarks/viterbi_variants.py [--ks 1,2,3,4,8] [--tiles 16384] [--codebook mul1]
           [--variant NAME=-DFQ_NREG1=16,-DFQ_NREG2=44 ...] [--json OUT]

The kernel's tunables are the FQ_NREG<K> defines for K >= 2 (float32 codebook values held in registers per K;
the rest live in shared memory; K = 1 holds all 64). ``default`` (no defines) is always measured first.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fq.codec import viterbi_cuda as vc  # noqa: E402
from fq.codec.viterbi import viterbi_cpu  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encode_speed import CB_INDEX, gaussian_tiles  # noqa: E402  (the tiles encode_speed.py times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ks", default="1,2,3,4,8")
    ap.add_argument("--tiles", type=int, default=16384)
    ap.add_argument("--codebook", default="mul1")
    ap.add_argument("--check-tiles", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], help="NAME=-DX=1,-DY=2")
    ap.add_argument("--json")
    a = ap.parse_args(argv)
    dev = torch.device("cuda", 0)
    base = vc.NVCC_FLAGS
    variants = [("default", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in a.variant]
    ks = [int(k) for k in a.ks.split(",")]
    tiles = {K: gaussian_tiles(a.tiles, K, a.codebook, seed=1000 * K + CB_INDEX[a.codebook])[0] for K in ks}
    cpu = {K: viterbi_cpu(tiles[K][: a.check_tiles], K, a.codebook) for K in ks}
    results = {}
    for name, flags in variants:
        vc.NVCC_FLAGS = base + tuple(flags)
        vc._load.cache_clear()
        t = time.perf_counter()
        vc.library(dev)
        print(f"[{name}] build {time.perf_counter() - t:.1f} s  flags {' '.join(flags) or '-'}", flush=True)
        results[name] = {}
        for K in ks:
            x = tiles[K].to(dev)
            got = vc.viterbi_cuda(x[: a.check_tiles], K, a.codebook, dev).cpu()
            same = bool(torch.equal(got, cpu[K]))
            best = float("inf")
            for _ in range(a.reps):
                torch.cuda.synchronize()
                t = time.perf_counter()
                vc.viterbi_cuda(x, K, a.codebook, dev)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            results[name][K] = {"tiles_per_s": a.tiles / best, "equals_cpu": same}
            print(f"[{name}] K{K}: {a.tiles / best:9.0f} tiles/s  equals CPU: {same}", flush=True)
    vc.NVCC_FLAGS = base
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
