"""Tiles per second of the half-integer Viterbi on a CUDA device (the torch frac path: fq.codec.viterbi._frac_chunk)
against the C kernel on the host's cores, and their states compared (docs/codec.md, "Half-integer K").

    python3 benchmarks/frac_speed_probe.py [--tiles 512]
"""
from __future__ import annotations

import argparse
import time

import torch

from fq.codec.viterbi import viterbi, viterbi_gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=512)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(3)
    for K in (1.5, 2.5, 3.5, 2):
        x = torch.randn(a.tiles, 256, generator=g)
        viterbi_gpu(x[:8], K, "mul1", "cuda")
        torch.cuda.synchronize()
        t = time.time()
        s = viterbi_gpu(x, K, "mul1", "cuda")
        torch.cuda.synchronize()
        dt = time.time() - t
        t = time.time()
        c = viterbi(x, K, "mul1")
        dc = time.time() - t
        print(f"K {K}: {torch.cuda.get_device_name(0)} {a.tiles / dt:.0f} tiles/s; C kernel on "
              f"{torch.get_num_threads()} threads {a.tiles / dc:.0f} tiles/s; same states {torch.equal(s.cpu(), c)}",
              flush=True)


if __name__ == "__main__":
    main()
