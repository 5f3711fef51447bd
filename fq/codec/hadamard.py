"""Blockwise 128-point normalized Sylvester Hadamard transform.

Computed as the reference kernel does: a float32 butterfly (lo+hi, lo-hi) over index bits from the lowest
to the highest, then one multiply by float32(1/sqrt(128)). Elementwise adds in a fixed order give the same
bits on CPU and CUDA, which a matmul (BLAS-dependent summation order) would not.
"""
from __future__ import annotations

import math

import torch

from fq.codec.shape import PAD

HAD = PAD  # the Hadamard block, which every stored EXL3 dim is padded to (fq.codec.shape)
_INV_SQRT = 1.0 / math.sqrt(HAD)


def _fwht_last(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized FWHT over the last dim (length 128), float32, bit order low to high."""
    lead = x.shape[:-1]
    for h in (1, 2, 4, 8, 16, 32, 64):
        v = x.reshape(*lead, HAD // (2 * h), 2, h)
        lo, hi = v[..., 0, :], v[..., 1, :]
        x = torch.stack((lo + hi, lo - hi), dim=-2).reshape(*lead, HAD)
    return x


def had_rows(x: torch.Tensor) -> torch.Tensor:
    """Each row's consecutive 128-element blocks times H128/sqrt(128) (x @ blockdiag(H)).

    float64 stays float64 (regularization); anything else is computed in float32 like the kernel."""
    k, n = x.shape
    if n % HAD:
        raise ValueError(f"had_rows: width {n} is not a multiple of {HAD}")
    dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    y = _fwht_last(x.to(dtype).reshape(k, n // HAD, HAD))
    # one multiply by the scale rounded to the working precision, as the kernel's float r_scale
    return (y * torch.tensor(_INV_SQRT, dtype=dtype, device=y.device)).reshape(k, n)


def had_cols(x: torch.Tensor) -> torch.Tensor:
    """blockdiag(H) @ x: the same transform applied down each column in blocks of 128 rows."""
    return had_rows(x.t()).t()
