"""Calibrated EXL3 encoder: LDLQ with the input-side Hessian, byte-reproducible on every CPU and GPU.

What it does (the reference converter's algorithm, ``quantize_exl3``/``ldlq``/``refit_scales`` of exllamav3
1.6.5, in fq's own way; W is a torch weight (out, in), H = X^T X / count its input-side Hessian (in, in)):

1. Damping H_d = H + 0.025 * mean(diag H) * I. Regularization of W as the weight-only encoder (random signs,
   channel scales, Hadamard: the trellis codes x = P S^-1 W^T diag(1/sv) P, S = diag(su)), and the Hessian in the
   same rotated basis, H' = P S H_d S P. S carries the input channel scales as well as the signs, so that an error
   left in a row of x is weighed by what it costs at the layer's output (the reference's ``--scaled_hessian``;
   ``HESSIAN_SCALES = False`` gives its default, signs only).
2. Block LDL of H' with 16x16 blocks (fq.codec.ldl). Not positive definite: retried with the damping times
   DAMPING_RETRY, up to DAMPING_RETRIES times (a RuntimeWarning says so), then an FqError naming the matrix.
3. Global scale search as the weight-only encoder, on the sample tiles times an LDLQ drift factor (K1 1.08,
   K2 1.018, K3 1.004, K >= 4 1.0; error feedback inflates the tiles the trellis actually sees).
4. LDLQ: the input dimension in 16-row blocks from the last to the first; block b is coded (one Viterbi call
   per block, over the tiles of every matrix of the batch) against W_b + sum_{r > b} L[r, b]^T (W_r - Q_r) of
   the rows already coded; the feedback of a finished 128-row span is added to all earlier rows at once.
5. suh/svh refit in the H_d metric with the trellis fixed: two rounds of a closed form per output channel and
   a solve for the input channels ((Q Q^T) o H_d) r = rowsum(Q o H_d W) (Jacobi-preconditioned conjugate
   gradients, a fixed maximum of iterations). Kept only if the proxy error of the stored (fp16) tensors drops and
   the scales stay finite in fp16.
6. ``proxy_err`` = tr(E H E^T) / tr(W H W^T), E = W_hat - W, H as given (undamped), of the stored tensors.
   A residual stage (``parents``) encodes W - reconstruct_chain(parents) in the same metric.

A W whose dims are not multiples of 128 is coded zero-padded, as exllamav3 stores it (``fq.codec.shape``); H is given
at W's own width (calibration captures it there) and zero-padded, which is the Hessian exllamav3 captures at the padded
width (it zero-extends the input), so step 1's mean is over the padded diagonal, as exllamav3's is; the added
channels get zero scales (step 1 of the weight-only encoder) and reconstruct to exactly zero. The errors, the refit's
acceptance and ``proxy_err`` are over W's own entries.

This module is the whole-matrix path (the walk ``ldlq``, ``refit_scales``, batching, acceptance); the building blocks
it shares with fq.codec.chunked (metric, factorization, feedback, conjugate gradients) and the constants named above
are in fq.codec.ldlq_parts, the scale search in fq.codec.scale_search. A matrix wider than a chunk of the memory
budget is sent to fq.codec.chunked, to the same bytes.

Determinism (the hard requirement): given (W, H, K, codebook, seed) the bytes are the same on any CPU (AVX2 or
AVX-512 BLAS, any thread count) and on CUDA. No BLAS, cuBLAS, cuSOLVER or LAPACK result decides a bit:

- elementwise float64 operations (IEEE, the same on every device; never ``tensor / python_float``, which CUDA
  turns into a multiply), fq.codec.exact's fixed-order ``tree_sum`` for every reduction, exact max/min, and
  the Viterbi kernels (CPU and CUDA bit-identical) on float32 tiles made by those operations;
- every large product is exact (fq.codec.gridmm): operands rounded onto power-of-two grids chosen from their
  largest magnitude, bits_a + bits_b + ceil(log2(inner)) <= 53, so each part product is an integer GEMM with
  every partial sum an integer below 2^53, hence order-independent, FMA or not, and asserted. The error
  feedback and the LDL's updates use two parts per operand (about 46 bits relative to the largest entry, three
  GEMMs); the refit's and the proxy error's products one part each (20 bits at inner dimension 6144; the refit's
  (in, in) system two parts), since what they decide is rounded to fp16 or only reported;
- the LDL's 16x16 block factorizations run in a fixed scalar order in numpy on the host (fq.codec.ldl);
- Hessians are equilibrated by powers of two (exact) before any grid is chosen, so a grid's precision is
  relative to each channel's own scale rather than the largest channel's.
"""
from __future__ import annotations

import torch

from fq.codec import chunked
from fq.codec.codebook import marker_value, values_torch
from fq.codec.encoder import _Clock, pad_to, target
from fq.codec.exact import div, tree_sum
from fq.codec.gridmm import budget, grid_mm, pow2, split
from fq.codec.hadamard import had_cols, had_rows
from fq.codec.ldl import BLOCK, PANEL
from fq.codec.ldlq_parts import (REFIT_ROUNDS, SIGMA_REG, _cg, _factor, _feedback, _Metric, _rows_to_tiles,
                                 _tiles_to_rows, ldlq_drift)
from fq.codec.packing import pack, tiles_to_matrix
from fq.codec.regularize import regularize
from fq.codec.scale_search import Encoded, _fp16, _viterbi, check_scales, pipeline_device, search_scales
from fq.codec.shape import padded
from fq.codec.tensors import trim, unrotate
from fq.errors import FqError

# scale refits batched together: about 40 k^2 bytes each (their (k, k) systems, grids and temporaries)
REFIT_BYTES = {"cpu": 1 << 30, "cuda": 16 << 30}
# matrices whose Hessians are factored (and coded) together: their float64 (in, in) factors fit in this
GROUP_BYTES = {"cpu": 1 << 30, "cuda": 16 << 30}  # cuda: 53 factors of 6144 (GLM-5 gate/up), 512 of 2048


# ---------------------------------------------------------------------------------------------- the H metric


def proxy_error(W: torch.Tensor, W_hat: torch.Tensor, H: torch.Tensor) -> float:
    """tr(E H E^T) / tr(W H W^T), E = W_hat - W; W, W_hat torch (out, in), H (in, in). Computed on W's device
    with exact grid products and fixed-order sums, so the value is the same on every device. 0 for W = 0 and
    W_hat = 0; inf when tr(W H W^T) <= 0 but the error is not zero."""
    if not isinstance(W, torch.Tensor) or not isinstance(W_hat, torch.Tensor) or not isinstance(H, torch.Tensor):
        raise FqError("proxy_error: W, W_hat and H must be torch tensors")
    if W.dim() != 2 or W_hat.shape != W.shape:
        raise FqError(f"proxy_error: W {tuple(W.shape)} and W_hat {tuple(W_hat.shape)} must be the same (out, in)")
    if H.dim() != 2 or tuple(H.shape) != (W.shape[1], W.shape[1]):
        raise FqError(f"proxy_error: H {tuple(H.shape)} must be (in, in) = ({W.shape[1]}, {W.shape[1]})")
    dev = W.device
    W64 = W.detach().to(torch.float64)
    m = _Metric(_symmetric(H.detach().to(dev, torch.float64)))
    den = m.quad(W64)
    num = m.quad(W_hat.detach().to(dev, torch.float64) - W64)
    if den > 0:
        return num / den
    return 0.0 if num == 0 else float("inf")


def _symmetric(H: torch.Tensor) -> torch.Tensor:
    return (H + H.t()) * 0.5


def check_hessian(H, in_f: int, name: str, device: torch.device) -> torch.Tensor:
    """H validated and symmetrized, float64 on ``device``."""
    if not isinstance(H, torch.Tensor):
        raise FqError(f"{name}: Hessian H: expected a torch.Tensor, got {type(H).__name__}")
    if H.dim() != 2 or not H.is_floating_point() or tuple(H.shape) != (in_f, in_f):
        raise FqError(f"{name}: Hessian H: expected a floating-point (in, in) = ({in_f}, {in_f}) matrix, got "
                      f"{str(H.dtype).removeprefix('torch.')} {tuple(H.shape)}")
    H = H.detach().to(device).to(torch.float64)
    if not bool(torch.isfinite(H).all()):
        bad = (~torch.isfinite(H)).nonzero()[0].tolist()
        raise FqError(f"{name}: Hessian H contains NaN or Inf (first at [{bad[0]}, {bad[1]}]); "
                      "the calibration capture overflowed or saw no finite activations")
    peak = float(H.abs().max())
    asym = float((H - H.t()).abs().max())
    if asym > 1e-3 * peak:
        raise FqError(f"{name}: Hessian H is not symmetric (max |H - H^T| = {asym:.4g}, max |H| = {peak:.4g})")
    H = _symmetric(H)
    mean = float(div(tree_sum(torch.diagonal(H).clone()), in_f))
    if not mean > 0:
        raise FqError(f"{name}: Hessian H has no usable energy (mean diagonal {mean:.4g}): encode this matrix "
                      "weight-only (fq.codec.encode)")
    return H


# ---------------------------------------------------------------------------------------------- LDLQ


def _stacks(widths: list[int]) -> list[list[int]]:
    """Indices of the matrices grouped by width (n), in order of first appearance."""
    out: dict[int, list[int]] = {}
    for i, n in enumerate(widths):
        out.setdefault(n, []).append(i)
    return list(out.values())


def ldlq(targets: list, L: torch.Tensor, F: torch.Tensor, K: int, codebook: str, device) -> list:
    """targets: per matrix the rotated, scaled weight (in, n_i) float64; L (B, in, in) the strictly block-lower
    factors of the equilibrated Hessians, F (B, in) their equilibration exponents. Returns per matrix its states
    (in/16, n_i/16, 256) int32 on ``device``. Matrices of one width are stacked (batched products, exact per
    matrix); each 16-row step codes the tiles of every matrix in one Viterbi call."""
    k = targets[0].shape[0]
    values = values_torch(codebook, device)
    stacks = []
    for idx in _stacks([t.shape[1] for t in targets]):
        contiguous = idx == list(range(idx[0], idx[-1] + 1))
        Ls = L[idx[0] : idx[-1] + 1] if contiguous else L[idx]
        T = torch.stack([targets[i] for i in idx])
        stacks.append(dict(idx=idx, L=Ls, T=T, ds=pow2(-F[idx])[:, :, None], inv=pow2(F[idx])[:, :, None],
                           fb=torch.zeros_like(T),  # feedback of finished spans, in the weight's coordinates
                           et=torch.zeros_like(T),  # Ds^-1 (W - Q) of the rows done
                           st=torch.empty((len(idx), k // BLOCK, T.shape[2] // BLOCK, 256), dtype=torch.int32,
                                          device=device)))
    finite = torch.ones((), dtype=torch.bool, device=device)
    for j in range(k, 0, -PANEL):
        i0 = j - PANEL
        for bj in range(j, i0, -BLOCK):
            bi = bj - BLOCK
            tiles = []
            for s in stacks:
                x = s["T"][:, bi:bj] + s["fb"][:, bi:bj]
                if bj < j:
                    x = x + _feedback(s["L"][:, bj:j, bi:bj], s["et"][:, bj:j]) * s["ds"][:, bi:bj]
                tiles.append(_rows_to_tiles(x.to(torch.float32)))
            flat = torch.cat(tiles) if len(tiles) > 1 else tiles[0]
            finite &= torch.isfinite(flat).all()  # on the device; read once, after the walk
            states = _viterbi(flat, K, codebook, device, check=False)
            at = 0
            for s in stacks:
                b, tn = len(s["idx"]), s["T"].shape[2] // BLOCK
                st = states[at : at + b * tn].reshape(b, tn, 256)
                at += b * tn
                s["st"][:, bi // BLOCK] = st
                q = _tiles_to_rows(values[st.long()]).to(torch.float64)
                s["et"][:, bi:bj] = (s["T"][:, bi:bj] - q) * s["inv"][:, bi:bj]
        if i0 > 0:
            for s in stacks:
                s["fb"][:, :i0] += _feedback(s["L"][:, i0:j, :i0], s["et"][:, i0:j]) * s["ds"][:, :i0]
    if not bool(finite):  # finite targets and factors give finite tiles; this is the guard, not the rule
        raise FqError("LDLQ: the error feedback became NaN or Inf (a Hessian factor overflowed)")
    out = [None] * len(targets)
    for s in stacks:
        for pos, i in enumerate(s["idx"]):
            out[i] = s["st"][pos]
    return out


# ---------------------------------------------------------------------------------------------- refit


def refit_scales(Wt: torch.Tensor, inner: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, Hd: torch.Tensor):
    """New (suh, svh) float64 for the fixed trellis (decoded ``inner`` (in, out)) in the Hd metric, from the
    stored fp16 scales; W^T = Wt (in, out) the target. The model: W_hat^T = diag(a) Qb diag(b), Qb the decoded
    weight rotated back (float64). Two rounds: b_j *= (q_j^T Hd w_j) / (q_j^T Hd q_j) per output channel, then
    a *= r with ((Q Q^T) o Hd) r = rowsum(Q o Hd W). A zero scale stays zero; a non-finite or non-positive
    factor leaves its channel unchanged. Batched: Wt and inner (B, in, out), suh (B, in), svh (B, out), one Hd
    for all; each matrix gets what it would get alone, bit for bit (one kernel per step for the whole batch)."""
    if Wt.dim() == 2:
        a, b = refit_scales(Wt[None], inner[None], suh[None], svh[None], Hd)
        return a[0], b[0]
    B, k, n = Wt.shape
    metric = _Metric(Hd)
    Qb = torch.stack([had_rows(had_cols(x.to(torch.float64))) for x in inner])
    a, b = suh.to(torch.float64), svh.to(torch.float64)
    inv = metric.inv[:, None]
    HW = metric.times(Wt)  # Ds (Hd Wt); with Qt = Ds^-1 Q below, every sum is the unscaled one
    one = torch.ones((), dtype=torch.float64, device=Wt.device)
    for _round in range(REFIT_ROUNDS):
        Q = Qb * a[:, :, None] * b[:, None, :]
        Qt = Q * inv  # Ds^-1 Q
        HQ = metric.times(Q)  # Heq Ds^-1 Q = Ds Hd Q
        num = tree_sum(Qt * HW, 1)  # sum_i (Ds^-1 Q)_ij (Ds Hd W)_ij = q_j^T Hd w_j
        den = tree_sum(Qt * HQ, 1)
        del Qt, HQ
        c = torch.where(den > 0, num / torch.where(den > 0, den, one), one)
        c = torch.where(torch.isfinite(c) & (c > 0), c, one)
        b = b * c
        Q = Q * c[:, None, :]
        # input side: A = (Q Q^T) o Hd, rhs = rowsum(Q o Hd W)
        bq = budget(n)
        A = grid_mm(split(Q, bq // 2, 1, batch_dims=1), split(Q.transpose(1, 2).contiguous(), bq - bq // 2, 1,
                                                               batch_dims=1)) * Hd
        rhs = tree_sum(Q * (HW * inv), 2)  # Q o (Hd W)
        del Q
        bk = budget(k)
        diag = torch.diagonal(A, dim1=1, dim2=2).clone()
        Ag = split(A, bk // 2, 2, batch_dims=1)
        del A
        r = _cg(Ag, diag, rhs, bk - bk // 2)
        del Ag
        r = torch.where(torch.isfinite(r) & (r > 0), r, one)
        a = a * r
    return a, b


# ---------------------------------------------------------------------------------------------- encoder


def _coded(W64, su, sv, g, states, K, codebook, metric, shape) -> dict:
    """A matrix as the LDLQ walk left it: packed trellis, decoded inner matrix, its fp16 scales and proxy error
    (``metric``: H at W's own width; the sums over W's own ``shape``, W_hat trimmed to it)."""
    dev = states.device
    inner = tiles_to_matrix(values_torch(codebook, dev)[states.long()])
    suh, svh = _fp16(div(su, g)), _fp16(sv)
    W_hat = trim(unrotate(inner, suh, svh), shape)
    W64 = trim(W64, shape)
    return dict(trellis=pack(states, K), inner=inner, suh=suh, svh=svh, W_hat=W_hat, den=metric.quad(W64),
                num=metric.quad(W_hat.double() - W64), g=float(g))


def _refit_all(W64s: list, coded: list, Hds: list, damping: list, device: torch.device) -> list:
    """refit_scales for every matrix, batched over those of one damped Hessian and width, REFIT_BYTES of working
    set at a time. Returns (a, b) per matrix."""
    out = [None] * len(coded)
    k = coded[0]["inner"].shape[0]
    per = max(1, REFIT_BYTES.get(device.type, 1 << 30) // (40 * k * k))  # A, its grid parts and temporaries
    same: dict[tuple, list[int]] = {}  # one damped H and one width per batch
    for j, d in enumerate(damping):
        same.setdefault((id(Hds[j]), d, coded[j]["inner"].shape[1]), []).append(j)
    for idx in same.values():
        for c0 in range(0, len(idx), per):
            part = idx[c0 : c0 + per]
            a, b = refit_scales(torch.stack([W64s[j].t() for j in part]), torch.stack([coded[j]["inner"] for j in part]),
                                torch.stack([coded[j]["suh"] for j in part]), torch.stack([coded[j]["svh"] for j in part]),
                                Hds[part[0]])
            for pos, j in enumerate(part):
                out[j] = (a[pos], b[pos])
    return out


def _finish(W64, c: dict, a: torch.Tensor, b: torch.Tensor, codebook: str, metric, shape) -> Encoded:
    """Keep the refit scales if the stored (fp16) tensors' proxy error drops; measure (over W's own ``shape``)."""
    suh, svh, W_hat, num, den = c["suh"], c["svh"], c["W_hat"], c["num"], c["den"]
    suh2, svh2 = _fp16(a), _fp16(b)
    W64 = trim(W64, shape)
    if bool(torch.isfinite(suh2).all()) and bool(torch.isfinite(svh2).all()):
        W_hat2 = trim(unrotate(c["inner"], suh2, svh2), shape)
        num2 = metric.quad(W_hat2.double() - W64)
        if num2 < num:
            suh, svh, W_hat, num = suh2, svh2, W_hat2, num2
    tensors = {"trellis": c["trellis"].cpu(), "suh": suh.cpu(), "svh": svh.cpu()}
    marker = marker_value(codebook)
    if marker is not None:
        tensors[codebook] = torch.tensor(marker, dtype=torch.int32)
    d = W_hat.double() - W64
    sw = float(tree_sum((W64 * W64).flatten()))
    se = float(tree_sum((d * d).flatten()))
    proxy = num / den if den > 0 else (0.0 if num == 0 else float("inf"))
    return Encoded(tensors, W_hat, se / sw if sw > 0 else 0.0, c["g"], sum_sq_w=sw, sum_sq_err=se, proxy_err=proxy)


def _groups(n: int, k: int, device: torch.device):
    per = max(1, GROUP_BYTES.get(device.type, 1 << 30) // (8 * k * k))
    return [list(range(i, min(i + per, n))) for i in range(0, n, per)]


def _encode_many(Ws, H, K, codebook, seeds, device, names, parents, timings, chunk=None) -> list[Encoded]:
    device = pipeline_device(device)
    clock = _Clock(timings, device)
    W64s, shapes = [], []  # the padded targets (fq.codec.encoder.target), and each W's own (out, in)
    for i, W in enumerate(Ws):
        W64, shape = target(W, K, codebook, seeds[i], names[i], device, None if parents is None else parents[i])
        W64s.append(W64)
        shapes.append(shape)
    in_f = shapes[0][1]
    shared = not isinstance(H, (list, tuple))
    for shape, name in zip(shapes, names):
        if shape[1] != in_f:
            raise FqError(f"{name}: in_features {shape[1]}; the matrices of one batch are coded together, so all "
                          f"need in = {in_f}")
    if not shared and len(H) != len(Ws):
        raise FqError(f"encode_ldlq_batch: {len(Ws)} weights need one Hessian each or one for all, got {len(H)}")
    # per distinct Hessian: H at W's own width (as calibration captures it), the metric of proxy errors over W's own
    # entries, and Hc: a padded W's added input channels see zero activations (exllamav3 zero-extends the input, so
    # a Hessian it captures at the padded width has zero rows and columns there): H is zero-padded, then damped over
    # the padded diagonal (_damped), as exllamav3 damps the Hessian it captured. The same matrix when in is 128-aligned
    seen: dict[int, tuple] = {}
    per = []
    for i, h in enumerate([H] * len(Ws) if shared else H):
        if id(h) not in seen:
            hname = names[i] if len(names) == 1 or not shared else f"{names[0]} (and the batch sharing its H)"
            H_own = check_hessian(h, in_f, hname, device)
            seen[id(h)] = (H_own, _Metric(H_own), pad_to(H_own, (padded(in_f), padded(in_f))))
        per.append(seen[id(h)])
    clock("check")
    if len(W64s) == 1:  # one matrix wider than a chunk of the memory budget: by chunks, the same bytes
        C = chunked.chunk_columns(W64s[0].shape[1], W64s[0].shape[0], device, chunk)
        if C < W64s[0].shape[0]:
            return [chunked.encode_ldlq(W64s[0], shapes[0], per[0][0], per[0][2], K, codebook, seeds[0], names[0],
                                        device, C, clock)]
    out = []
    for group in _groups(len(W64s), padded(in_f), device):
        regs = [regularize(W64s[i].t(), seeds[i]) for i in group]
        clock("regularize")
        # the factorization first: a Hessian that cannot be used fails before any trellis search
        L, F, damping, Hds = _factor([per[i][2] for i in group], [SIGMA_REG] * len(group), [su for _, su, _ in regs],
                                     [names[i] for i in group], device)
        clock("hessian")
        drift = ldlq_drift(K)
        gs = search_scales([x * drift for x, _, _ in regs], K, codebook, device)
        for (_, su, sv), g, i in zip(regs, gs, group):
            check_scales(W64s[i], su, sv, g, names[i])
        clock("search")
        targets = [x * g for (x, _, _), g in zip(regs, gs)]
        states = ldlq(targets, L, F, K, codebook, device)
        del L, targets
        clock("ldlq")
        coded = [_coded(W64s[i], su, sv, gs[j], states[j], K, codebook, per[i][1], shapes[i])
                 for j, (i, (_, su, sv)) in enumerate(zip(group, regs))]
        del states, regs
        clock("finish")
        scales = _refit_all([W64s[i] for i in group], coded, Hds, damping, device)
        clock("refit")
        for j, i in enumerate(group):
            out.append(_finish(W64s[i], coded[j], *scales[j], codebook, per[i][1], shapes[i]))
            W64s[i] = coded[j] = None
        clock("finish")
    return out


def encode_ldlq(W: torch.Tensor, H: torch.Tensor, K: int, codebook: str = "mul1", seed: int = 0, device=None, *,
                parents: list | None = None, name: str = "W", timings: dict | None = None,
                chunk: int | None = None) -> Encoded:
    """Encode a torch Linear weight W (out, in) with its input Hessian H (in, in), W's own width (LDLQ, see the module
    docstring; a W that is not 128-aligned is coded zero-padded). ``parents``: a parent chain makes this a residual stage (W - reconstruct_chain(parents), in
    the same H metric). ``device``: None/"cpu" or a CUDA device; both give the same bytes, W_hat and sums.
    ``timings``: if a dict, wall seconds per stage are added to it. ``chunk``: output channels per chunk (a power of
    two >= 128; default from the memory budget, fq.codec.chunked.chunk_columns): a wider W is encoded chunk by chunk,
    to the same bytes and sums, in bounded memory (an lm_head), and its W_hat is returned on the CPU."""
    return _encode_many([W], H, K, codebook, [seed], device, [name], None if parents is None else [parents],
                        timings, chunk)[0]


def encode_ldlq_batch(Ws: list, H: "torch.Tensor | list", K: int, codebook: str = "mul1", seeds=0, device=None, *,
                      parents: list | None = None, names: list | None = None,
                      timings: dict | None = None) -> list[Encoded]:
    """Encode matrices of one input width together: H one input Hessian they share (e.g. gate and up of every
    expert of a layer) or a list of one per matrix (e.g. every expert's down projection); per matrix the Encoded
    encode_ldlq would give, bit for bit. ``seeds``: one int or one per matrix; ``parents``: None or,
    per matrix, None or its parent chain; ``names``: for messages (default Ws[i]). The Hessians are factored
    and the LDLQ steps coded together, one Viterbi call per 16-row step for all matrices of a group (groups
    hold GROUP_BYTES of float64 factors)."""
    Ws = list(Ws)
    seeds = [seeds] * len(Ws) if isinstance(seeds, int) and not isinstance(seeds, bool) else list(seeds)
    names = [f"Ws[{i}]" for i in range(len(Ws))] if names is None else [str(n) for n in names]
    if not Ws:
        return []
    if len(seeds) != len(Ws) or len(names) != len(Ws) or (parents is not None and len(parents) != len(Ws)):
        raise FqError(f"encode_ldlq_batch: {len(Ws)} weights need as many seeds ({len(seeds)}), names "
                      f"({len(names)}) and parent chains ({'none' if parents is None else len(parents)})")
    return _encode_many(Ws, H, K, codebook, seeds, device, names, parents, timings)
