"""A small codec demonstration (it was `make demo` until the Snakemake workflow landed): encode one
expert-shaped matrix at K=2 and K=3, a K=1 residual stage on the K=2 base, and print what each costs
in bits per weight and what it achieves in relative MSE.

    .venv/bin/python tools/demo_codec.py
"""
from __future__ import annotations

import time

import torch

from fq.codec import encode, encode_residual, reconstruct_chain


def main() -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(256, 512, generator=g) ** 3 * (0.5 + torch.rand(256, 1, generator=g)) * 0.01
    rows = []
    t0 = time.perf_counter()
    k2 = encode(W, 2, "mul1", seed=1)
    rows.append(("k2", 2, k2.rel_mse))
    k3 = encode(W, 3, "mul1", seed=1)
    rows.append(("k3", 3, k3.rel_mse))
    r1 = encode_residual(W, [k2.tensors], 1, "mul1", seed=2)
    chain = reconstruct_chain([k2.tensors, r1.tensors])
    rows.append(("k2 + r1", 3, float(((chain - W) ** 2).sum() / (W**2).sum())))
    print(f"{'product':10} {'bpw':>4} {'rel. MSE':>10}")
    for name, bpw, mse in rows:
        print(f"{name:10} {bpw:>4} {mse:>10.5f}")
    print(f"encoded a 256x512 matrix three times in {time.perf_counter() - t0:.1f} s")


if __name__ == "__main__":
    main()
