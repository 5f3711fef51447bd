"""The EXL3 tensor set of one linear, its validation, and its reconstruction.

A torch Linear weight W is (out, in). EXL3 stores ``trellis`` int16 (in/16, out/16, 16K), ``suh`` fp16
(in,), ``svh`` fp16 (out,) and a scalar int32 marker ``mcg`` or ``mul1`` (none for 3INST).
W^T = had_rows(had_cols(decode(trellis)) * suh) * svh, in float32 with fp32 butterflies (fq.codec.hadamard),
so the reconstruction is the same bits on every device.

A matrix whose dims are not multiples of 128 is stored zero-padded to them (``fq.codec.shape``): the tensors give the
padded reconstruction, and ``reconstruct(..., shape=(out, in))`` checks that the stored dims are ``shape``'s padded
dims and trims the reconstruction to ``shape``, as exllamav3 zero-extends the input and trims the output.

Half-integer K (a trellis of 16*K = 24, 40 or 56 words with the mul1 marker, exllamav3's ``frac_k`` rates) is
decoded by ``decode_inner``; Geometry.K is then the float.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fq.codec import rate
from fq.codec.codebook import MARKERS, marker_value, values_torch
from fq.codec.hadamard import HAD, had_cols, had_rows
from fq.codec.packing import tiles_to_matrix, unpack
from fq.codec.shape import padded_shape
from fq.errors import FqError

TENSOR_KEYS = ("trellis", "suh", "svh")
MARKER_KEYS = tuple(MARKERS)


@dataclass(frozen=True)
class Geometry:
    K: int | float  # a float only for a half-integer rate
    codebook: str
    in_features: int
    out_features: int


def _where(name: str, key: str) -> str:
    return f"{name}.{key}" if name else key


def validate_tensors(tensors: dict, name: str = "", K=None, codebook: str | None = None) -> Geometry:
    """Check one linear's EXL3 tensor set; ``name`` prefixes every error. Optional K/codebook must match."""
    if not isinstance(tensors, dict):
        raise FqError(f"{name or 'tensors'}: expected a dict of tensors, got {type(tensors).__name__}")
    for key in TENSOR_KEYS:
        if key not in tensors:
            raise FqError(f"{_where(name, key)}: missing (an EXL3 linear needs trellis, suh and svh)")
    unknown = set(tensors) - set(TENSOR_KEYS) - set(MARKER_KEYS)
    if unknown:
        raise FqError(f"{name or 'tensors'}: unexpected keys {sorted(unknown)}")
    markers = [m for m in MARKER_KEYS if m in tensors]
    if len(markers) > 1:
        raise FqError(f"{name or 'tensors'}: both mcg and mul1 markers present; expected at most one")
    found_cb = markers[0] if markers else "3inst"
    if markers:
        m = tensors[found_cb]
        if not isinstance(m, torch.Tensor) or m.dtype != torch.int32 or m.dim() != 0:
            raise FqError(f"{_where(name, found_cb)}: expected a scalar int32 marker tensor")
        if int(m) != marker_value(found_cb):
            raise FqError(f"{_where(name, found_cb)}: marker value {int(m) & 0xFFFFFFFF:#010x}, expected {MARKERS[found_cb]:#010x}")
    if codebook is not None and codebook != found_cb:
        raise FqError(f"{name or 'tensors'}: codebook is {found_cb} by its marker, expected {codebook}")

    tr, suh, svh = tensors["trellis"], tensors["suh"], tensors["svh"]
    if not isinstance(tr, torch.Tensor) or tr.dtype != torch.int16 or tr.dim() != 3:
        raise FqError(f"{_where(name, 'trellis')}: expected int16 (in/16, out/16, 16*K), got {_desc(tr)}")
    last = tr.shape[2]
    found_K = rate.k_from_words(last, found_cb)
    if found_K is None:
        why = (f" (the half-integer rate K={last / 16} is mul1's only)" if last / 16 in rate.HALF_KS else "")
        raise FqError(f"{_where(name, 'trellis')}: last dimension {last} is not 16*K for K in 1..8 or a "
                      f"half-integer K 1.5, 2.5, 3.5 (mul1){why}")
    if K is not None and K != found_K:
        raise FqError(f"{_where(name, 'trellis')}: last dimension {last} means K={found_K}, expected K={K} "
                      f"(16*K={rate.tile_words(K)})")
    in_f, out_f = tr.shape[0] * 16, tr.shape[1] * 16
    if in_f % HAD or out_f % HAD or in_f == 0 or out_f == 0:
        raise FqError(f"{_where(name, 'trellis')}: shape {tuple(tr.shape)} gives in={in_f}, out={out_f}; both must be positive multiples of {HAD}")
    for key, t, size in (("suh", suh, in_f), ("svh", svh, out_f)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.float16 or tuple(t.shape) != (size,):
            raise FqError(f"{_where(name, key)}: expected float16 ({size},), got {_desc(t)}")
        if not torch.isfinite(t).all():
            raise FqError(f"{_where(name, key)}: contains NaN or Inf")
    return Geometry(found_K, found_cb, in_f, out_f)


def _desc(t) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {tuple(t.shape)}"
    return type(t).__name__


def decode_inner(trellis: torch.Tensor, K, codebook: str) -> torch.Tensor:
    """The rotated inner weight (in, out) as float32 (exact fp16 codebook values), on trellis's device.
    K: an int, or a half-integer float (mul1 only)."""
    if isinstance(K, float):
        rate.check_k(K, codebook)
    states = unpack(trellis, K)
    v = values_torch(codebook, trellis.device)
    return tiles_to_matrix(v[states.long()])


def unrotate(inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor) -> torch.Tensor:
    """(in, out) rotated weight + fp16 scales -> dense float32 W (out, in)."""
    x = had_cols(inner.float()) * suh.float()[:, None]
    return (had_rows(x) * svh.float()[None, :]).t().contiguous()


def trim(W: torch.Tensor, shape) -> torch.Tensor:
    """W's leading ``shape`` block (a padded matrix's real rows and columns), contiguous; W itself when it is that
    shape."""
    if shape is None or tuple(W.shape) == tuple(shape):
        return W
    return W[: shape[0], : shape[1]].contiguous()


def check_stored(stored, shape, name: str = "") -> None:
    """A linear's stored (out, in) must be the padded dims of its matrix's (out, in) ``shape``."""
    out_f, in_f = shape
    want = padded_shape((out_f, in_f))
    if tuple(stored) != want:
        how = f", stored zero-padded to (out, in) = {want}" if want != (out_f, in_f) else ""
        raise FqError(f"{name or 'tensors'}: stored (out, in) = {tuple(stored)}; its matrix is (out, in) = "
                      f"({out_f}, {in_f}){how}")


def reconstruct(tensors: dict, name: str = "", shape=None) -> torch.Tensor:
    """The dense (out, in) float32 weight of one EXL3 linear: the stored (padded) shape, or with ``shape`` (its
    matrix's own (out, in)) the stored dims checked to be ``shape``'s padded dims and the reconstruction trimmed
    to ``shape``."""
    g = validate_tensors(tensors, name)
    if shape is not None:
        check_stored((g.out_features, g.in_features), shape, name)
    inner = decode_inner(tensors["trellis"], g.K, g.codebook)
    return trim(unrotate(inner, tensors["suh"].to(inner.device), tensors["svh"].to(inner.device)), shape)


def reconstruct_chain(chain: list[dict], name: str = "", shape=None) -> torch.Tensor:
    """Sum of the reconstructions of a base and its stages, added in chain order (at the stored shape; trimmed to
    ``shape`` as ``reconstruct`` trims, the sum taken on the stored shape first)."""
    if not chain:
        raise FqError(f"{name or 'chain'}: empty chain; expected a base and zero or more stages")
    total = None
    stored = None
    for i, tensors in enumerate(chain):
        where = f"{name}[{i}]" if name else f"chain[{i}]"
        w = reconstruct(tensors, where)
        if shape is not None:
            check_stored(w.shape, shape, where)
        if stored is not None and w.shape != stored:
            raise FqError(f"{name or 'chain'}[{i}]: shape {tuple(w.shape)} differs from the base's {tuple(stored)}")
        stored = w.shape
        total = w if total is None else total + w
    return trim(total, shape)
