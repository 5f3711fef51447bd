"""Exact matrix products: float64 GEMMs whose result cannot depend on the summation order.

A float64 GEMM (CPU BLAS of any ISA, cuBLAS DGEMM, with or without FMA, any blocking or split-K) sums its
products in an order of its own choosing, so in general its last bits depend on the library, the vector width
and the thread count. Here the operands are first rounded onto fixed binary grids: each operand is written as
``parts[0] + parts[1]*2^-bits + ...`` times a power-of-two ``unit``, every part an integer-valued float64 with
``|part| <= 2^bits``. For an inner dimension q the two operands' bits satisfy

    bits_a + bits_b + ceil(log2 q) <= 53,

so every product of two parts is an integer of magnitude <= 2^(bits_a + bits_b) and every partial sum of q of
them is an integer of magnitude <= 2^53: all are exactly representable, no addition ever rounds, and any order
(or FMA) gives the same, exact integer. ``grid_mm`` asserts the bound. The part products are then scaled by
powers of two (exact) and added in one fixed order (elementwise float64 adds, which round the same on every
device), so the result is the same bits on every CPU and GPU. Which grid an operand gets (``unit``) is decided
by its largest magnitude, and a max is exact in any order.

More parts give more precision (an Ozaki-style split): with parts (2, 2) the products of parts s, t with
s + t <= 1 are kept (three GEMMs), which carries about 2 * min(bits) significant bits of each operand relative
to its largest entry.

Requirements on the GEMM: a conventional algorithm (every output a sum of the q products; no Strassen or
Winograd, whose intermediate sums would exceed the bound) in native float64 (cuBLAS's optional FP64 emulation on
integer tensor cores is not supported). Units must stay in the normal float64 range (|exponent| < 1000), which
``split`` checks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

MANTISSA = 53


def pow2(e: torch.Tensor) -> torch.Tensor:
    """2.0**e (int64 tensor, |e| <= 1022) as float64, built from the exponent bits (exact on every device)."""
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def ceil_log2(q: int) -> int:
    return max(int(q) - 1, 0).bit_length()


def budget(q: int) -> int:
    """Bits two operands of an exact product with inner dimension q may carry together."""
    return MANTISSA - ceil_log2(q)


@dataclass
class Grid:
    """An operand on a grid: value = sum_s parts[s] * 2^(-bits*s) * unit. ``unit``: float64 powers of two,
    broadcastable against the parts (one per batch element of a batched operand)."""

    parts: list
    unit: torch.Tensor
    bits: int

    def t(self) -> "Grid":
        return Grid([p.transpose(-2, -1) for p in self.parts], self.unit, self.bits)

    def rows(self, a: int, b: int) -> "Grid":
        return Grid([p[..., a:b, :] for p in self.parts], self.unit, self.bits)

    def cols(self, a: int, b: int) -> "Grid":
        return Grid([p[..., :, a:b] for p in self.parts], self.unit, self.bits)

    def value(self) -> torch.Tensor:
        """The rounded operand as float64 (exact for parts of up to 53 - bits*(n-1) significant bits)."""
        acc = None
        for s in range(len(self.parts) - 1, -1, -1):
            term = self.parts[s] * (2.0 ** (-self.bits * s))
            acc = term if acc is None else acc + term
        return acc * self.unit


def split(x: torch.Tensor, bits: int, parts: int = 1, batch_dims: int = 0, check: bool = True,
          peak: torch.Tensor | None = None) -> Grid:
    """Round x (float64) onto a grid: parts[0] = round(x * 2^(bits - e)) where max|x| < 2^e (taken per batch
    element over the trailing dims, for the first ``batch_dims`` dims), then each further part rounds the
    remainder times 2^bits. |parts[0]| <= 2^bits, |parts[s >= 1]| <= 2^(bits - 1). torch.round is exact
    (half to even) and x - round(x) is exact, so the parts are the same bits on every device. ``check``
    refuses non-finite or out-of-range operands (a device sync; hot loops whose operands are known finite
    skip it). ``peak``: the max |x| to take the grid from instead of x's own (a slice of a larger operand split
    on the whole operand's grid: fq.codec.chunked), shaped as x.abs().amax(trailing dims, keepdim=True)."""
    if x.dtype != torch.float64:
        raise TypeError(f"split: expected float64, got {x.dtype}")
    if not 1 <= bits <= 52 or parts < 1:
        raise ValueError(f"split: bits {bits}, parts {parts}")
    dims = tuple(range(batch_dims, x.dim()))
    if peak is None:
        peak = x.abs().amax(dim=dims, keepdim=True) if dims else x.abs()
    _, e = torch.frexp(peak)  # peak = m * 2^e, 0.5 <= m < 1 (e = 0 for peak = 0): peak < 2^e
    e = e.to(torch.int64)
    if check and (not bool(torch.isfinite(peak).all()) or bool(((e.abs() > 900) & (peak > 0)).any())):
        raise ValueError("split: operand contains NaN or Inf, or magnitudes outside 2^-900 .. 2^900")
    up = pow2(bits - e)
    y = x * up  # exact (power of two), |y| < 2^bits
    out = []
    for s in range(parts):
        p = torch.round(y)
        out.append(p)
        if s + 1 < parts:
            y = (y - p) * float(2**bits)  # y - p exact (|y| < 2^52), times a power of two exact
    return Grid(out, pow2(e - bits), bits)


def grid_mm(a: Grid, b: Grid) -> torch.Tensor:
    """a @ b for two grid operands: every kept part product is an exact integer GEMM (see the module
    docstring); they are scaled and added smallest first in a fixed order. Batched operands (..., p, q) @
    (..., q, r) work as torch.matmul. Parts s, t are kept when s + t < max(len(a.parts), len(b.parts))."""
    q = a.parts[0].shape[-1]
    if b.parts[0].shape[-2] != q:
        raise ValueError(f"grid_mm: inner dimensions {q} and {b.parts[0].shape[-2]}")
    need = a.bits + b.bits + ceil_log2(q)
    assert need <= MANTISSA, f"grid_mm: {a.bits} + {b.bits} bits with inner dimension {q} need {need} > 53"
    n = max(len(a.parts), len(b.parts))
    pairs = [(s, t) for s in range(len(a.parts)) for t in range(len(b.parts)) if s + t < n]
    pairs.sort(key=lambda st: (-(st[0] + st[1]), st[0]))  # smallest terms first, a fixed order
    acc = None
    for s, t in pairs:
        term = torch.matmul(a.parts[s], b.parts[t])  # exact: integers, every partial sum <= 2^53
        if s or t:
            term = term * (2.0 ** (-(a.bits * s + b.bits * t)))
        acc = term if acc is None else acc + term
    return acc * (a.unit * b.unit)


def exact_mm(x: torch.Tensor, y: torch.Tensor, parts_x: int = 1, parts_y: int = 1, batch_dims: int = 0,
             bits_x: int | None = None) -> torch.Tensor:
    """x @ y (float64) through grids, splitting the bit budget of the inner dimension between the operands
    (``bits_x`` for x, the rest for y; default half each)."""
    total = budget(x.shape[-1])
    bx = total // 2 if bits_x is None else int(bits_x)
    return grid_mm(split(x, bx, parts_x, batch_dims), split(y, total - bx, parts_y, batch_dims))


def max_bits(q: int, other: int) -> int:
    """Bits left for one operand when the other carries ``other`` bits, inner dimension q."""
    b = budget(q) - other
    if b < 1:
        raise ValueError(f"no bits left for inner dimension {q}")
    return b


__all__ = ["Grid", "split", "grid_mm", "exact_mm", "pow2", "budget", "ceil_log2", "max_bits"]
