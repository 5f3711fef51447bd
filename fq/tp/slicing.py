"""Cutting one EXL3 linear along output or input channels without re-quantization.

The EXL3 tensors of a torch weight ``W (out, in)`` are ``trellis (in/16, out/16, 16K)`` — one row of
16x16 tiles per 16 input channels, one column per 16 output channels — ``suh (in,)`` and ``svh (out,)``.
The reconstruction ``W^T = had_rows(had_cols(decode(trellis)) * suh) * svh`` mixes values only inside
128-blocks of rows (``had_cols``) and of columns (``had_rows``), and every tile decodes on its own. So
for a, b multiples of 128:

- output split ``W[a:b, :]``: ``trellis[:, a/16:b/16]``, ``svh[a:b]``, ``suh`` whole;
- input split ``W[:, a:b]``: ``trellis[a/16:b/16]``, ``suh[a:b]``, ``svh`` whole;

and ``reconstruct`` of the cut set is bit-identical to the same rows/columns of the whole
reconstruction (the same float operations on the same values; ``tests/test_tp_slicing.py``).
"""
from __future__ import annotations

import torch

from fq.errors import FqError
from fq.tp.manifest import HAD
from fq.tp.mesh import Slice

TILE = 16
SUFFIX_ORDER = ("trellis", "suh", "svh", "mul1", "mcg")  # an EXL3 set's tensors, in the order fq's files store them


def check_slice(sl: Slice, n: int, where: str, exl3: bool = True) -> None:
    if sl.dim not in (0, 1) or not 0 <= sl.start < sl.stop <= n:
        raise FqError(f"{where}: slice {sl.describe()} is not inside [0, {n})")
    if exl3 and (sl.start % HAD or sl.stop % HAD):
        raise FqError(f"{where}: slice {sl.describe()} does not cut whole {HAD}-blocks (EXL3 Hadamard blocks)")


def slice_exl3(tensors: dict, sl: Slice | None, where: str = "linear") -> dict:
    """The tensor set of ``W[a:b, :]`` (dim 0) or ``W[:, a:b]`` (dim 1); contiguous copies, markers kept."""
    if sl is None:
        return {k: v.contiguous() for k, v in tensors.items()}
    tr = tensors["trellis"]
    n_in, n_out = tr.shape[0] * TILE, tr.shape[1] * TILE
    check_slice(sl, n_out if sl.dim == 0 else n_in, where)
    a, b = sl.start, sl.stop
    out = {k: v.contiguous() for k, v in tensors.items() if k not in ("trellis", "suh", "svh")}
    if sl.dim == 0:
        out.update(trellis=tr[:, a // TILE:b // TILE].contiguous(), suh=tensors["suh"].contiguous(),
                   svh=tensors["svh"][a:b].contiguous())
    else:
        out.update(trellis=tr[a // TILE:b // TILE].contiguous(), suh=tensors["suh"][a:b].contiguous(),
                   svh=tensors["svh"].contiguous())
    return out


def slice_dense(t: torch.Tensor, sl: Slice | None, where: str = "tensor") -> torch.Tensor:
    if sl is None:
        return t.contiguous()
    check_slice(sl, t.shape[sl.dim], where, exl3=False)
    return (t[sl.start:sl.stop] if sl.dim == 0 else t[:, sl.start:sl.stop]).contiguous()


def sliced_shape(shape: tuple[int, ...], sl: Slice | None) -> tuple[int, ...]:
    if sl is None:
        return tuple(shape)
    s = list(shape)
    s[sl.dim] = sl.stop - sl.start
    return tuple(s)


def assemble(parts: list[tuple[Slice | None, torch.Tensor]]) -> torch.Tensor:
    """Put per-rank pieces of one weight back together (pieces of a replicated weight must agree)."""
    if not parts:
        raise FqError("assemble: no pieces")
    if parts[0][0] is None:
        return parts[0][1]
    dim = parts[0][0].dim
    return torch.cat([t for _, t in sorted(parts, key=lambda p: p[0].start)], dim=dim)
