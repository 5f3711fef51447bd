"""The building blocks of the calibrated LDLQ encoder that its whole-matrix path (fq.codec.ldlq) and its chunked path
(fq.codec.chunked) share: the H metric (``_Metric``), the Hessian's damping, rotation and block LDL with retries
(``_factor``), the walk's error feedback and row/tile reshapes, the refit's conjugate gradients, and their constants.
fq.codec.ldlq's docstring describes the algorithm and why every bit is reproducible.
"""
from __future__ import annotations

import warnings

import torch

from fq.codec.exact import div, tree_sum
from fq.codec.gridmm import budget, grid_mm, pow2, split
from fq.codec.hadamard import had_cols, had_rows
from fq.codec.ldl import BLOCK, block_ldl
from fq.codec.packing import tensor_core_perm, tensor_core_perm_inverse
from fq.errors import FqError

SIGMA_REG = 0.025  # damping: this share of H's mean diagonal is added to its diagonal
DAMPING_RETRY = 10.0  # a Hessian that is not positive definite is retried with the damping times this
DAMPING_RETRIES = 3
LDLQ_DRIFT = {1: 1.08, 2: 1.018, 3: 1.004}  # the reference's, integer K (K >= 4: 1.0)
HESSIAN_SCALES = True
REFIT_ROUNDS = 2
CG_ITERS = 32
CG_TOL = 1e-12  # stop when the residual's squared norm falls below this share of the first one (fp16 scales need far less)


def ldlq_drift(K) -> float:
    """The drift at K; at a half-integer K the geometric mean of its integer neighbours'."""
    if isinstance(K, float):
        return (LDLQ_DRIFT.get(int(K), 1.0) * LDLQ_DRIFT.get(int(K) + 1, 1.0)) ** 0.5
    return LDLQ_DRIFT.get(int(K), 1.0)


# ---------------------------------------------------------------------------------------------- the H metric


def _equilibration(d: torch.Tensor) -> torch.Tensor:
    """Power-of-two exponents f (int64) with d * 4^-f in [1/4, 1) for each positive d (0 elsewhere)."""
    _, e = torch.frexp(d)
    f = torch.div(e.to(torch.int64) + 1, 2, rounding_mode="floor")
    return torch.where(torch.isfinite(d) & (d > 0), f, torch.zeros_like(f))


class _Metric:
    """tr(E H E^T) and H @ X for one symmetric H (in, in), through an exact grid product: H equilibrated by
    powers of two (Heq = Ds H Ds, Ds = 2^-f), rounded once onto a grid of ``bits`` bits."""

    def __init__(self, H: torch.Tensor):
        k = H.shape[0]
        self.f = _equilibration(torch.diagonal(H).clone())
        self.ds, self.inv = pow2(-self.f), pow2(self.f)
        self.bits = budget(k) // 2
        self.g = split(H * self.ds[:, None] * self.ds[None, :], self.bits, 1)
        self.k = k

    def quad(self, E: torch.Tensor) -> float:
        """tr(E H E^T) for E (rows, in), float64 on H's device (a fixed-order sum)."""
        Et = E * self.inv[None, :]  # E Ds^-1: tr(E H E^T) = tr(Et Heq Et^T)
        T = grid_mm(split(Et, budget(self.k) - self.bits, 1), self.g)
        return float(tree_sum((T * Et).flatten()))

    def times(self, X: torch.Tensor) -> torch.Tensor:
        """Heq @ (Ds^-1 X) for X (in, n) or a batch (B, in, n): H X in the equilibrated coordinates, Ds (H X)
        (each matrix of a batch on its own grid, so its result is the one it would get alone)."""
        Xt = X * self.inv[:, None]
        return grid_mm(self.g, split(Xt, budget(self.k) - self.bits, 1, batch_dims=X.dim() - 2))


def _damped(H: torch.Tensor, sigma: float) -> torch.Tensor:
    k = H.shape[0]
    mean = div(tree_sum(torch.diagonal(H).clone()), k)
    eye = torch.eye(k, dtype=torch.float64, device=H.device)
    return H + eye * (mean * sigma)


def _channel_weights(su: torch.Tensor) -> torch.Tensor:
    """The input-side scale vector S of the rotated metric: su (zero channels get the smallest non-zero |su|,
    which keeps H' positive definite; their weights reconstruct to zero whatever the trellis holds)."""
    if not HESSIAN_SCALES:
        return torch.where(su < 0, -torch.ones_like(su), torch.ones_like(su))
    nz = su != 0
    if not bool(nz.any()):
        return torch.ones_like(su)
    fill = su.abs()[nz].amin()
    return torch.where(nz, su, fill)


def rotated_hessian(Hd: torch.Tensor, su: torch.Tensor) -> torch.Tensor:
    """P S Hd S P: the damped Hessian in the basis the trellis codes (rows of x), float64 butterflies."""
    s = _channel_weights(su)
    return had_cols(had_rows(Hd * s[:, None] * s[None, :]))


# ---------------------------------------------------------------------------------------------- factors


def _factor(Hs: list, sigmas: list[float], sus: list, names: list[str], device) -> tuple:
    """Block LDL of each matrix's rotated, equilibrated Hessian. Returns (L (B, k, k), f (B, k) exponents of the
    equilibration, the damping each matrix needed, Hd per matrix: one tensor shared by the matrices of one H and
    one damping, not a (k, k) copy each)."""
    n = len(sus)
    k = Hs[0].shape[0]
    L = None
    F = torch.zeros((n, k), dtype=torch.int64, device=device)
    used = list(sigmas)
    Hds = [None] * n
    damped: dict[tuple[int, float], torch.Tensor] = {}
    todo = list(range(n))
    for attempt in range(DAMPING_RETRIES + 1):
        if not todo:
            break
        stack = torch.empty((len(todo), k, k), dtype=torch.float64, device=device)
        for j, i in enumerate(todo):
            key = (id(Hs[i]), used[i])
            if key not in damped:
                damped[key] = _damped(Hs[i], used[i])
            Hds[i] = damped[key]
            R = rotated_hessian(Hds[i], sus[i])
            f = _equilibration(torch.diagonal(R).clone())
            ds = pow2(-f)
            F[i] = f
            stack[j] = R * ds[:, None] * ds[None, :]
            del R
        Ls, ok = block_ldl(stack, overwrite=True)
        del stack
        failed = [i for j, i in enumerate(todo) if not ok[j]]
        if L is None:
            L = Ls  # the first attempt covers every matrix
        else:
            for j, i in enumerate(todo):
                if ok[j]:
                    L[i] = Ls[j]
        del Ls
        if failed and attempt == DAMPING_RETRIES:
            i = failed[0]
            raise FqError(f"{names[i]}: Hessian H is not positive definite even with a damping of {used[i]:g} x its "
                          "mean diagonal; check the calibration capture (H must be X^T X / count)")
        for i in failed:
            warnings.warn(f"{names[i]}: Hessian H is not positive definite with a damping of {used[i]:g} x its mean "
                          f"diagonal; retrying with {used[i] * DAMPING_RETRY:g}", RuntimeWarning, stacklevel=4)
            used[i] *= DAMPING_RETRY
        todo = failed
    return L, F, used, Hds


# ---------------------------------------------------------------------------------------------- LDLQ


def _feedback(L: torch.Tensor, Et: torch.Tensor) -> torch.Tensor:
    """L^T @ Et exactly on grids, batched: L (b, r, c) blocks of the factors, Et (b, r, n) scaled errors ->
    (b, c, n). Two parts per operand (about 46 bits each); the grids are per batch element, so a matrix's
    result does not depend on the others."""
    bits = budget(L.shape[1])
    Lg = split(L.transpose(1, 2).contiguous(), bits // 2, 2, batch_dims=1, check=False)
    return grid_mm(Lg, split(Et, bits - bits // 2, 2, batch_dims=1, check=False))


def _rows_to_tiles(x: torch.Tensor) -> torch.Tensor:
    """(b, 16, n) rows -> (b * n/16, 256) tiles in tensor-core order (fq.codec.packing.matrix_to_tiles per row
    block)."""
    b, _, n = x.shape
    t = x.reshape(b, BLOCK, n // BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(b, n // BLOCK, 256)
    return t[..., tensor_core_perm(x.device)].reshape(-1, 256)


def _tiles_to_rows(v: torch.Tensor) -> torch.Tensor:
    """(b, n/16, 256) tensor-core tiles -> (b, 16, n) rows."""
    b, tn, _ = v.shape
    rm = v[..., tensor_core_perm_inverse(v.device)]
    return rm.reshape(b, tn, BLOCK, BLOCK).permute(0, 2, 1, 3).reshape(b, BLOCK, tn * BLOCK)


# ---------------------------------------------------------------------------------------------- refit


def _cg(Ag, diag: torch.Tensor, rhs: torch.Tensor, bits_v: int) -> torch.Tensor:
    """Solve A r = rhs from r = 1 by Jacobi-preconditioned conjugate gradients, for a batch: Ag the grid of A
    (B, k, k), diag and rhs (B, k). A's products with a vector are exact, dot products fixed-order, at most
    CG_ITERS iterations. A solve that has converged (or broken down) is frozen where it stands while the others
    go on, which gives each matrix the numbers it would get by stopping alone; the host looks once per iteration."""
    def mv(v):
        return grid_mm(Ag, split(v[..., None], bits_v, 1, batch_dims=1, check=False))[..., 0]

    def dot(a, b):
        return tree_sum(a * b)

    M = torch.where(diag > 0, diag, torch.ones_like(diag))
    r = torch.ones_like(rhs)
    res = rhs - mv(r)
    z = res / M
    p = z
    rz = dot(res, z)
    rr0 = dot(res, res)
    done = torch.zeros(rhs.shape[0], dtype=torch.bool, device=rhs.device)
    for _ in range(CG_ITERS):
        done = done | ~(rz > 0) | (dot(res, res) <= CG_TOL * rr0)
        if bool(done.all()):
            break
        Ap = mv(p)
        pAp = dot(p, Ap)
        done = done | ~(pAp > 0)
        alpha = (rz / pAp)[:, None]
        d = done[:, None]
        r = torch.where(d, r, r + p * alpha)
        res = torch.where(d, res, res - Ap * alpha)
        z = res / M
        rz_new = dot(res, z)
        p = torch.where(d, p, z + p * (rz_new / rz)[:, None])
        rz = torch.where(done, rz, rz_new)
    return r
