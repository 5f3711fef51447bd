"""Codec quality and CPU speed: MSE of Gaussian tiles against the rate-distortion bound D(R) = 2^-2K.

For each codebook and K the tiles (i.i.d. N(0,1)) are coded at a grid of scales around the best one and
the lowest MSE is reported with its ratio to D(R), beside the reference kernel's ratio on an H200
(../shared/anchors). Then tiles/s of the encoder's Viterbi search per K, for 1 and all threads.

    .venv/bin/python benchmarks/codec_quality.py [--tiles 256] [--device cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch
from tqdm import tqdm

from fq.codec.codebook import CODEBOOKS, values_torch
from fq.codec.viterbi import viterbi

# exllamav3 1.6.5 on an H200, Gaussian ratio MSE / 2^-2K (shared/anchors/exllamav3-1.6.5-h200.json)
REFERENCE = {
    "3inst": {1: 1.0646, 2: 1.0992, 3: 1.1332, 4: 1.1771},
    "mcg": {1: 1.0639, 2: 1.0928, 3: 1.1116, 4: 1.1566},
    "mul1": {1: 1.0858, 2: 1.0915, 3: 1.1098, 4: 1.1362},
}


def gaussian_mse(tiles, K, cb, device, scales):
    batch = torch.cat([tiles * s for s in scales])
    q = values_torch(cb)[viterbi(batch, K, cb, device).long()].double().reshape(len(scales), *tiles.shape)
    s = torch.tensor(scales, dtype=torch.float64)[:, None, None]
    mse = ((q / s - tiles.double()[None]) ** 2).mean(dim=(1, 2))
    best = int(mse.argmin())
    return scales[best], float(mse[best])


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--speed-tiles", type=int, default=256)
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args()
    g = torch.Generator().manual_seed(1234)
    tiles = torch.randn(args.tiles, 256, generator=g)
    var = float(tiles.double().square().mean())
    rows = []
    jobs = [(cb, K) for cb in CODEBOOKS for K in (1, 2, 3, 4)]
    for cb, K in tqdm(jobs, desc="gaussian D(R)", unit="case"):
        # coarse then fine: the MSE curve is flat near its minimum
        coarse = [0.6 + 0.1 * i for i in range(11)]
        c, _ = gaussian_mse(tiles[::4], K, cb, args.device, coarse)
        fine = [round(c + 0.025 * i, 4) for i in range(-4, 5)]
        s, mse = gaussian_mse(tiles, K, cb, args.device, fine)
        bound = 2.0 ** (-2 * K)
        # a finite sample's own variance moves every ratio together; the second ratio divides it out
        rows.append(dict(codebook=cb, K=K, best_scale=s, mse=mse, ratio=mse / bound,
                         ratio_sample_var=mse / (bound * var), reference_ratio=REFERENCE[cb][K]))
    print(f"\nGaussian tiles: {args.tiles} x 256, device {args.device}, sample variance {var:.5f}")
    print(f"{'codebook':8} {'K':>2} {'scale':>6} {'MSE':>10} {'MSE/D(R)':>9} {'/var':>7} {'reference':>9}")
    for r in rows:
        print(f"{r['codebook']:8} {r['K']:>2} {r['best_scale']:>6.3f} {r['mse']:>10.6f} {r['ratio']:>9.4f} "
              f"{r['ratio_sample_var']:>7.4f} {r['reference_ratio']:>9.4f}")

    speed = []
    x = torch.randn(args.speed_tiles, 256, generator=g)
    threads = [1, os.cpu_count() or 1] if args.device == "cpu" else [None]
    for K in (1, 2, 3, 4, 8):
        for th in threads:
            viterbi(x[:4], K, "mul1", args.device, threads=th)  # warm up
            t0 = time.perf_counter()
            viterbi(x, K, "mul1", args.device, threads=th)
            dt = time.perf_counter() - t0
            speed.append(dict(K=K, threads=th, tiles_per_s=args.speed_tiles / dt))
    print(f"\nViterbi speed (mul1, {args.speed_tiles} tiles, device {args.device})")
    for r in speed:
        print(f"K={r['K']}  threads={r['threads']}  {r['tiles_per_s']:.1f} tiles/s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(dict(gaussian=rows, speed=speed), fh, indent=1)


if __name__ == "__main__":
    main()
