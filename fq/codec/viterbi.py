"""Exact tail-biting Viterbi over all 65536 trellis states, for a batch of 256-element tiles.

Three implementations of one algorithm (see _trellis.c for the algorithm): the C kernel for CPU, the CUDA
kernel (_viterbi_cuda.cu, built with nvcc on first use; fq.codec.viterbi_cuda), and a batched torch
version (the fallback on CUDA when the kernel cannot be built; also runnable on CPU, where tests compare
it with the C kernel). All do the arithmetic _trellis.c specifies -- float32 d = v - x, one fused
multiply-add per candidate, costs truncated to 23-K mantissa bits with the candidate's h in the low bits,
one unsigned min -- so they return the same states.

``FQ_VITERBI_CUDA=torch`` forces the torch path on CUDA (benchmarks, or to rule the kernel out).
``FQ_CPU_ISA=avx512|avx2|generic`` forces the C kernel's instruction set (default: the widest the CPU runs;
``_trellis.isa()`` says which runs); every one gives the same states (tests/test_codec_isa.py).

Half-integer K (1.5, 2.5, 3.5; mul1 only; fq.codec.rate): ``viterbi`` takes K as a float and runs the C kernel's
frac passes (``_trellis.viterbi_frac``: the same arithmetic, with the step width alternating KA, KA+1). There is no
CUDA kernel for it yet: given a CUDA device, a half-integer K runs on the host's C kernel (all threads; states
returned on the device), which on an H100 host's 16 cores did 1,880 tiles/s at K1.5 where the torch frac path on the
GPU (``_frac_chunk``: the C kernel's generic frac pass, batched; the same states) did 198
(benchmarks/frac_speed_probe.py measures both). ``FQ_VITERBI_FRAC=device`` takes the torch path instead. Integer K
takes exactly the paths it always did.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import torch

from fq.codec.codebook import values_f32, values_torch
from fq.codec import rate
from fq.codec.packing import TILE_LEN

try:
    from fq.codec import _trellis
except ImportError as e:  # pragma: no cover - the package build always compiles it
    _trellis = None
    _IMPORT_ERROR = e

# Back pointers take 256 * 2^(16-K) bytes per tile; bound one CUDA batch's share of them.
_CUDA_BP_BYTES = 4 << 30


_CUDA_FALLBACK_WARNED = set()


def viterbi(tiles: torch.Tensor, K, codebook: str, device=None, threads: int | None = None) -> torch.Tensor:
    """Best tail-biting state sequence per tile. tiles: (n, 256) float32 -> (n, 256) int32 states (CPU).
    K: an int 1..8, or a float 1.5, 2.5, 3.5 with codebook mul1 (else FqError)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    tiles = tiles.reshape(-1, TILE_LEN)
    if device.type == "cpu":
        return viterbi_cpu(tiles, K, codebook, threads)
    return viterbi_gpu(tiles, K, codebook, device).cpu()


def viterbi_gpu(tiles: torch.Tensor, K: int, codebook: str, device, check: bool = True) -> torch.Tensor:
    """States on ``device``: the CUDA kernel, or the torch path (with a warning, once) if it cannot be built."""
    device = torch.device(device)
    if isinstance(K, float):  # no CUDA frac kernel yet: the torch frac path on the device, or the host's C kernel
        if os.environ.get("FQ_VITERBI_FRAC", "cpu") != "device":
            return viterbi_cpu(tiles, K, codebook).to(device)
        return viterbi_torch(tiles, K, codebook, device)
    if device.type == "cuda" and os.environ.get("FQ_VITERBI_CUDA", "kernel") != "torch":
        from fq.codec import viterbi_cuda  # imported only here: CPU use never needs nvcc

        try:
            return viterbi_cuda.viterbi_cuda(tiles, K, codebook, device, check)
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
    nthreads = int(threads or torch.get_num_threads())
    if isinstance(K, float):
        rate.check_k(K, codebook)
        _trellis.viterbi_frac(x, rate.ka(K), values_f32(codebook), out, nthreads)
    else:
        _trellis.viterbi(x, int(K), values_f32(codebook), out, nthreads)
    return torch.from_numpy(out.astype(np.int32))


def viterbi_torch(tiles: torch.Tensor, K, codebook: str, device) -> torch.Tensor:
    """Batched torch implementation; returns states on ``device``. A half-integer K runs the frac passes."""
    device = torch.device(device)
    v = values_torch(codebook, device)
    x = tiles.reshape(-1, TILE_LEN).to(device=device, dtype=torch.float32)
    frac = isinstance(K, float)
    if frac:
        rate.check_k(K, codebook)
    E = 1 << (16 - rate.ka(K))
    chunk = max(1, _CUDA_BP_BYTES // (TILE_LEN * E)) if device.type == "cuda" else 64
    run = (lambda t: _frac_chunk(t, rate.ka(K), v)) if frac else (lambda t: _viterbi_chunk(t, K, v))
    return torch.cat([run(x[i : i + chunk]) for i in range(0, x.shape[0], chunk)])


BIG = 2.0**126  # an unreachable predecessor's cost (pass 2's first position); d*d never moves it


def fma_f32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """float32 fma(a, b, c) with one rounding, from float64 ops on any device: a*b is exact in float64;
    the sum is rounded to odd (TwoSum error, then the odd neighbour), and a float64 result rounded to
    odd rounds to nearest float32 exactly as the exact value would (53 >= 2*24 + 2 bits)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)
    even = (s.view(torch.int64) & 1) == 0
    fix = (err != 0) & even
    s = torch.where(fix, torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).to(s)), s)
    return s.float()


def _keys(d, m, K, h):
    """(bits(fma(d, d, m)) & ~(Q-1)) | h as int64 (costs are non-negative: bits order like values);
    h: each state's top K bits."""
    return (fma_f32(d, d, m).view(torch.int32).long() & ~((1 << K) - 1)) | h


def _forward(x, K, v, roll, pre):
    n = x.shape[0]
    E, Q = 1 << (16 - K), 1 << K
    dev = x.device
    bp = torch.empty((TILE_LEN, n, E), dtype=torch.uint8, device=dev)
    states = torch.arange(65536, device=dev)
    h = states >> (16 - K)
    m0 = torch.zeros((n, 65536), dtype=torch.float32, device=dev)
    if pre is not None:
        m0 = m0.masked_fill((states >> K)[None, :] != pre[:, None], BIG)
    C = _keys(v[None, :] - x[:, roll % TILE_LEN, None], m0, K, h)
    for i in range(1, TILE_LEN):
        prev = (i - 1 + roll) % TILE_LEN
        key = C.view(n, Q, E).amin(dim=1)
        bp[prev] = (key & (Q - 1)).to(torch.uint8)
        M = key.to(torch.int32).view(torch.float32)  # the winning keys are the costs carried on
        d = v[None, :] - x[:, (i + roll) % TILE_LEN, None]
        C = _keys(d, M.repeat_interleave(Q, dim=1), K, h)
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
    best = C.argmin(dim=1)  # keys are distinct within a column of h; equal keys: torch gives the first (lowest s)
    pre = _backtrack(K, half, best, half - 1, bp) & (E - 1)
    C, bp = _forward(x, K, v, 0, pre)
    rows = torch.arange(n, device=x.device)
    h = C.view(n, Q, E)[rows, :, pre].argmin(dim=1)  # distinct keys (h in the low bits)
    out = torch.empty((n, TILE_LEN), dtype=torch.long, device=x.device)
    _backtrack(K, 0, h * E + pre, 0, bp, out)
    return out.to(torch.int32)


# -- half-integer K: _trellis.c's frac_pass_generic and backtrack, batched ----------------------------------------


def _frac_pass(x, KA, v, roll, pre):
    """One frac pass over the ring from position ``roll``: the step into position p adds D(p) = KA + (p & 1) bits.
    At each position the candidates are the 65536 states s = h*E + j, E = 2^(16-KOUT) for KOUT = D(p+1) (the next
    step's width), each tagged with its h; its predecessor node is s >> KIN, KIN = D(p). Returns (M, bp): the last
    position's minima (int64 keys, 2^(16-KA) of them) and the back pointers (256, n, 2^(16-KA)) uint8."""
    n = x.shape[0]
    dev = x.device
    ROW = 65536 >> KA
    bp = torch.zeros((TILE_LEN, n, ROW), dtype=torch.uint8, device=dev)
    states = torch.arange(65536, device=dev)
    M = torch.zeros((n, ROW), dtype=torch.float32, device=dev)
    if pre is not None:
        M = M.masked_fill(torch.arange(ROW, device=dev)[None, :] != pre[:, None], BIG)
    for i in range(TILE_LEN):
        pos = (i + roll) % TILE_LEN
        kin, kout = KA + (pos & 1), KA + ((pos + 1) & 1)
        E, Q = 65536 >> kout, 1 << kout
        d = v[None, :] - x[:, pos, None]
        key = _keys(d, M[:, states >> kin], kout, states // E).view(n, Q, E).amin(dim=1)
        bp[pos, :, :E] = key.to(torch.uint8)
        M = key.to(torch.int32).view(torch.float32)
    return key, bp


def _frac_backtrack(KA, roll, s, stop, bp, out=None):
    rows = torch.arange(s.shape[0], device=s.device)
    for i in range(TILE_LEN - 1, -1, -1):
        pos = (i + roll) % TILE_LEN
        if out is not None:
            out[:, pos] = s
        if i == stop:
            return s
        din = KA + (pos & 1)
        j = s >> din
        s = (bp[(i - 1 + roll) % TILE_LEN][rows, j].long() & ((1 << din) - 1)) * (65536 >> din) + j


def _frac_chunk(x: torch.Tensor, KA: int, v: torch.Tensor) -> torch.Tensor:
    """_trellis.c's encode_tile at K = KA + 0.5: both passes end on an odd position, whose successor adds KA bits,
    so the ends and the seam are the integer K = KA's."""
    n = x.shape[0]
    E, Q = 65536 >> KA, 1 << KA
    half = TILE_LEN // 2
    M, bp = _frac_pass(x, KA, v, half, None)
    jbest = M.argmin(dim=1)  # the lowest j of minimal key
    rows = torch.arange(n, device=x.device)
    best = (M[rows, jbest] & (Q - 1)) * E + jbest
    pre = _frac_backtrack(KA, half, best, half - 1, bp) & (E - 1)
    M, bp = _frac_pass(x, KA, v, 0, pre)
    out = torch.empty((n, TILE_LEN), dtype=torch.long, device=x.device)
    _frac_backtrack(KA, 0, (M[rows, pre] & (Q - 1)) * E + pre, 0, bp, out)
    return out.to(torch.int32)
