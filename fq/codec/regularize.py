"""Regularization of a weight before trellis coding (weight-only MSE, no Hessian).

Follows the reference's fallback path: random signs and RMS scales on output channels, 128-blocked
Hadamard on rows, random signs and RMS scales on input channels (with the codebook's scale), Hadamard
on columns, then a global scale. Runs on the weight's device in float64 with elementwise operations and
fq.codec.exact's fixed-order sums only, so the CPU and CUDA encoders see the same tiles. Signs come from
SHAKE-256 of the seed: a fully specified stream (computed on the CPU, then moved).
"""
from __future__ import annotations

import hashlib

import torch

from fq.codec.exact import div, sqrt, tree_sum
from fq.codec.hadamard import had_cols, had_rows

CODEBOOK_SCALE = 1.24371088  # the reference's target RMS of regularized tiles
ZERO = 1e-30


def signs(seed: int, which: str, n: int) -> torch.Tensor:
    """n values of +-1.0 (float64, CPU) from SHAKE-256('fq-signs/{seed}/{which}')."""
    raw = hashlib.shake_256(f"fq-signs/{int(seed)}/{which}".encode()).digest((n + 7) // 8)
    bits = torch.tensor(list(raw), dtype=torch.uint8)
    bits = ((bits[:, None] >> torch.arange(8, dtype=torch.uint8)) & 1).flatten()[:n]
    return 1.0 - 2.0 * bits.to(torch.float64)


def rms(x: torch.Tensor, dim: int) -> torch.Tensor:
    return sqrt(div(tree_sum(x * x, dim), x.shape[dim]))


def regularize(Wt: torch.Tensor, seed: int):
    """Wt: (in, out) float64 on any device. Returns (rotated (in, out) float64, su (in,), sv (out,)) before
    the global scale, on Wt's device. Zero output/input channels get a zero scale, so they reconstruct to
    exactly zero."""
    k, n = Wt.shape
    su_sign, sv_sign = signs(seed, "su", k).to(Wt.device), signs(seed, "sv", n).to(Wt.device)

    out_scales = rms(Wt, 0)
    mean = div(tree_sum(out_scales, 0), n)
    if mean > ZERO:
        out_scales = out_scales / mean
    zero_out = out_scales < ZERO
    out_scales = torch.where(zero_out, torch.full_like(out_scales, 0.1), out_scales)
    sv = sv_sign * out_scales
    x = had_rows(Wt / sv[None, :])

    in_scales = rms(x, 1)
    zero_in = in_scales < ZERO
    in_scales = torch.where(zero_in, torch.full_like(in_scales, 0.1), in_scales)
    su = div(su_sign * in_scales, -CODEBOOK_SCALE)
    x = had_cols(x / su[:, None])

    sv = torch.where(zero_out, torch.zeros_like(sv), sv)
    su = torch.where(zero_in, torch.zeros_like(su), su)
    return x, su, sv
