"""Random weights with a trained model's structure, and DeepSeek's FP8 block quantizer, for synthetic checkpoints.

A random i.i.d. Gaussian matrix has a flat spectrum and a random model's activations have channels all alike, so an
input Hessian is close to a multiple of the identity and LDLQ (and calibration) have nothing to weigh. Here:

- ``trained_like(out, in, std, gen)``: W = U diag(s) V + noise, U (out, r) and V (r, in) standard normal, s_k ∝
  k^-alpha (a decaying spectrum: the low-rank part carries ``share`` of the energy), the noise the rest, and a few input
  columns (``outlier_cols``) scaled up, as trained linears read a few activation channels much harder. Entries have
  standard deviation ``std`` (before the outlier columns). The low-rank product is float64, so that a different BLAS
  (thread count, ISA) changes a value only below 1e-15 relative -- a byte of the bf16/fp8 result differs only when a
  value sits that close to a rounding boundary. Rows are made in fixed chunks (``CHUNK_ROWS``), independent of the
  machine, so the generator's draws are the same everywhere.
- ``norm_profile(n, gen)``: RMSNorm weights exp(U(-spread, spread)) with a few channels ``outlier_gain`` larger: the
  unequal channel magnitudes of a trained model's residual stream (``tests/kits/familykit.with_outlier_channels`` does
  the same to a built checkpoint).
- ``fp8_blocks(w, block)``: DeepSeek-V3's block quantizer (per block s = amax|w| / 448, zero blocks 1; q = w / s in
  e4m3), returning (q float8_e4m3fn, weight_scale_inv float32 (ceil(out/b0), ceil(in/b1))) -- what the published FP8
  checkpoints store, and what ``fq.model.formats.dequantize_fp8`` reads back (w ~ q * s).
- ``generator(seed, name)``: a torch generator seeded from (seed, tensor name), so every tensor is the same whatever
  order, chunking of the checkpoint or subset of it is written.

torch is imported inside the functions (``fq.model`` loads no torch at import).
"""
from __future__ import annotations

import hashlib
import math

FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
CHUNK_ROWS = 4096  # rows made at a time: bounds memory (a 154880 x 6144 head) and fixes the draw order
RANK, ALPHA, SHARE = 64, 1.0, 0.6  # low-rank part: rank, spectrum decay, share of the energy
OUTLIER_COL_FRACTION, OUTLIER_COL_GAIN = 1 / 256, 4.0


def generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"fq-synth/{seed}/{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _spectrum(r: int, std: float, share: float, alpha: float):
    import torch

    s = torch.arange(1, r + 1, dtype=torch.float64) ** -alpha
    # an entry of U diag(s) V has variance sum(s^2): scale so the low-rank part has variance share * std^2
    return s * (math.sqrt(share) * std / float(s.square().sum().sqrt()))


def trained_like_chunks(out: int, inp: int, std: float, gen, *, rank: int = RANK, alpha: float = ALPHA,
                        share: float = SHARE, outlier_cols: float = OUTLIER_COL_FRACTION,
                        outlier_gain: float = OUTLIER_COL_GAIN):
    """Yield (row0, float32 rows) of an (out, inp) trained-like matrix, CHUNK_ROWS rows at a time (the module doc)."""
    import torch

    r = max(1, min(rank, out, inp))
    s = _spectrum(r, std, share, alpha)
    v = torch.randn(r, inp, generator=gen, dtype=torch.float64)
    n_out = max(1, round(inp * outlier_cols)) if outlier_cols > 0 else 0
    cols = torch.randperm(inp, generator=gen)[:n_out]
    col_gain = torch.ones(inp, dtype=torch.float32)
    col_gain[cols] = outlier_gain
    noise_std = math.sqrt(max(0.0, 1.0 - share)) * std
    for row0 in range(0, out, CHUNK_ROWS):
        rows = min(CHUNK_ROWS, out - row0)
        u = torch.randn(rows, r, generator=gen, dtype=torch.float64)
        w = ((u * s) @ v).to(torch.float32)
        w += torch.randn(rows, inp, generator=gen, dtype=torch.float32) * noise_std
        w *= col_gain
        yield row0, w


def trained_like(out: int, inp: int, std: float, gen, **kw):
    """The whole (out, inp) float32 matrix of ``trained_like_chunks``."""
    import torch

    return torch.cat([w for _, w in trained_like_chunks(out, inp, std, gen, **kw)])


def norm_profile(n: int, gen, *, spread: float = 0.5, outliers: int = 0, outlier_gain: float = 8.0):
    """float32 (n,) RMSNorm weights: exp(U(-spread, spread)), ``outliers`` channels times ``outlier_gain``."""
    import torch

    w = torch.exp((torch.rand(n, generator=gen, dtype=torch.float32) * 2 - 1) * spread)
    if outliers:
        w[torch.randperm(n, generator=gen)[:outliers]] *= outlier_gain
    return w


def fp8_blocks(w, block: tuple[int, int] = (128, 128)):
    """DeepSeek-V3's block quantizer: (q float8_e4m3fn (out, in), weight_scale_inv float32 (ceil(out/b0),
    ceil(in/b1))); a partial last block takes its own amax."""
    import torch

    b0, b1 = block
    rows, cols = w.shape
    gr, gc = -(-rows // b0), -(-cols // b1)
    x = w.float()
    if (rows, cols) != (gr * b0, gc * b1):
        pad = torch.zeros(gr * b0, gc * b1, dtype=torch.float32)
        pad[:rows, :cols] = x
        x = pad
    blocks = x.view(gr, b0, gc, b1)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(gr * b0, gc * b1)[:rows, :cols].contiguous(), scale.contiguous()
