"""Weight-only EXL3 encoder: regularize, global scale search, exact tail-biting Viterbi, pack.

Every stage runs on the device given to encode() (the CPU or a CUDA device) and gives the same bits on
both: only elementwise float operations, integer operations and gathers, sums through
fq.codec.exact.tree_sum (never torch.sum/mean/cumsum or a matmul, whose order depends on the backend),
and a Viterbi whose CPU and CUDA kernels return the same states. So a CPU and a CUDA encode of the same
input are byte-identical, down to the reported sums.

A W whose dims are multiples of 16 but not of 128 is coded zero-padded to multiples of 128, as exllamav3 stores it
(``fq.codec.shape``; ``target``): the tensors are the padded matrix's, the padded channels reconstruct to exactly zero
(zero scales), and W_hat and the error sums are W's own entries. A 128-aligned W is coded as it always was.

The scale search, ``Encoded`` and the helpers every encoder shares are in fq.codec.scale_search; a matrix wider than a
chunk of the memory budget is sent to fq.codec.chunked, to the same bytes.
"""
from __future__ import annotations

import time

import torch

from fq.codec import chunked, rate
from fq.codec.codebook import CODEBOOKS, marker_value, values_torch
from fq.codec.exact import div, tree_sum
from fq.codec.hadamard import HAD
from fq.codec.packing import TILE_LEN, matrix_to_tiles, pack, tiles_to_matrix
from fq.codec.regularize import regularize
from fq.codec.scale_search import Encoded, _fp16, _viterbi, check_scales, pipeline_device, search_scales
from fq.codec.shape import TILE, dims_problem, padded_shape
from fq.codec.tensors import reconstruct_chain, trim, unrotate
from fq.errors import FqError

# encode_batch: consecutive matrices share one main Viterbi call while their tiles add up to at most this
# (16 MiB of float32 tiles: several of the CUDA kernel's batches, 1024 tiles at K2; larger matrices run alone)
GROUP_TILES = 1 << 14


def check_args(W, K, codebook, seed, name: str = "W", device=None) -> torch.Tensor:
    """Validated W as float64 on ``device`` (default the CPU), its own shape (not padded)."""
    if not isinstance(W, torch.Tensor):
        raise FqError(f"{name}: expected a torch.Tensor, got {type(W).__name__}")
    if W.dim() != 2 or not W.is_floating_point():
        raise FqError(f"{name}: expected a 2-D floating-point (out, in) weight, got {str(W.dtype).removeprefix('torch.')} {tuple(W.shape)}")
    out_f, in_f = W.shape
    if dims_problem(out_f) or dims_problem(in_f):
        raise FqError(f"{name}: shape (out={out_f}, in={in_f}); both dims must be positive multiples of {TILE} (EXL3 "
                      f"codes 16x16 tiles, and a matrix is stored zero-padded to multiples of {HAD}, as exllamav3 "
                      "pads it)")
    if codebook not in CODEBOOKS:
        raise FqError(f"codebook: unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    rate.check_k(K, codebook)  # an integer 1..8, or 1.5/2.5/3.5 with mul1 (fq.codec.rate)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise FqError(f"seed: expected a non-negative integer, got {seed!r}")
    # move in the source dtype, widen on the device (exact either way; half the bytes of a bf16 source moved)
    W = W.detach().to(pipeline_device(device)).to(torch.float64)
    if not torch.isfinite(W).all():
        bad = (~torch.isfinite(W)).nonzero()[0].tolist()
        raise FqError(f"{name}: contains NaN or Inf (first at [{bad[0]}, {bad[1]}])")
    return W


def pad_to(W: torch.Tensor, shape) -> torch.Tensor:
    """W (out, in) zero-extended to ``shape`` (its padded shape); W itself when it already is that shape."""
    if tuple(W.shape) == tuple(shape):
        return W
    out = torch.zeros(tuple(shape), dtype=W.dtype, device=W.device)
    out[: W.shape[0], : W.shape[1]] = W
    return out


def target(W, K, codebook, seed, name: str, device, parents=None) -> tuple[torch.Tensor, tuple[int, int]]:
    """(the float64 matrix the trellis codes, at W's padded shape; W's own (out, in)): W zero-padded, or for a stage
    (``parents``: its parent chain) the padded W minus the chain's reconstruction, on the padded shape."""
    if parents is not None:
        R = residual_target(W, parents, device, name)
        return check_args(R, K, codebook, seed, name, device), tuple(W.shape)
    W64 = check_args(W, K, codebook, seed, name, device)
    return pad_to(W64, padded_shape(W64.shape)), tuple(W64.shape)


def _finish(W64, su, sv, g: float, states, K: int, codebook: str, clock, shape) -> Encoded:
    """Pack one matrix's states, reconstruct from them and measure the error over W's own ``shape`` (the padded
    rows and columns are left out of the sums and trimmed off W_hat), all on the states' device."""
    dev = states.device
    packed = {"trellis": pack(states, K), "suh": _fp16(div(su, g)), "svh": _fp16(sv)}
    tensors = {k: v.cpu() for k, v in packed.items()}  # the product is host bytes
    marker = marker_value(codebook)
    if marker is not None:
        tensors[codebook] = torch.tensor(marker, dtype=torch.int32)
    clock("pack")
    inner = tiles_to_matrix(values_torch(codebook, dev)[states.long()])
    W_hat = trim(unrotate(inner, packed["suh"], packed["svh"]), shape)
    W64 = trim(W64, shape)
    d = W_hat.double() - W64
    denom = float(tree_sum((W64 * W64).flatten()))
    err = float(tree_sum((d * d).flatten()))
    clock("reconstruct")
    return Encoded(tensors, W_hat, err / denom if denom > 0 else 0.0, float(g), sum_sq_w=denom, sum_sq_err=err)


def _groups(sizes: list[int], limit: int):
    """Consecutive runs of indices whose sizes add up to at most ``limit`` (a larger one runs alone)."""
    group, total = [], 0
    for i, n in enumerate(sizes):
        if group and total + n > limit:
            yield group
            group, total = [], 0
        group.append(i)
        total += n
    if group:
        yield group


def _encode_many(Ws, K, codebook, seeds, device, names, parents, timings, chunk=None) -> list[Encoded]:
    device = pipeline_device(device)
    clock = _Clock(timings, device)
    W64s, shapes = [], []
    for i, W in enumerate(Ws):  # every argument is checked before any work
        W64, shape = target(W, K, codebook, seeds[i], names[i], device, None if parents is None else parents[i])
        W64s.append(W64)
        shapes.append(shape)
    clock("check")
    if len(W64s) == 1:  # one matrix wider than a chunk of the memory budget: by chunks, the same bytes
        C = chunked.chunk_columns(W64s[0].shape[1], W64s[0].shape[0], device, chunk)
        if C < W64s[0].shape[0]:
            return [chunked.encode_weight_only(W64s[0], shapes[0], K, codebook, seeds[0], names[0], device, C, clock)]
    regs = []  # (x, su, sv) per matrix, until its main Viterbi
    for W64, seed in zip(W64s, seeds):
        regs.append(regularize(W64.t(), seed))
        clock("regularize")
    gs = search_scales([x for x, _, _ in regs], K, codebook, device)
    for (_, su, sv), g, W64, name in zip(regs, gs, W64s, names):
        check_scales(W64, su, sv, g, name)
    clock("search")
    out = []
    for group in _groups([W.numel() // TILE_LEN for W in W64s], GROUP_TILES):
        tiles = [matrix_to_tiles((regs[i][0] * gs[i]).to(torch.float32)) for i in group]
        flat = torch.cat([t.reshape(-1, TILE_LEN) for t in tiles]) if len(tiles) > 1 else tiles[0].reshape(-1, TILE_LEN)
        states = _viterbi(flat, K, codebook, device)
        clock("viterbi")
        at = 0
        for i, t in zip(group, tiles):
            n = t.shape[0] * t.shape[1]
            _, su, sv = regs[i]
            out.append(_finish(W64s[i], su, sv, gs[i], states[at : at + n].reshape(t.shape), K, codebook, clock,
                               shapes[i]))
            regs[i] = W64s[i] = None  # this matrix's float64 copies are no longer needed
            at += n
    return out


def encode(W: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, device=None, *,
           timings: dict | None = None, chunk: int | None = None) -> Encoded:
    """Encode a torch Linear weight W (out, in), dims multiples of 16; the tensors are those of W zero-padded to
    ``fq.codec.shape.padded_shape`` (multiples of 128), W_hat and the error are W's own shape. ``device``:
    None/"cpu" (C Viterbi kernel) or a CUDA device; every stage runs there and both give the same bytes, W_hat, sums
    and g_scale. ``tensors`` are returned on the CPU, ``W_hat`` on ``device``. ``timings``: if a dict, the wall
    seconds of each stage are added to it (check, regularize, search, viterbi, pack, reconstruct; CUDA is
    synchronized at each stage boundary). ``chunk``: output channels per chunk (a power of two >= 128; default from
    the memory budget, fq.codec.chunked.chunk_columns): a wider matrix is encoded chunk by chunk, to the same bytes,
    and its W_hat is returned on the CPU."""
    return _encode_many([W], K, codebook, [seed], device, ["W"], None, timings, chunk)[0]


def encode_batch(Ws: list, K: int, codebook: str = "mul1", seeds=0, device=None, *, parents: list | None = None,
                 timings: dict | None = None) -> list[Encoded]:
    """Encode several weights (e.g. the experts of a block) at one K and codebook; returns, per matrix, the
    Encoded that encode() (or encode_residual(), for a matrix with parents) would return, bit for bit.

    ``seeds``: one int for all or a list, one per matrix. ``parents``: None, or a list with, per matrix,
    None (a base) or its parent chain (that matrix is a residual stage, as encode_residual). Batching: the
    scale search evaluates the candidates of all matrices in one Viterbi call per round (the first round is
    3 candidates x every matrix), and consecutive matrices share one main Viterbi call while their tiles add
    up to at most GROUP_TILES. Memory: every matrix's float64 copy and rotation (16 bytes per weight) are
    held until its main Viterbi, so pass a block's matrices, not a whole model."""
    Ws = list(Ws)
    seeds = [seeds] * len(Ws) if isinstance(seeds, int) and not isinstance(seeds, bool) else list(seeds)
    if len(seeds) != len(Ws) or (parents is not None and len(parents) != len(Ws)):
        raise FqError(f"encode_batch: {len(Ws)} weights need as many seeds ({len(seeds)}) and parent chains "
                      f"({'none' if parents is None else len(parents)})")
    return _encode_many(Ws, K, codebook, seeds, device, [f"Ws[{i}]" for i in range(len(Ws))], parents, timings)


class _Clock:
    """Adds the seconds since the previous call to timings[stage] (no-op without a dict). On CUDA it waits for
    the device first, so a stage is charged its own kernels (only when timings are asked for)."""

    def __init__(self, timings: dict | None, device: torch.device):
        self.timings = timings
        self.sync = timings is not None and device.type == "cuda"
        self.device = device
        self.t = self._now()

    def _now(self) -> float:
        if self.sync:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def __call__(self, stage: str) -> None:
        if self.timings is None:
            return
        now = self._now()
        self.timings[stage] = self.timings.get(stage, 0.0) + now - self.t
        self.t = now


def quantize(W: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, device=None) -> dict:
    """EXL3 tensor set {trellis, suh, svh[, mul1|mcg]} of a torch Linear weight W (out, in)."""
    return encode(W, K, codebook, seed, device).tensors


def residual_target(W: torch.Tensor, parents: list[dict], device=None, name: str = "W") -> torch.Tensor:
    """W zero-padded to its padded shape, minus reconstruct_chain(parents) (which is that shape: the stored tensors'),
    float64 on ``device`` (the parents are reconstructed there). The padded rows and columns of a stage's target are
    minus the parents' there (zero for fq's parents, whose padded channels have zero scales)."""
    if not isinstance(parents, (list, tuple)) or not parents:
        raise FqError("parents: expected a non-empty list of EXL3 tensor sets (the parent chain)")
    W = check_args(W, 1, "mul1", 0, name, device)
    chain = [{k: v.to(W.device) if isinstance(v, torch.Tensor) else v for k, v in t.items()} if isinstance(t, dict)
             else t for t in parents]
    parent = reconstruct_chain(chain, "parents").to(torch.float64)
    stored = padded_shape(W.shape)
    if tuple(parent.shape) != stored:
        shown = f"{tuple(W.shape)}" + (f" (stored at {stored})" if stored != tuple(W.shape) else "")
        raise FqError(f"parents: chain reconstructs to {tuple(parent.shape)}, W is {shown}")
    return pad_to(W, stored) - parent


def encode_residual(W, parents, K, codebook="mul1", seed=0, device=None, *, timings: dict | None = None,
                    chunk: int | None = None) -> Encoded:
    """Encode R = W - reconstruct_chain(parents), on the padded shape (``residual_target``); W_hat and the error are
    R's over W's own shape. An all-zero R (or zero channel) reconstructs to exactly 0. ``chunk``: as encode's."""
    return _encode_many([W], K, codebook, [seed], device, ["W"], [parents], timings, chunk)[0]


def quantize_residual(W, parents, K, codebook="mul1", seed=0, device=None) -> dict:
    return encode_residual(W, parents, K, codebook, seed, device).tensors
