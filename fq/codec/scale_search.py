"""The global scale search every encoder runs (fq.codec.encoder weight-only, fq.codec.ldlq calibrated, and
fq.codec.chunked for both), and what they all share around it: the ``Encoded`` result, the device check, the Viterbi
call on that device, and the fp16 channel scales (conversion and overflow check).

Every step gives the same bits on the CPU and CUDA: elementwise float64 operations, fq.codec.exact.tree_sum for every
sum, a stable argsort, and Viterbi kernels that return the same states on both.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fq.codec.codebook import values_torch
from fq.codec.exact import div, tree_sum
from fq.codec.packing import matrix_to_tiles
from fq.codec.regularize import CODEBOOK_SCALE
from fq.codec.viterbi import viterbi, viterbi_gpu
from fq.errors import FqError

# Best scale for coding N(0,1) tiles, per codebook and K (benchmarks/codec_quality.py on 1024 tiles for
# K 1..4; K 5, 6, 8 from the reference anchors; K 7 interpolated). Regularized tiles have RMS
# CODEBOOK_SCALE, so best / CODEBOOK_SCALE is where the global scale search starts.
GAUSSIAN_BEST_SCALE = {
    "3inst": (1.425, 1.225, 1.175, 1.125, 1.1, 1.0, 0.975, 0.95),
    "mcg": (1.425, 1.225, 1.175, 1.125, 1.1, 1.0, 0.95, 0.9),
    "mul1": (1.125, 1.0, 0.925, 0.925, 0.9, 0.85, 0.8, 0.75),
}


def gaussian_best_scale(codebook: str, K) -> float:
    """GAUSSIAN_BEST_SCALE at K; a half-integer K (mul1) starts at the geometric mean of its two integer
    neighbours' (the search walks from there: only where it starts depends on this)."""
    if isinstance(K, float):
        lo, hi = GAUSSIAN_BEST_SCALE[codebook][int(K) - 1], GAUSSIAN_BEST_SCALE[codebook][int(K)]
        return (lo * hi) ** 0.5
    return GAUSSIAN_BEST_SCALE[codebook][K - 1]


SEARCH_STEP = 0.06  # relative spacing of the scale candidates
SEARCH_MAX_EVALS = 8


@dataclass
class Encoded:
    """One encoded linear: the EXL3 tensors (on the CPU) plus what the encoder measured."""

    tensors: dict  # at the padded shape (fq.codec.shape.padded_shape of W's): what exllamav3 reads
    # (out, in) float32 on the encoding device, W's own shape: decode of these tensors from the encoder's own states,
    # trimmed to W's shape (a padded matrix's added rows and columns decode to exactly zero: zero channel scales)
    W_hat: torch.Tensor
    rel_mse: float  # sum((W_hat - W)^2) / sum(W^2) over W's own (unpadded) entries; 0 for an all-zero W
    g_scale: float
    # the two float64 sums behind rel_mse (fq.codec.exact.tree_sum over W's elements in row-major order, W's own
    # shape), so callers that report them need not recompute them: sum(W^2) and sum((W_hat - W)^2), W the encoded
    # target (the residual for a stage)
    sum_sq_w: float = 0.0
    sum_sq_err: float = 0.0
    # calibrated encodes (fq.codec.ldlq) only: tr(E H E^T) / tr(W H W^T) of the stored tensors, E = W_hat - W,
    # H the Hessian as given (undamped, W's own width); None for a weight-only encode
    proxy_err: float | None = None


def pipeline_device(device) -> torch.device:
    """None/"cpu" or a CUDA device, as a torch.device (float64 elementwise ops must round as on the CPU)."""
    try:
        d = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        d = None
    if d is None or d.type not in ("cpu", "cuda"):
        raise FqError(f"device: expected None, 'cpu' or a CUDA device, got {device!r}")
    return d


def sample_tiles(x: torch.Tensor, width: int = 3) -> torch.Tensor:
    """Scale-search sample (as the reference): a wrapped diagonal of tiles `width` wide, which touches every
    tile row and column, plus the tiles of highest and lowest mean square. (m, 256) tensor-core tiles."""
    tiles = matrix_to_tiles(x)  # (tk, tn, 256)
    tk, tn = tiles.shape[:2]
    diag = max(tk, tn)
    ii = torch.arange(diag, device=x.device).repeat_interleave(width)
    ww = torch.arange(width, device=x.device).repeat(diag)
    kk, nn = ii % tk, (ii + ww) % tn
    ms = tree_sum(tiles * tiles, 2).flatten()
    num_x = min(max(8, diag * width // 16), (ms.numel() + 1) // 2)
    order = torch.argsort(ms, stable=True)  # stable: equal keys keep index order, on every device
    extreme = torch.cat((order.flip(0)[:num_x], order[:num_x]))
    kk = torch.cat((kk, extreme // tn))
    nn = torch.cat((nn, extreme % tn))
    return tiles[kk, nn]


def _viterbi(tiles: torch.Tensor, K: int, codebook: str, device: torch.device, check: bool = True) -> torch.Tensor:
    # viterbi() would copy CUDA states back to the CPU; viterbi_gpu leaves them where the pipeline runs
    return viterbi(tiles, K, codebook) if device.type == "cpu" else viterbi_gpu(tiles, K, codebook, device, check)


def _tile_mses(jobs: list, K: int, codebook: str, device: torch.device) -> list[list[float]]:
    """jobs: (tiles, scales) pairs. For each, the mean squared error of coding tiles*s, measured back at
    scale 1, for each s; every candidate of every job goes through one Viterbi call."""
    if not jobs:
        return []
    batch = torch.cat([(t * s).to(torch.float32) for t, scales in jobs for s in scales])
    q_all = values_torch(codebook, device)[_viterbi(batch, K, codebook, device).long()].to(torch.float64)
    out, at = [], 0
    for t, scales in jobs:
        q = q_all[at : at + len(scales) * t.shape[0]].reshape(len(scales), *t.shape)
        at += q.shape[0] * q.shape[1]
        s = torch.tensor(scales, dtype=torch.float64, device=device)[:, None, None]
        d = q / s - t[None]
        err = (d * d).reshape(len(scales), -1)
        out.append(div(tree_sum(err, 1), err.shape[1]).tolist())
    return out


def search_scales(xs: list, K: int, codebook: str, device, samples: dict | None = None) -> list[float]:
    """Global scale of each regularized (in, out) matrix: candidates c*(1 +- SEARCH_STEP) around the Gaussian
    optimum c, walked outward while the best is at an edge, then a parabola (in log scale) through the best
    and its neighbours. Matches the reference's 15-point grid on the golden matrices with 3 evaluations of
    the sample instead of 8.3. Each round evaluates the new candidates of all matrices in one Viterbi call;
    a matrix's scale does not depend on the others. ``samples``: {i: sample_tiles(xs[i])} for the matrices that
    are not all zero, when the caller made them (fq.codec.chunked: ``xs`` are then only counted)."""
    device = pipeline_device(device)
    c = gaussian_best_scale(codebook, K) / CODEBOOK_SCALE
    r = 1.0 + SEARCH_STEP
    # an all-zero residual keeps c: every scale codes it equally (its channel scales are zero anyway)
    if samples is None:
        samples = {i: sample_tiles(x) for i, x in enumerate(xs) if torch.any(x)}
    scales = {i: [c / r, c, c * r] for i in samples}
    mses = dict(zip(scales, _tile_mses([(samples[i], scales[i]) for i in scales], K, codebook, device)))
    live = list(scales)
    while live:
        step = {}  # matrix -> (insert at, new candidate) while its best is at an edge
        for i in live:
            b = int(np.argmin(mses[i]))
            if len(scales[i]) < SEARCH_MAX_EVALS and b in (0, len(scales[i]) - 1):
                step[i] = (0, scales[i][0] / r) if b == 0 else (len(scales[i]), scales[i][-1] * r)
        new = _tile_mses([(samples[i], [s]) for i, (_, s) in step.items()], K, codebook, device)
        for (i, (at, s)), (m,) in zip(step.items(), new):
            scales[i].insert(at, s)
            mses[i].insert(at, m)
        live = list(step)
    out = []
    for i in range(len(xs)):
        if i not in scales:
            out.append(c)
            continue
        y, b = mses[i], int(np.argmin(mses[i]))
        offset = 0.0
        if 0 < b < len(y) - 1:
            denom = y[b - 1] - 2.0 * y[b] + y[b + 1]
            offset = max(-0.5, min(0.5, 0.5 * (y[b - 1] - y[b + 1]) / denom)) if denom > 0 else 0.0
        out.append(scales[i][b] * r**offset)
    return out


def _fp16(x: torch.Tensor) -> torch.Tensor:
    # float64 -> float32 -> float16, spelled out: the CPU converts through float32, and so must CUDA
    return x.to(torch.float32).to(torch.float16)


def check_scales(W64: torch.Tensor, su: torch.Tensor, sv: torch.Tensor, g: float, name: str) -> None:
    """Refuse, before any trellis is searched, a weight whose channel scales do not fit in float16: EXL3
    stores ``suh = su / g`` and ``svh = sv`` as fp16, and an overflow would ship Inf/NaN scales that every
    consumer refuses (fq verify, fq combine, read_adapter). Weights above ~1e4 times a typical weight's
    magnitude overflow suh; NaN appears only from overflowing float64 sums (|W| ~1e150 and beyond)."""
    for key, x in (("suh", div(su, g)), ("svh", sv)):
        bad = ~torch.isfinite(_fp16(x))
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            peak = float(W64.abs().max())
            raise FqError(f"{name}: {key}[{i}] would be {float(x[i]):.4g}, which float16 cannot hold (|x| <= 65504): "
                          f"the weight's magnitude (max |W| = {peak:.4g}) is beyond EXL3's fp16 channel scales; "
                          "rescale the weight (or its residual) before encoding")
