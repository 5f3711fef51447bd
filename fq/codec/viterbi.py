"""Exact tail-biting Viterbi over all 65536 trellis states, for a batch of 256-element tiles.

Three implementations of one algorithm (see _trellis.c for the algorithm): the C kernel for CPU, the CUDA
kernel (_viterbi_cuda.cu, built with nvcc on first use; fq.codec.viterbi_cuda), and a batched torch
version (the fallback on CUDA when the kernel cannot be built; also runnable on CPU, where tests compare
it with the C kernel). All use float32 costs with separate multiply and add and keep the first minimum on
ties, so they return the same states.

``FQ_VITERBI_CUDA=torch`` forces the torch path on CUDA (benchmarks, or to rule the kernel out).
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from fq.codec.codebook import values_f32, values_torch
from fq.codec.packing import TILE_LEN

try:
    from fq.codec import _trellis
except ImportError as e:  # pragma: no cover - the package build always compiles it
    _trellis = None
    _IMPORT_ERROR = e

# Back pointers take 256 * 2^(16-K) bytes per tile; bound one CUDA batch's share of them.
_CUDA_BP_BYTES = 4 << 30


_CUDA_FALLBACK_WARNED = set()


def viterbi(tiles: torch.Tensor, K: int, codebook: str, device=None, threads: int | None = None) -> torch.Tensor:
    """Best tail-biting state sequence per tile. tiles: (n, 256) float32 -> (n, 256) int32 states (CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    tiles = tiles.reshape(-1, TILE_LEN)
    if device.type == "cpu":
        return viterbi_cpu(tiles, K, codebook, threads)
    return viterbi_gpu(tiles, K, codebook, device).cpu()


def viterbi_gpu(tiles: torch.Tensor, K: int, codebook: str, device) -> torch.Tensor:
    """States on ``device``: the CUDA kernel, or the torch path (with a warning, once) if it cannot be built."""
    device = torch.device(device)
    if device.type == "cuda" and os.environ.get("FQ_VITERBI_CUDA", "kernel") != "torch":
        from fq.codec import viterbi_cuda  # imported only here: CPU use never needs nvcc

        try:
            return viterbi_cuda.viterbi_cuda(tiles, K, codebook, device)
        except viterbi_cuda.CudaViterbiUnavailable as e:
            if str(e) not in _CUDA_FALLBACK_WARNED:
                _CUDA_FALLBACK_WARNED.add(str(e))
                warnings.warn(f"fq: CUDA Viterbi kernel unavailable, using the (slower, identical) torch path: {e}",
                              RuntimeWarning, stacklevel=3)
    return viterbi_torch(tiles, K, codebook, device)


def viterbi_cpu(tiles: torch.Tensor, K: int, codebook: str, threads: int | None = None) -> torch.Tensor:
    if _trellis is None:  # pragma: no cover
        raise RuntimeError(f"fq's C trellis kernel is not built ({_IMPORT_ERROR}); reinstall fq (make install)")
    x = np.ascontiguousarray(tiles.detach().cpu().numpy(), dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint16)
    _trellis.viterbi(x, int(K), values_f32(codebook), out, int(threads or torch.get_num_threads()))
    return torch.from_numpy(out.astype(np.int32))


def viterbi_torch(tiles: torch.Tensor, K: int, codebook: str, device) -> torch.Tensor:
    """Batched torch implementation; returns states on ``device``."""
    device = torch.device(device)
    v = values_torch(codebook, device)
    x = tiles.to(device=device, dtype=torch.float32)
    E = 1 << (16 - K)
    chunk = max(1, _CUDA_BP_BYTES // (TILE_LEN * E)) if device.type == "cuda" else 64
    return torch.cat([_viterbi_chunk(x[i : i + chunk], K, v) for i in range(0, x.shape[0], chunk)])


def _forward(x, K, v, roll, pre):
    n = x.shape[0]
    E, Q = 1 << (16 - K), 1 << K
    dev = x.device
    bp = torch.empty((TILE_LEN, n, E), dtype=torch.uint8, device=dev)
    C = (v[None, :] - x[:, roll % TILE_LEN, None]).square()
    if pre is not None:
        top = torch.arange(65536, device=dev) >> K
        C = C.masked_fill(top[None, :] != pre[:, None], float("inf"))
    for i in range(1, TILE_LEN):
        prev = (i - 1 + roll) % TILE_LEN
        M, h = C.view(n, Q, E).min(dim=1)
        bp[prev] = h.to(torch.uint8)
        d = (v[None, :] - x[:, (i + roll) % TILE_LEN, None]).square()
        C = (d.view(n, E, Q) + M[:, :, None]).view(n, 65536)
    return C, bp


def _backtrack(K, roll, s, stop, bp, out=None):
    E = 1 << (16 - K)
    rows = torch.arange(s.shape[0], device=s.device)
    for i in range(TILE_LEN - 1, -1, -1):
        pos = (i + roll) % TILE_LEN
        if out is not None:
            out[:, pos] = s
        if i == stop:
            return s
        j = s >> K
        s = bp[(i - 1 + roll) % TILE_LEN][rows, j].long() * E + j


def _viterbi_chunk(x: torch.Tensor, K: int, v: torch.Tensor) -> torch.Tensor:
    n = x.shape[0]
    E, Q = 1 << (16 - K), 1 << K
    half = TILE_LEN // 2
    C, bp = _forward(x, K, v, half, None)
    best = C.argmin(dim=1)
    pre = _backtrack(K, half, best, half - 1, bp) & (E - 1)
    C, bp = _forward(x, K, v, 0, pre)
    rows = torch.arange(n, device=x.device)
    h = C.view(n, Q, E)[rows, :, pre].argmin(dim=1)
    out = torch.empty((n, TILE_LEN), dtype=torch.long, device=x.device)
    _backtrack(K, 0, h * E + pre, 0, bp, out)
    return out.to(torch.int32)
