"""Tiles per second of the half-integer Viterbi on a CUDA device (the torch frac path: fq.codec.viterbi._frac_chunk)
against the C kernel on the host's cores, and their states compared (docs/codec.md, "Half-integer K").

    python3 benchmarks/frac_speed_probe.py [--tiles 512] [--choice FILE]

--choice FILE writes ``cpu`` or ``device``: which of the two is faster at K 1.5 (the value for FQ_VITERBI_FRAC,
fq.codec.viterbi). The C kernel is timed first, so a torch path too slow to finish under a timeout leaves no file.
"""
from __future__ import annotations

import argparse
import time

import torch

from fq.codec.viterbi import viterbi, viterbi_gpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=512)
    ap.add_argument("--choice", help="write cpu or device here: the faster at K 1.5")
    a = ap.parse_args()
    g = torch.Generator().manual_seed(3)
    for K in (1.5, 2.5, 3.5, 2):
        x = torch.randn(a.tiles, 256, generator=g)
        t = time.time()
        c = viterbi(x, K, "mul1")
        dc = time.time() - t
        print(f"K {K}: C kernel on {torch.get_num_threads()} threads {a.tiles / dc:.0f} tiles/s", flush=True)
        viterbi_gpu(x[:8], K, "mul1", "cuda")
        torch.cuda.synchronize()
        t = time.time()
        s = viterbi_gpu(x, K, "mul1", "cuda")
        torch.cuda.synchronize()
        dt = time.time() - t
        if K == 1.5 and a.choice:
            with open(a.choice, "w") as f:
                f.write("cpu\n" if dc < dt else "device\n")
        print(f"K {K}: {torch.cuda.get_device_name(0)} {a.tiles / dt:.0f} tiles/s; C kernel on "
              f"{torch.get_num_threads()} threads {a.tiles / dc:.0f} tiles/s; same states {torch.equal(s.cpu(), c)}",
              flush=True)


if __name__ == "__main__":
    main()
