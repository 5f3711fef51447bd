"""Half-integer K beside the integer rates: Gaussian-tile MSE and CPU Viterbi speed per K (mul1 codebook).

The same seeded N(0,1) tiles are coded at K = 1, 1.5, 2, 2.5, 3, 3.5, 4, each at its best scale (a coarse grid on a
quarter of the tiles, then a fine one on all), reported as MSE and as its ratio to the rate-distortion bound 2^-2K;
then the C kernel's tiles/s on one thread (the ISA it dispatches to is printed).

    .venv/bin/python benchmarks/frac_quality.py [--tiles 256] [--speed-tiles 64] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from fq.codec.codebook import values_torch
from fq.codec.viterbi import _trellis, viterbi

KS = (1, 1.5, 2, 2.5, 3, 3.5, 4)


def best_mse(tiles: torch.Tensor, K, scales: list[float]) -> tuple[float, float]:
    batch = torch.cat([tiles * s for s in scales])
    q = values_torch("mul1")[viterbi(batch, K, "mul1").long()].double().reshape(len(scales), *tiles.shape)
    s = torch.tensor(scales, dtype=torch.float64)[:, None, None]
    mse = ((q / s - tiles.double()[None]) ** 2).mean(dim=(1, 2))
    b = int(mse.argmin())
    return scales[b], float(mse[b])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiles", type=int, default=256)
    ap.add_argument("--speed-tiles", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    tiles = torch.randn(args.tiles, 256, generator=torch.Generator().manual_seed(1234))
    rows = []
    for K in KS:
        c, _ = best_mse(tiles[::4], K, [0.7 + 0.05 * i for i in range(11)])
        s, mse = best_mse(tiles, K, [round(c + 0.0125 * i, 4) for i in range(-3, 4)])
        x = tiles[: args.speed_tiles] * s
        viterbi(x[:2], K, "mul1", threads=1)  # warm-up
        t0 = time.perf_counter()
        viterbi(x, K, "mul1", threads=1)
        dt = time.perf_counter() - t0
        rows.append(dict(K=K, best_scale=s, mse=mse, ratio_to_2pow_m2K=mse / 2.0 ** (-2 * K),
                         tiles_per_s_1thread=x.shape[0] / dt, ms_per_tile=1e3 * dt / x.shape[0]))
    out = dict(isa=_trellis.isa(), tiles=args.tiles, speed_tiles=args.speed_tiles, seed=1234, rows=rows)
    print(f"ISA {out['isa']}, {args.tiles} N(0,1) tiles (seed 1234), mul1")
    print(f"{'K':>4} {'scale':>7} {'MSE':>9} {'MSE/2^-2K':>10} {'tiles/s':>8} {'ms/tile':>8}")
    for r in rows:
        print(f"{r['K']:>4} {r['best_scale']:>7.4f} {r['mse']:>9.5f} {r['ratio_to_2pow_m2K']:>10.4f} "
              f"{r['tiles_per_s_1thread']:>8.0f} {r['ms_per_tile']:>8.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
