"""One large matrix encoded by chunks of output channels, in bounded memory, to the same bytes as the whole-matrix
encoders (fq.codec.encoder weight-only, fq.codec.ldlq calibrated). Those encoders call it; it builds on the pieces
they share (fq.codec.scale_search, fq.codec.ldlq_parts), never on the encoders themselves.

The whole-matrix encoders hold a dozen (out, in) float64 copies at once (the target, its rotation, the search's
scaled copy and tile views, the LDLQ targets, feedback and errors, the refit's Q, Qt, HQ, HW, and every grid product's
result): an lm_head of 154880 x 6144 peaked at 90.6 GiB on an H200. Here the output channels (EXL3 columns) are taken
C at a time (C a power of two, at least one 128 Hadamard block; ``chunk_columns``), every column-local step runs on
one chunk, and each whole-matrix step is computed exactly as the whole-matrix encoder computes it:

- fixed-order sums over the output dimension (the input-channel RMS of the regularization, the refit's right-hand
  side) and over a whole flattened matrix (proxy error, sum W^2, sum E^2): ``fold_sum`` feeds tree_sum's fold its
  power-of-two blocks in bit-reversed order, which is the same tree of the same adds;
- grid products whose grid is taken from a whole operand's max (the proxy error's E, the refit's W, Q; the LDLQ
  feedback's errors): the max is taken over every chunk first (exact), then each chunk is split on that grid
  (``split(peak=)``); integer GEMM parts summed over chunks are exact integers, so any order gives the same;
- the scale search's sample (a wrapped diagonal plus the tiles of extreme mean square, chosen by a stable argsort
  of every tile's mean square): the mean squares per chunk, the argsort whole, the chosen tiles gathered per chunk;
- the LDLQ walk: a step's feedback grid is taken from the max error over *every* output channel of the rows coded,
  so the walk cannot run chunk after chunk; it runs panel by panel (128 input rows) over all channels, the panel's
  targets recomputed from W, the panel's errors held only for the panel, and the finished panel's feedback pushed to
  the earlier rows chunk by chunk. The feedback buffer of the uncoded rows stays whole (in x out float64).

What stays whole, (out, in) sized: the float64 target (W, or a stage's residual, padded), the LDLQ feedback during
the walk, the packed trellis, and ``Encoded.W_hat`` (float32, returned on the CPU). Everything else is one chunk,
one 128-row panel, or an (in, in) Hessian factor. Every (out, in)-sized intermediate is recomputed from those per
pass (the refit's ~7 passes decode the trellis again each time), which costs time, not bytes.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from fq.codec import rate
from fq.codec.codebook import marker_value, values_torch
from fq.codec.exact import div, sqrt, tree_sum
from fq.codec.gridmm import budget, grid_mm, pow2, split
from fq.codec.hadamard import HAD, had_cols, had_rows
from fq.codec.ldl import BLOCK, PANEL
from fq.codec.ldlq_parts import (REFIT_ROUNDS, SIGMA_REG, _cg, _factor, _feedback, _Metric, _rows_to_tiles,
                                 _tiles_to_rows, ldlq_drift)
from fq.codec.packing import TILE_LEN, matrix_to_tiles, pack, tiles_to_matrix, unpack
from fq.codec.regularize import CODEBOOK_SCALE, ZERO, signs
from fq.codec.scale_search import Encoded, _fp16, _viterbi, check_scales, search_scales
from fq.codec.tensors import unrotate
from fq.errors import FqError

ENV = "FQ_ENCODE_CHUNK_MB"
# default working-set budget of one chunk: a matrix whose chunk would be its whole width is encoded whole
CHUNK_BYTES = {"cpu": 1 << 30, "cuda": 4 << 30}
# chunk-sized float64 (in, C) temporaries alive at once at the chunked path's peak (the refit's pass: Qb, Q, Qt, HQ,
# HW and a grid product's parts and sum; counted with fq.codec.memtrack)
LIVE = 10


def chunk_budget(device: torch.device) -> int:
    """Bytes of one chunk's working set: $FQ_ENCODE_CHUNK_MB (MiB) if set, else CHUNK_BYTES for the device type."""
    raw = os.environ.get(ENV)
    if raw is None or raw == "":
        return CHUNK_BYTES.get(device.type, 1 << 30)
    try:
        mb = float(raw)
    except ValueError:
        mb = -1.0
    if not mb > 0:
        raise FqError(f"${ENV}: expected a positive number of MiB, got {raw!r}")
    return int(mb * (1 << 20))


def chunk_columns(in_p: int, out_p: int, device: torch.device, chunk: int | None = None) -> int:
    """Output channels per chunk: ``chunk`` if given, else the largest power of two >= 128 whose LIVE float64
    (in, C) temporaries fit the budget. A power of two because the fixed-order sums fold power-of-two blocks.
    Returns out_p or more when the matrix fits whole (the caller then encodes it whole)."""
    if chunk is not None:
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < HAD or chunk & (chunk - 1):
            raise FqError(f"chunk: expected a power of two >= {HAD} output channels, got {chunk!r}")
        return chunk
    fit = chunk_budget(device) // (LIVE * 8 * in_p)
    c = HAD
    while c * 2 <= fit:
        c *= 2
    return c


def _bitrev(t: int, bits: int) -> int:
    return int(format(t, f"0{bits}b")[::-1], 2) if bits else 0


def fold_sum(n: int, block: int, fn) -> torch.Tensor:
    """tree_sum(X, -1) for X (..., n) float64 given by blocks: fn(c0, c1) -> X[..., c0:c1] (block a power of two).
    tree_sum zero-pads to a power of two W and folds X[:W/2] + X[W/2:] down to one element: with X cut into W/block
    blocks, the folds above the block size add block h to block h + H/2 first, i.e. an ordinary pairwise tree over
    the blocks in bit-reversed order. So the blocks are fed in that order onto a stack that adds two subtrees of one
    height, and the last block-sized vector is tree_summed: the same adds in the same order, log2(W/block) blocks
    held at most."""
    width = 1 << max(n - 1, 0).bit_length()
    if width <= block:
        return tree_sum(fn(0, n), -1)
    count = width // block
    bits = count.bit_length() - 1
    stack: list = []
    first = None
    for t in range(count):
        c0 = _bitrev(t, bits) * block
        if c0 < n:
            v = fn(c0, min(c0 + block, n)).to(torch.float64)
            if v.shape[-1] < block:
                v = F.pad(v, (0, block - v.shape[-1]))
            if first is None:
                first = v
        else:  # tree_sum's zero padding (t = 0 is block 0, so ``first`` is set)
            v = torch.zeros_like(first)
        level = 0
        while stack and stack[-1][0] == level:
            v = stack.pop()[1] + v
            level += 1
        stack.append((level, v))
    return tree_sum(stack[0][1], -1)


def _ranges(n: int, step: int):
    for c0 in range(0, n, step):
        yield c0, min(c0 + step, n)


def _sq(x: torch.Tensor) -> torch.Tensor:
    return x * x  # as the whole-matrix encoders square (never pow)


def _amax(peak, x: torch.Tensor) -> torch.Tensor:
    m = x.abs().amax()
    return m if peak is None else torch.maximum(peak, m)


class Regularized:
    """fq.codec.regularize.regularize of W64 (out_p, in_p) float64 (the padded target), by chunks: ``su``, ``sv`` as
    it returns them, and the rotated matrix x (in, out) recomputed on demand, by columns (``cols``) or by 128-row
    panels (``rows``)."""

    def __init__(self, W64: torch.Tensor, seed: int, C: int):
        n, k = W64.shape
        self.W64, self.C, self.k, self.n = W64, C, k, n
        dev = W64.device
        su_sign, sv_sign = signs(seed, "su", k).to(dev), signs(seed, "sv", n).to(dev)
        # rms(Wt, 0): a sum over the input dimension, per output channel
        out_scales = torch.cat([sqrt(div(tree_sum(_sq(self._wt(c0, c1)), 0), k)) for c0, c1 in _ranges(n, C)])
        mean = div(tree_sum(out_scales, 0), n)
        if mean > ZERO:
            out_scales = out_scales / mean
        zero_out = out_scales < ZERO
        out_scales = torch.where(zero_out, torch.full_like(out_scales, 0.1), out_scales)
        self._sv = sv_sign * out_scales  # the divisor (before zeroing), as regularize divides by it
        # rms(x, 1): a sum over the output dimension, per input channel
        in_scales = sqrt(div(fold_sum(n, C, lambda c0, c1: _sq(self._x1(c0, c1))), n))
        zero_in = in_scales < ZERO
        in_scales = torch.where(zero_in, torch.full_like(in_scales, 0.1), in_scales)
        self._su = div(su_sign * in_scales, -CODEBOOK_SCALE)
        self.sv = torch.where(zero_out, torch.zeros_like(self._sv), self._sv)
        self.su = torch.where(zero_in, torch.zeros_like(self._su), self._su)

    def _wt(self, c0: int, c1: int) -> torch.Tensor:
        return self.W64[c0:c1].t()

    def _x1(self, c0: int, c1: int) -> torch.Tensor:
        return had_rows(self._wt(c0, c1) / self._sv[None, c0:c1])

    def cols(self, c0: int, c1: int) -> torch.Tensor:
        """x[:, c0:c1] (c0, c1 multiples of 128)."""
        return had_cols(self._x1(c0, c1) / self._su[:, None])

    def rows(self, r0: int, r1: int) -> torch.Tensor:
        """x[r0:r1] (r0, r1 multiples of 128): the input channels' Hadamard blocks are whole."""
        x1 = had_rows(self.W64[:, r0:r1].t() / self._sv[None, :])
        return had_cols(x1 / self._su[r0:r1, None])


def sample_tiles(cols, k: int, n: int, C: int, width: int = 3):
    """fq.codec.scale_search.sample_tiles of the matrix x (k, n) given by columns (``cols(c0, c1)``), or None when x is
    all zero (search_scales leaves such a matrix out)."""
    dev = None
    tk, tn = k // 16, n // 16
    ms = None
    nonzero = False
    for c0, c1 in _ranges(n, C):
        x = cols(c0, c1)
        dev = x.device
        nonzero = nonzero or bool(torch.any(x))
        tiles = matrix_to_tiles(x)
        if ms is None:
            ms = torch.empty((tk, tn), dtype=torch.float64, device=dev)
        ms[:, c0 // 16 : c1 // 16] = tree_sum(tiles * tiles, 2)
        del x, tiles
    if not nonzero:
        return None
    diag = max(tk, tn)
    ii = torch.arange(diag, device=dev).repeat_interleave(width)
    ww = torch.arange(width, device=dev).repeat(diag)
    kk, nn = ii % tk, (ii + ww) % tn
    ms = ms.flatten()
    num_x = min(max(8, diag * width // 16), (ms.numel() + 1) // 2)
    order = torch.argsort(ms, stable=True)
    extreme = torch.cat((order.flip(0)[:num_x], order[:num_x]))
    kk = torch.cat((kk, extreme // tn))
    nn = torch.cat((nn, extreme % tn))
    out = torch.empty((kk.numel(), TILE_LEN), dtype=torch.float64, device=dev)
    for c0, c1 in _ranges(n, C):
        at = ((nn >= c0 // 16) & (nn < c1 // 16)).nonzero()[:, 0]
        if at.numel():
            tiles = matrix_to_tiles(cols(c0, c1))
            out[at] = tiles[kk[at], nn[at] - c0 // 16]
    return out


class Decoded:
    """The reconstruction of a packed trellis (in_p/16, out_p/16, 16K) with fp16 scales, by output channels:
    ``inner(c0, c1)`` the decoded (in, c1 - c0) float32, ``rows(o0, o1, in_f)`` rows of W_hat (out, in) (any o0, o1:
    the 128-aligned span around them is decoded and sliced)."""

    def __init__(self, trellis: torch.Tensor, K: int, codebook: str, suh: torch.Tensor, svh: torch.Tensor):
        self.trellis, self.K, self.suh, self.svh = trellis, K, suh, svh
        self.values = values_torch(codebook, trellis.device)
        self.n = trellis.shape[1] * 16

    def inner(self, c0: int, c1: int) -> torch.Tensor:
        return tiles_to_matrix(self.values[unpack(self.trellis[:, c0 // 16 : c1 // 16], self.K).long()])

    def rows(self, o0: int, o1: int, in_f: int) -> torch.Tensor:
        a0, a1 = o0 // HAD * HAD, min(-(-o1 // HAD) * HAD, self.n)
        W = unrotate(self.inner(a0, a1), self.suh, self.svh[a0:a1])
        return W[o0 - a0 : o1 - a0, :in_f]


def flat_sums(fns, out_f: int, in_f: int, block: int) -> list[float]:
    """[tree_sum(X.flatten())] for (out_f, in_f) matrices X given by rows: fns[i](o0, o1) -> X[o0:o1] float64
    (``block``: flattened elements per fold block, a power of two)."""
    def fn(p0, p1):
        o0, o1 = p0 // in_f, -(-p1 // in_f)
        return torch.stack([f(o0, o1).flatten()[p0 - o0 * in_f : p1 - o0 * in_f] for f in fns])
    return [float(s) for s in fold_sum(out_f * in_f, block, fn)]


def quads(metric, fns, out_f: int, in_f: int, C: int, block: int) -> list[float]:
    """[metric.quad(E)] (fq.codec.ldlq_parts._Metric: tr(E H E^T)) for (out_f, in_f) matrices E given by rows."""
    inv = metric.inv[None, :]
    bits = budget(metric.k) - metric.bits
    peaks = [None] * len(fns)
    for o0, o1 in _ranges(out_f, C):  # the grid of E: its whole max
        for i, f in enumerate(fns):
            peaks[i] = _amax(peaks[i], f(o0, o1) * inv)

    def term(i):
        def rows(o0, o1):
            Et = fns[i](o0, o1) * inv
            T = grid_mm(split(Et, bits, 1, peak=peaks[i].reshape(1, 1)), metric.g)
            return T * Et
        return rows
    return flat_sums([term(i) for i in range(len(fns))], out_f, in_f, block)


def flat_block(C: int, in_p: int) -> int:
    b = 1
    while b * 2 <= C * in_p:
        b *= 2
    return b


def encode_weight_only(W64: torch.Tensor, shape, K: int, codebook: str, seed: int, name: str, device, C: int, clock):
    """fq.codec.encoder's encode of one matrix (W64 the padded float64 target, ``shape`` W's own), by chunks."""
    n, k = W64.shape
    reg = Regularized(W64, seed, C)
    clock("regularize")
    sample = sample_tiles(reg.cols, k, n, C)
    g = search_scales([None], K, codebook, device, samples={} if sample is None else {0: sample})[0]
    check_scales(W64, reg.su, reg.sv, g, name)
    clock("search")
    trellis = torch.empty((k // 16, n // 16, rate.tile_words(K)), dtype=torch.int16, device=device)
    for c0, c1 in _ranges(n, C):
        tiles = matrix_to_tiles((reg.cols(c0, c1) * g).to(torch.float32))
        states = _viterbi(tiles.reshape(-1, TILE_LEN), K, codebook, device)
        trellis[:, c0 // 16 : c1 // 16] = pack(states.reshape(tiles.shape), K)
        del tiles, states
    clock("viterbi")
    suh, svh = _fp16(div(reg.su, g)), _fp16(reg.sv)
    dec = Decoded(trellis, K, codebook, suh, svh)
    out_f, in_f = shape
    sw, se = flat_sums([lambda o0, o1: _sq(W64[o0:o1, :in_f]),
                        lambda o0, o1: _sq(dec.rows(o0, o1, in_f).double() - W64[o0:o1, :in_f])],
                       out_f, in_f, flat_block(C, k))
    W_hat = _host_rows(dec, out_f, in_f, C)
    clock("reconstruct")
    return Encoded(_tensors(trellis, suh, svh, codebook), W_hat, se / sw if sw > 0 else 0.0, float(g),
                   sum_sq_w=sw, sum_sq_err=se)


def _tensors(trellis, suh, svh, codebook) -> dict:
    tensors = {"trellis": trellis.cpu(), "suh": suh.cpu(), "svh": svh.cpu()}
    marker = marker_value(codebook)
    if marker is not None:
        tensors[codebook] = torch.tensor(marker, dtype=torch.int32)
    return tensors


def _host_rows(dec: Decoded, out_f: int, in_f: int, C: int) -> torch.Tensor:
    W_hat = torch.empty((out_f, in_f), dtype=torch.float32)
    for o0, o1 in _ranges(out_f, C):
        W_hat[o0:o1] = dec.rows(o0, o1, in_f).cpu()
    return W_hat


# ---------------------------------------------------------------------------------------------- LDLQ


def ldlq_walk(reg: Regularized, g: float, L: torch.Tensor, Fx: torch.Tensor, K: int, codebook: str, device,
              C: int) -> torch.Tensor:
    """fq.codec.ldlq.ldlq for one matrix (targets reg.rows * g), panel by panel; returns the packed trellis."""
    k, n = reg.k, reg.n
    values = values_torch(codebook, device)
    ds, inv = pow2(-Fx)[:, :, None], pow2(Fx)[:, :, None]
    fb = torch.zeros((1, k, n), dtype=torch.float64, device=device)  # feedback of finished panels
    trellis = torch.empty((k // BLOCK, n // BLOCK, rate.tile_words(K)), dtype=torch.int16, device=device)
    finite = torch.ones((), dtype=torch.bool, device=device)
    bits = budget(PANEL)
    for j in range(k, 0, -PANEL):
        i0 = j - PANEL
        T = (reg.rows(i0, j) * g)[None]
        et = torch.zeros_like(T)  # Ds^-1 (W - Q) of this panel's rows done
        for bj in range(j, i0, -BLOCK):
            bi = bj - BLOCK
            a, b = bi - i0, bj - i0
            x = T[:, a:b] + fb[:, bi:bj]
            if bj < j:
                x = x + _feedback(L[:, bj:j, bi:bj], et[:, b:]) * ds[:, bi:bj]
            flat = _rows_to_tiles(x.to(torch.float32))
            finite &= torch.isfinite(flat).all()
            st = _viterbi(flat, K, codebook, device, check=False).reshape(1, n // BLOCK, 256)
            trellis[bi // BLOCK] = pack(st[0], K)
            q = _tiles_to_rows(values[st.long()]).to(torch.float64)
            et[:, a:b] = (T[:, a:b] - q) * inv[:, bi:bj]
            del x, flat, st, q
        if i0 > 0:  # _feedback(L[:, i0:j, :i0], et) * ds[:, :i0], by columns (the errors' grid is the panel's)
            Lg = split(L[:, i0:j, :i0].transpose(1, 2).contiguous(), bits // 2, 2, batch_dims=1, check=False)
            Eg = split(et, bits - bits // 2, 2, batch_dims=1, check=False)
            for c0, c1 in _ranges(n, C):
                fb[:, :i0, c0:c1] += grid_mm(Lg, Eg.cols(c0, c1)) * ds[:, :i0]
            del Lg, Eg
        del T, et
    if not bool(finite):
        raise FqError("LDLQ: the error feedback became NaN or Inf (a Hessian factor overflowed)")
    return trellis


def refit(W64: torch.Tensor, dec: Decoded, Hd: torch.Tensor, C: int):
    """fq.codec.ldlq.refit_scales for one matrix (Wt = W64.t(), the decoded trellis, its fp16 scales), by chunks.
    Returns (a, b) float64, (in,) and (out,)."""
    n, k = W64.shape
    metric = _Metric(Hd)
    inv = metric.inv[:, None]
    bx = budget(metric.k) - metric.bits
    a, b = dec.suh.to(torch.float64)[None], dec.svh.to(torch.float64)[None]
    one = torch.ones((), dtype=torch.float64, device=W64.device)

    def Qb(c0, c1):
        return had_rows(had_cols(dec.inner(c0, c1).to(torch.float64)))[None]

    def Wt(c0, c1):
        return W64[c0:c1].t()[None]

    def times(X, peak):  # metric.times(X) of a chunk of a matrix whose |X Ds^-1| max is ``peak``
        return grid_mm(metric.g, split(X * inv, bx, 1, batch_dims=1, peak=peak.reshape(1, 1, 1)))

    pk_w = None
    for c0, c1 in _ranges(n, C):
        pk_w = _amax(pk_w, Wt(c0, c1) * inv)
    bq = budget(n)
    for _round in range(REFIT_ROUNDS):
        pk_q = None
        for c0, c1 in _ranges(n, C):
            pk_q = _amax(pk_q, (Qb(c0, c1) * a[:, :, None] * b[:, None, c0:c1]) * inv)
        c = torch.empty_like(b)
        pk_a = None
        for c0, c1 in _ranges(n, C):
            Q = Qb(c0, c1) * a[:, :, None] * b[:, None, c0:c1]
            Qt = Q * inv
            num = tree_sum(Qt * times(Wt(c0, c1), pk_w), 1)
            den = tree_sum(Qt * times(Q, pk_q), 1)
            del Qt
            cc = torch.where(den > 0, num / torch.where(den > 0, den, one), one)
            cc = torch.where(torch.isfinite(cc) & (cc > 0), cc, one)
            c[:, c0:c1] = cc
            pk_a = _amax(pk_a, Q * cc[:, None, :])
            del Q
        A = None
        units = []

        def rhs_block(c0, c1):
            nonlocal A
            Q = Qb(c0, c1) * a[:, :, None] * b[:, None, c0:c1] * c[:, None, c0:c1]
            Ga = split(Q, bq // 2, 1, batch_dims=1, peak=pk_a.reshape(1, 1, 1))
            Gb = split(Q.transpose(1, 2).contiguous(), bq - bq // 2, 1, batch_dims=1, peak=pk_a.reshape(1, 1, 1))
            part = torch.matmul(Ga.parts[0], Gb.parts[0])  # integers: the sum over chunks is exact (bq's budget)
            A = part if A is None else A + part
            if not units:
                units.append(Ga.unit * Gb.unit)
            return Q * (times(Wt(c0, c1), pk_w) * inv)
        rhs = fold_sum(n, C, rhs_block)
        b = b * c
        A = A * units[0] * Hd
        bk = budget(k)
        diag = torch.diagonal(A, dim1=1, dim2=2).clone()
        Ag = split(A, bk // 2, 2, batch_dims=1)
        del A
        r = _cg(Ag, diag, rhs, bk - bk // 2)
        del Ag
        r = torch.where(torch.isfinite(r) & (r > 0), r, one)
        a = a * r
    return a[0], b[0]


def encode_ldlq(W64, shape, H_own, Hc, K: int, codebook: str, seed: int, name: str, device, C: int, clock):
    """fq.codec.ldlq's encode of one matrix (W64 the padded float64 target, ``shape`` W's own; H_own the checked
    Hessian at W's width, Hc zero-padded), by chunks."""
    n, k = W64.shape
    out_f, in_f = shape
    metric = _Metric(H_own)
    reg = Regularized(W64, seed, C)
    clock("regularize")
    L, Fx, damping, Hds = _factor([Hc], [SIGMA_REG], [reg.su], [name], device)
    clock("hessian")
    drift = ldlq_drift(K)
    sample = sample_tiles(lambda c0, c1: reg.cols(c0, c1) * drift, k, n, C)
    g = search_scales([None], K, codebook, device, samples={} if sample is None else {0: sample})[0]
    check_scales(W64, reg.su, reg.sv, g, name)
    clock("search")
    trellis = ldlq_walk(reg, g, L, Fx, K, codebook, device, C)
    del L
    clock("ldlq")
    blk = flat_block(C, k)
    dec = Decoded(trellis, K, codebook, _fp16(div(reg.su, g)), _fp16(reg.sv))
    den, num = quads(metric, [lambda o0, o1: W64[o0:o1, :in_f],
                              lambda o0, o1: dec.rows(o0, o1, in_f).double() - W64[o0:o1, :in_f]], out_f, in_f, C, blk)
    clock("finish")
    a, b = refit(W64, dec, Hds[0], C)
    clock("refit")
    suh2, svh2 = _fp16(a), _fp16(b)
    if bool(torch.isfinite(suh2).all()) and bool(torch.isfinite(svh2).all()):
        dec2 = Decoded(trellis, K, codebook, suh2, svh2)
        (num2,) = quads(metric, [lambda o0, o1: dec2.rows(o0, o1, in_f).double() - W64[o0:o1, :in_f]], out_f, in_f,
                        C, blk)
        if num2 < num:
            dec, num = dec2, num2
    sw, se = flat_sums([lambda o0, o1: _sq(W64[o0:o1, :in_f]),
                        lambda o0, o1: _sq(dec.rows(o0, o1, in_f).double() - W64[o0:o1, :in_f])], out_f, in_f, blk)
    proxy = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    W_hat = _host_rows(dec, out_f, in_f, C)
    clock("finish")
    return Encoded(_tensors(trellis, dec.suh, dec.svh, codebook), W_hat, se / sw if sw > 0 else 0.0, float(g),
                   sum_sq_w=sw, sum_sq_err=se, proxy_err=proxy)
