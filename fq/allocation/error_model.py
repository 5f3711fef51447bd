"""What an LDLQ trellis encode's error looks like, without encoding: its shape and its size at each K.

LDLQ codes the input dimension with error feedback: with the (rotated, damped) Hessian H = (I + L) D (I + L)^T, L
strictly lower triangular (fq's walk goes from the last input block to the first), the stored error is
E = eta (I + L)^-1, where eta is what the trellis quantizer leaves of each fed-back target entry: for Hadamard-
rotated rows, close to i.i.d. with variance d(K) times the row's mean square (the codebook's distortion on a
Gaussian source). So the error's SHAPE is a function of the Hessian alone and its SIZE of K alone:

    E_K ~ sqrt(d(K)) * direction(W, H),   direction = eta (I + L)^-1 in the rotated frame, eta_ij ~ N(0, rms(W_i)^2)

``direction`` draws one such matrix (seeded); fq.allocation.sensitivity measures the Fisher quadratic form of the
model's output in it, and a linear's predicted KL at K is d(K) times that (docs/allocation.md). The rotation is the
encoder's: random signs, then 128-blocks of the Hadamard matrix; the damping is the encoder's (fq.codec.ldlq).

``DISTORTION`` is the relative MSE of fq's weight-only encoder on a 512 x 512 N(0, 1) matrix, per codebook and K
(``fq.codec.encoder.encode(torch.randn(512, 512), K, codebook, seed=0).rel_mse`` after ``torch.manual_seed(0)``):
the trellis codes' own rate-distortion curve. ``HALF_DISTORTION``: the same at the half-integer rates exllamav3
instantiates for mul1 (fq.codec.rate), measured the same way.
"""
from __future__ import annotations

from fq.errors import FqError

# K = 1..8 (module docstring)
DISTORTION = {
    "mul1": (0.27181, 0.068339, 0.017402, 0.004458, 0.001152, 0.000305, 8.5e-05, 2.4e-05),
    "mcg": (0.266398, 0.068499, 0.01743, 0.00453, 0.001198, 0.000322, 9e-05, 2.9e-05),
    "3inst": (0.266576, 0.068859, 0.017774, 0.004622, 0.001209, 0.000326, 9.2e-05, 2.8e-05),
}
HALF_DISTORTION = {"mul1": {1.5: 0.137071, 2.5: 0.034529, 3.5: 0.008815}}
DAMPING = 0.025  # fq.codec.ldlq's: H + DAMPING * mean(diag H) * I
HAD = 128


def candidate_ks(codebook: str) -> tuple:
    """Every K an allocation may give a unit of ``codebook``: 1..8, with mul1 also 1.5, 2.5 and 3.5."""
    return tuple(sorted((*range(1, 9), *HALF_DISTORTION.get(codebook, {}))))


def distortion(K, codebook: str) -> float:
    """Relative MSE of the trellis code at K bits on a Gaussian source; 0 for 16 (kept as published)."""
    if K == 16:
        return 0.0
    if isinstance(K, float) and K in HALF_DISTORTION.get(codebook, {}):
        return HALF_DISTORTION[codebook][K]
    if codebook not in DISTORTION or isinstance(K, float) or not 1 <= K <= 8:
        raise FqError(f"error model: no distortion for K {K} codebook {codebook!r} (K 1..8 or 16, and 1.5, 2.5, "
                      f"3.5 with mul1; codebooks {', '.join(sorted(DISTORTION))})")
    return DISTORTION[codebook][K - 1]


def _rotate(H, signs):
    """B S H S B for B = blockdiag(Hadamard 128)/sqrt(128), S = diag(signs)."""
    from fq.codec.hadamard import had_cols, had_rows

    return had_cols(had_rows(H * signs[:, None] * signs[None, :]))


def direction(W, H, seed: int = 0):
    """One draw of an LDLQ-shaped error for weight W (out, in) under input Hessian H (in, in), float64, at unit
    distortion (module docstring). Widths that are not multiples of 128 are not rotated."""
    import torch

    from fq.codec.hadamard import had_rows

    W = W.double()
    H = H.double().to(W.device)
    out_f, in_f = W.shape
    gen = torch.Generator().manual_seed(seed)
    rotate = in_f % HAD == 0
    signs = (torch.randint(0, 2, (in_f,), generator=gen).double() * 2 - 1).to(W.device)
    Hr = _rotate(H, signs) if rotate else H.clone()
    Hr = (Hr + Hr.T) / 2
    diag = torch.diagonal(Hr)
    Hr += DAMPING * float(diag.mean()) * torch.eye(in_f, dtype=torch.float64, device=W.device)
    C = torch.linalg.cholesky(Hr)
    A = C / torch.diagonal(C)[None, :]  # I + L, unit lower triangular
    rms = W.pow(2).mean(dim=1).sqrt()
    eta = torch.randn(out_f, in_f, generator=gen, dtype=torch.float64).to(W.device) * rms[:, None]
    # E_rot (I + L) = eta  <=>  (I + L)^T E_rot^T = eta^T
    E_rot = torch.linalg.solve_triangular(A.T, eta.T, upper=True).T
    if not rotate:
        return E_rot
    return had_rows(E_rot) * signs[None, :]  # back from the rotated frame: E = E_rot B S


def proxy(E, W, H) -> float:
    """tr(E H E^T) / tr(W H W^T): the encoder's relative proxy error of an error E."""
    E, W, H = E.double(), W.double(), H.double().to(E.device)
    den = float(((W @ H) * W).sum())
    return float(((E @ H) * E).sum()) / den if den > 0 else 0.0


def ldlq_efficiency(samples, ks, codebook: str, device=None, seed: int = 0) -> dict:
    """K -> c(K): what fq's LDLQ encoder really leaves of a linear, over what this model predicts (d(K) times the
    relative proxy error of a unit-distortion ``direction``), geometric mean over ``samples`` [(W, H)]. c is near 1
    at K 3..5 and not at the ends: on the demo's linears 2.3 at K1 (the trellis' 2 levels leave the error feedback
    little to work with) and 1.1-1.3 at K6-7 (docs/allocation.md). K 16 (kept as published) is exact: 1. A
    half-integer K is not encoded: c there is the geometric mean of its integer neighbours' (encoded if not in
    ``ks``)."""
    import math

    from fq.codec.ldlq import encode_ldlq

    half = [K for K in ks if isinstance(K, float)]
    whole = sorted({K for K in ks if not isinstance(K, float)} | {int(K) + d for K in half for d in (0, 1)})
    out = {}
    for K in whole:
        if K == 16:
            out[K] = 1.0
            continue
        logs = []
        for i, (W, H) in enumerate(samples):
            predicted = distortion(K, codebook) * proxy(direction(W, H, seed=seed + i), W, H)
            real = encode_ldlq(W.double(), H, K, codebook, seed=seed + i, device=device).proxy_err
            if predicted > 0 and real > 0:
                logs.append(math.log(real / predicted))
        out[K] = math.exp(sum(logs) / len(logs)) if logs else 1.0
    for K in half:
        out[K] = math.sqrt(out[int(K)] * out[int(K) + 1])
    return {K: out[K] for K in ks}
