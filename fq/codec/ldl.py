"""Block LDL factorization with 16x16 blocks whose bits do not depend on the BLAS, the CPU or the GPU.

H = L D L^T with L unit block-lower-triangular (16x16 identity blocks on the diagonal) and D block-diagonal
(16x16 blocks), as the reference's Cholesky-based ``block_ldl``, computed as a right-looking blocked
factorization in float64:

- panels of 128 columns; within a panel, block column j (16 wide): D_j = the current diagonal block
  (symmetrized from its lower triangle), D_j^-1 through a 16x16 Cholesky and a triangular inverse done in a
  fixed scalar order (numpy elementwise operations on the host, batched over the matrices; on CUDA a kernel doing
  the same IEEE operations in the same order, fq.codec.viterbi_cuda.chol_inv16_cuda, so the GPU never waits on
  the host), L_j = A_j D_j^-1 in a fixed order (16 elementwise
  multiply-adds on the device, never fused), then the rest of the panel A -= L_j A_j^T;
- after a panel, the trailing matrix A -= L_panel A_panel^T (A_panel: the panel's columns as factored),
  lower block triangle only, in column chunks.

Every product that sums more than 16 terms is an exact grid product (fq.codec.gridmm, parts (2, 2): about 46
bits of each operand relative to its largest entry, three integer GEMMs), so its bits cannot depend on how a
BLAS orders it. The caller equilibrates H first (a power-of-two scaling of rows and columns that brings the
diagonal into [1/4, 1)), which keeps every entry of A within [-1, 1] for a positive definite H, so the grids
lose nothing that matters against the damping.

A matrix whose pivot block is not positive definite (a Cholesky pivot <= 0 or not finite) is reported in
``ok``; its factorization stops there (its L is left zero from that block on) while the others go on.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from fq.codec.gridmm import budget, grid_mm, split

BLOCK = 16
PANEL = 128
CHUNK = 512  # trailing-update column chunk


def chol_inv16(D: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """D: (B, 16, 16) float64 symmetric. Returns (D^-1, ok) by a Cholesky D = C C^T and C^-1, in a fixed
    order of elementwise float64 operations. A matrix whose pivot fails gets the identity and ok False."""
    B, n, _ = D.shape
    C = np.zeros_like(D)
    ok = np.ones(B, dtype=bool)
    for c in range(n):
        v = D[:, c:, c].copy()
        for t in range(c):
            v = v - C[:, c:, t] * C[:, c, t][:, None]
        piv = v[:, 0]
        good = np.isfinite(piv) & (piv > 0.0) & np.isfinite(v).all(axis=1)
        ok &= good
        piv = np.where(good, piv, 1.0)
        d = np.sqrt(piv)
        C[:, c, c] = d
        C[:, c + 1 :, c] = np.where(good[:, None], v[:, 1:], 0.0) / d[:, None]
    X = np.zeros_like(D)  # C^-1 (lower), row by row
    for i in range(n):
        r = np.zeros((B, n))
        r[:, i] = 1.0
        for t in range(i):
            r = r - C[:, i, t][:, None] * X[:, t, :]
        X[:, i, :] = r / C[:, i, i][:, None]
    inv = X[:, 0, :, None] * X[:, 0, None, :]  # D^-1 = C^-T C^-1 = sum_t X[t]^T X[t]
    for t in range(1, n):
        inv = inv + X[:, t, :, None] * X[:, t, None, :]
    eye = np.broadcast_to(np.eye(n), D.shape)
    inv = np.where(ok[:, None, None], inv, eye)
    return inv, ok


def _times_small(x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x (B, p, 16) @ m (B, 16, 16) as 16 multiply-adds in a fixed order (separate mul and add kernels)."""
    acc = x[..., 0:1] * m[:, None, 0, :]
    for t in range(1, m.shape[1]):
        acc = acc + x[..., t : t + 1] * m[:, None, t, :]
    return acc


def _sym_lower(D: torch.Tensor) -> torch.Tensor:
    low = torch.tril(D)
    return low + torch.tril(D, -1).transpose(-2, -1)


def _block_factors(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """chol_inv16 of the blocks D (B, 16, 16) (lower triangle read), on D's device: the CUDA kernel (the same bits,
    queued without a host round trip), else numpy on the host. Returns (D^-1, good) as tensors on D's device."""
    if D.device.type == "cuda" and os.environ.get("FQ_VITERBI_CUDA", "kernel") != "torch":
        from fq.codec import viterbi_cuda

        try:
            return viterbi_cuda.chol_inv16_cuda(D)
        except viterbi_cuda.CudaViterbiUnavailable:
            pass  # fq.codec.viterbi warns once when the library cannot be built; the host path gives the same bits
    inv, good = chol_inv16(_sym_lower(D).cpu().numpy())
    return torch.from_numpy(inv).to(D.device), torch.from_numpy(good).to(D.device)


def block_ldl(H: torch.Tensor, overwrite: bool = False) -> tuple[torch.Tensor, np.ndarray]:
    """H: (B, k, k) float64, symmetric, k a multiple of 128, equilibrated (see the module docstring).
    Returns (L, ok): L (B, k, k) float64 holding the strictly block-lower part of the unit block-lower factor
    (zero on and above the diagonal blocks), and ok (B,) numpy bool. ``overwrite``: factor in H's own
    storage (a float64 H is then returned as L) instead of a copy."""
    if H.dim() != 3 or H.shape[1] != H.shape[2] or H.shape[1] % PANEL:
        raise ValueError(f"block_ldl: expected (B, k, k) with k a multiple of {PANEL}, got {tuple(H.shape)}")
    B, k, _ = H.shape
    dev = H.device
    A = H.to(torch.float64)
    if A is H and not overwrite:
        A = A.clone()
    ok = torch.ones(B, dtype=torch.bool, device=dev)  # stays on the device: no host round trip per block on CUDA
    zero = torch.zeros((), dtype=torch.float64, device=dev)
    b16 = budget(BLOCK)
    bp = budget(PANEL)
    for p0 in range(0, k, PANEL):
        p1 = p0 + PANEL
        Ap = torch.zeros((B, k - p0, PANEL), dtype=torch.float64, device=dev)  # panel columns as factored
        Lp = torch.zeros_like(Ap)
        for j0 in range(p0, p1, BLOCK):
            j1 = j0 + BLOCK
            inv, good = _block_factors(A[:, j0:j1, j0:j1])
            ok &= good
            if j1 == k:
                break
            col = A[:, j1:, j0:j1]
            if dev.type != "cpu" or not bool(ok.all()):  # a failed matrix stops here: its L stays zero
                col = torch.where(ok[:, None, None], col, zero)
            Lcol = _times_small(col, inv)
            Ap[:, j1 - p0 :, j0 - p0 : j1 - p0] = col
            Lp[:, j1 - p0 :, j0 - p0 : j1 - p0] = Lcol
            if j1 < p1:  # the rest of this panel's columns, rows j1..k
                Lg = split(Lcol, b16 // 2, 2, batch_dims=1, check=False)
                Cg = split(col[:, : p1 - j1, :].contiguous(), b16 - b16 // 2, 2, batch_dims=1, check=False)
                A[:, j1:, j1:p1] -= grid_mm(Lg, Cg.t())
        if p1 < k:  # trailing matrix, lower block triangle, by column chunks
            Lg = split(Lp[:, p1 - p0 :, :].contiguous(), bp // 2, 2, batch_dims=1, check=False)
            Ag = split(Ap[:, p1 - p0 :, :].contiguous(), bp - bp // 2, 2, batch_dims=1, check=False)
            for c0 in range(p1, k, CHUNK):
                c1 = min(c0 + CHUNK, k)
                A[:, c0:, c0:c1] -= grid_mm(Lg.rows(c0 - p1, k - p1), Ag.rows(c0 - p1, c1 - p1).t())
        A[:, p0:, p0:p1] = Lp
        A[:, :p0, p0:p1] = 0.0
    return A, ok.cpu().numpy()
