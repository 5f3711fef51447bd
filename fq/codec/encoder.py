"""Weight-only EXL3 encoder: regularize, global scale search, exact tail-biting Viterbi, pack."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from fq.codec.codebook import CODEBOOKS, marker_value, values_torch
from fq.codec.hadamard import HAD
from fq.codec.packing import TILE, TILE_LEN, matrix_to_tiles, pack, tiles_to_matrix
from fq.codec.regularize import CODEBOOK_SCALE, regularize, seq_sum
from fq.codec.tensors import reconstruct_chain, unrotate
from fq.codec.viterbi import viterbi
from fq.errors import FqError

# Best scale for coding N(0,1) tiles, per codebook and K (benchmarks/codec_quality.py on 1024 tiles for
# K 1..4; K 5, 6, 8 from the reference anchors; K 7 interpolated). Regularized tiles have RMS
# CODEBOOK_SCALE, so best / CODEBOOK_SCALE is where the global scale search starts.
GAUSSIAN_BEST_SCALE = {
    "3inst": (1.425, 1.225, 1.175, 1.125, 1.1, 1.0, 0.975, 0.95),
    "mcg": (1.425, 1.225, 1.175, 1.125, 1.1, 1.0, 0.95, 0.9),
    "mul1": (1.125, 1.0, 0.925, 0.925, 0.9, 0.85, 0.8, 0.75),
}
SEARCH_STEP = 0.06  # relative spacing of the scale candidates
SEARCH_MAX_EVALS = 8


@dataclass
class Encoded:
    """One encoded linear: the EXL3 tensors plus what the encoder measured."""

    tensors: dict
    W_hat: torch.Tensor  # (out, in) float32: decode of these tensors, computed from the encoder's own states
    rel_mse: float  # sum((W_hat - W)^2) / sum(W^2); 0 for an all-zero W
    g_scale: float
    # the two float64 sums behind rel_mse (sequential sums over W in float64), so callers that report them
    # need not recompute them: sum(W^2) and sum((W_hat - W)^2), W the encoded target (the residual for a stage)
    sum_sq_w: float = 0.0
    sum_sq_err: float = 0.0


def check_args(W, K, codebook, seed, name: str = "W") -> torch.Tensor:
    if not isinstance(W, torch.Tensor):
        raise FqError(f"{name}: expected a torch.Tensor, got {type(W).__name__}")
    if W.dim() != 2 or not W.is_floating_point():
        raise FqError(f"{name}: expected a 2-D floating-point (out, in) weight, got {str(W.dtype).removeprefix('torch.')} {tuple(W.shape)}")
    out_f, in_f = W.shape
    if out_f == 0 or in_f == 0 or out_f % HAD or in_f % HAD:
        raise FqError(f"{name}: shape (out={out_f}, in={in_f}); both dims must be positive multiples of {HAD}")
    if isinstance(K, bool) or not isinstance(K, int) or not 1 <= K <= 8:
        raise FqError(f"K: expected an integer in 1..8, got {K!r}")
    if codebook not in CODEBOOKS:
        raise FqError(f"codebook: unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FqError(f"seed: expected a non-negative integer, got {seed!r}")
    W = W.detach().to("cpu", torch.float64)
    if not torch.isfinite(W).all():
        bad = (~torch.isfinite(W)).nonzero()[0].tolist()
        raise FqError(f"{name}: contains NaN or Inf (first at [{bad[0]}, {bad[1]}])")
    return W


def sample_tiles(x: torch.Tensor, width: int = 3) -> torch.Tensor:
    """Scale-search sample (as the reference): a wrapped diagonal of tiles `width` wide, which touches every
    tile row and column, plus the tiles of highest and lowest mean square. (m, 256) tensor-core tiles."""
    tiles = matrix_to_tiles(x)  # (tk, tn, 256)
    tk, tn = tiles.shape[:2]
    diag = max(tk, tn)
    ii = torch.arange(diag).repeat_interleave(width)
    ww = torch.arange(width).repeat(diag)
    kk, nn = ii % tk, (ii + ww) % tn
    ms = seq_sum(tiles.square(), 2).flatten()
    num_x = min(max(8, diag * width // 16), (ms.numel() + 1) // 2)
    order = torch.argsort(ms, stable=True)
    extreme = torch.cat((order.flip(0)[:num_x], order[:num_x]))
    kk = torch.cat((kk, extreme // tn))
    nn = torch.cat((nn, extreme % tn))
    return tiles[kk, nn]


def _tile_mse(tiles: torch.Tensor, scales, K, codebook, device) -> list[float]:
    """Mean squared error of coding tiles*s, measured back at scale 1, for each s (one batched search)."""
    batch = torch.cat([(tiles * s).to(torch.float32) for s in scales])
    states = viterbi(batch, K, codebook, device)
    q = values_torch(codebook)[states.long()].to(torch.float64)
    q = q.reshape(len(scales), *tiles.shape)
    s = torch.tensor(scales, dtype=torch.float64)[:, None, None]
    err = (q / s - tiles[None]).square().reshape(len(scales), -1)
    return (seq_sum(err, 1) / err.shape[1]).tolist()


def search_scale(x: torch.Tensor, K: int, codebook: str, device) -> float:
    """Global scale: candidates c*(1 +- SEARCH_STEP) around the Gaussian optimum c, walked outward while the
    best is at an edge, then a parabola (in log scale) through the best and its neighbours. Matches the
    reference's 15-point grid on the golden matrices with 3 evaluations of the sample instead of 8.3."""
    c = GAUSSIAN_BEST_SCALE[codebook][K - 1] / CODEBOOK_SCALE
    if not torch.any(x):
        return c  # an all-zero residual: every scale codes it equally (its scales are zero anyway)
    sample = sample_tiles(x)
    r = 1.0 + SEARCH_STEP
    scales = [c / r, c, c * r]
    mses = _tile_mse(sample, scales, K, codebook, device)
    while len(scales) < SEARCH_MAX_EVALS:
        b = int(np.argmin(mses))
        if b == 0:
            scales.insert(0, scales[0] / r)
            mses.insert(0, _tile_mse(sample, scales[:1], K, codebook, device)[0])
        elif b == len(scales) - 1:
            scales.append(scales[-1] * r)
            mses.append(_tile_mse(sample, scales[-1:], K, codebook, device)[0])
        else:
            break
    b = int(np.argmin(mses))
    offset = 0.0
    if 0 < b < len(scales) - 1:
        y0, y1, y2 = mses[b - 1], mses[b], mses[b + 1]
        denom = y0 - 2.0 * y1 + y2
        offset = max(-0.5, min(0.5, 0.5 * (y0 - y2) / denom)) if denom > 0 else 0.0
    return scales[b] * r**offset


def encode(W: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, device=None, *,
           timings: dict | None = None) -> Encoded:
    """Encode a torch Linear weight W (out, in). ``device``: None/"cpu" (C kernel) or a CUDA device (the
    Viterbi search runs there; regularization stays on the CPU, so both give the same trellis).
    ``timings``: if a dict, the wall seconds of each stage are added to it (check, regularize, search,
    viterbi, pack, reconstruct)."""
    clock = _Clock(timings)
    W64 = check_args(W, K, codebook, seed)
    clock("check")
    x, su, sv = regularize(W64.t(), seed)
    clock("regularize")
    g = search_scale(x, K, codebook, device)
    clock("search")
    x = x * g
    su = su / g
    tiles = matrix_to_tiles(x.to(torch.float32))
    tk, tn = tiles.shape[:2]
    states = viterbi(tiles.reshape(-1, TILE_LEN), K, codebook, device).reshape(tk, tn, TILE_LEN)
    clock("viterbi")
    tensors = {"trellis": pack(states, K), "suh": su.to(torch.float16), "svh": sv.to(torch.float16)}
    marker = marker_value(codebook)
    if marker is not None:
        tensors[codebook] = torch.tensor(marker, dtype=torch.int32)
    clock("pack")
    inner = tiles_to_matrix(values_torch(codebook)[states.long()])
    W_hat = unrotate(inner, tensors["suh"], tensors["svh"])
    denom = float(seq_sum(W64.square().flatten(), 0))
    err = float(seq_sum((W_hat.double() - W64).square().flatten(), 0))
    clock("reconstruct")
    return Encoded(tensors, W_hat, err / denom if denom > 0 else 0.0, float(g), sum_sq_w=denom, sum_sq_err=err)


class _Clock:
    """Adds the seconds since the previous call to timings[stage] (no-op without a dict)."""

    def __init__(self, timings: dict | None):
        self.timings = timings
        self.t = time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.timings is None:
            return
        now = time.perf_counter()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
        self.t = now


def quantize(W: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, device=None) -> dict:
    """EXL3 tensor set {trellis, suh, svh[, mul1|mcg]} of a torch Linear weight W (out, in)."""
    return encode(W, K, codebook, seed, device).tensors


def residual_target(W: torch.Tensor, parents: list[dict]) -> torch.Tensor:
    if not isinstance(parents, (list, tuple)) or not parents:
        raise FqError("parents: expected a non-empty list of EXL3 tensor sets (the parent chain)")
    W = check_args(W, 1, "mul1", 0)
    parent = reconstruct_chain(list(parents), "parents").to(torch.float64)
    if parent.shape != W.shape:
        raise FqError(f"parents: chain reconstructs to {tuple(parent.shape)}, W is {tuple(W.shape)}")
    return W - parent


def encode_residual(W, parents, K, codebook="mul1", seed=0, device=None) -> Encoded:
    """Encode R = W - reconstruct_chain(parents). An all-zero R (or zero channel) reconstructs to exactly 0."""
    return encode(residual_target(W, parents), K, codebook, seed, device)


def quantize_residual(W, parents, K, codebook="mul1", seed=0, device=None) -> dict:
    return encode_residual(W, parents, K, codebook, seed, device).tensors
