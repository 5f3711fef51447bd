"""A unit's real cost at K: its LDLQ-shaped error injected into the source, the output's KL measured.

The Fisher form (fq.allocation.sensitivity) is the second-order term of the KL a perturbation costs, so it predicts
KL(K) proportional to d(K) (the codebook's distortion: x0.25-0.27 a bit). Injected into the trained demo model, a
unit's LDLQ-shaped error at sqrt(d(K)) (fq.allocation.error_model.direction) costs that only where no router reads
it: the last MoE layer's experts and shared expert and the head fall 0.25-0.27 a bit and match the Fisher form. Every
unit upstream of a router (earlier layers, and the last MoE layer's own attention) falls only 0.4-0.7 a bit and costs
up to 20x the Fisher form at K5: the error changes routing decisions, and a top-k flip costs KL in proportion to the
error, not to its square (docs/allocation.md, "Injected, not extrapolated"). An allocation that trusts the
second-order term starves exactly those units at high K.

So a unit's predicted KL is measured, not extrapolated: its error injected at a few K (``INJECT_KS``) with the
encoder's real distortion there, D(K) = d(K) c(K) (fq.allocation.error_model.ldlq_efficiency), the source's logit
KL over the calibration windows (the positions the Fisher form uses), and the two-term curve

    KL(K) = a D(K) + b sqrt(D(K)),   a, b >= 0     (second order; first order: flips)

fitted through the points at K >= 2 in relative error and read at every candidate K; K1, far outside that range
(LDLQ's K1 leaves 2.3x the error the Gaussian code does), is its own measured point, split between the two terms as
the curve splits it there. One forward of the source per unit and point, no backward.

    curve(ds, kls) -> (a, b)                  the fit (pure)
    at(a, b, d) -> KL                         the curve at distortion d
    parts(points, D) -> {K: (second, first)}  a unit's two terms at every K of D (what the pooled solver adds)
    measure(model, windows, directions, groups, D, W, apply) -> {unit: {K: injected KL}}
    log_probs(logits) -> the next-token log-probabilities of every position but the last (float32)
    mean_kl(ref, got) -> KL(ref || got(i)) per position over the windows i of ``ref``
"""
from __future__ import annotations

import math

INJECT_KS = (1, 2, 4, 6)


def at(a: float, b: float, d: float) -> float:
    return a * d + b * math.sqrt(d)


def curve(ds, kls) -> tuple[float, float]:
    """(a, b) >= 0 minimizing sum ((a d + b sqrt d) / kl - 1)^2 over the measured points (kl > 0); (0, 0) when
    nothing was measured above zero."""
    pts = [(d, k) for d, k in zip(ds, kls) if k > 0 and d > 0]
    if not pts:
        return 0.0, 0.0
    # rows (d/kl, sqrt(d)/kl), target 1: 2x2 normal equations, then the one-term fits where a term comes out < 0
    x = [(d / k, math.sqrt(d) / k) for d, k in pts]

    def one(i):
        s = sum(r[i] * r[i] for r in x)
        return sum(r[i] for r in x) / s

    s11 = sum(r[0] * r[0] for r in x)
    s12 = sum(r[0] * r[1] for r in x)
    s22 = sum(r[1] * r[1] for r in x)
    t1, t2 = sum(r[0] for r in x), sum(r[1] for r in x)
    det = s11 * s22 - s12 * s12
    if det > 1e-12 * s11 * s22:
        a, b = (t1 * s22 - t2 * s12) / det, (t2 * s11 - t1 * s12) / det
        if a >= 0 and b >= 0:
            return a, b
    cands = [(one(0), 0.0), (0.0, one(1))]

    def loss(ab):
        return sum((ab[0] * r[0] + ab[1] * r[1] - 1) ** 2 for r in x)

    return min(cands, key=loss)


def parts(points: dict, D: dict) -> dict:
    """K -> (a D(K), b sqrt(D(K))) for every K of ``D``: the curve fitted through ``points`` (K -> injected KL) at
    K >= 2, and a K1 point taken as measured (both terms scaled to it). A K between 1 and 2 (1.5) lies between the
    two: each term interpolated log-linearly in log D from K1's to K2's, not the K >= 2 curve extrapolated."""
    fit = {K: v for K, v in points.items() if K >= 2} or points
    a, b = curve([D[K] for K in fit], list(fit.values()))
    out = {}
    for K, d in D.items():
        second, first = a * d, b * math.sqrt(d)
        if K == 1 and K in points and second + first > 0:
            scale = points[K] / (second + first)
            second, first = second * scale, first * scale
        out[K] = (second, first)
    for K, d in D.items():
        if 1 < K < 2 and 1 in out and 2 in out and min(D[1], D[2], d) > 0 and D[1] != D[2]:
            t = math.log(d / D[1]) / math.log(D[2] / D[1])
            out[K] = tuple(lo ** (1 - t) * hi ** t if lo > 0 and hi > 0 else lo + t * (hi - lo)
                           for lo, hi in zip(out[1], out[2]))
    return out


def log_probs(logits):
    """The log-probabilities of every position but the last (which predicts past the window), in float32."""
    import torch

    return torch.log_softmax(logits[:, :-1].float(), dim=-1)


def mean_kl(ref: list, got) -> float:
    """Mean KL(ref || moved) over every position of the windows: ``ref[i]`` window i's reference log-probs,
    ``got(i)`` the moved model's (a sum in float64 per window, in window order; clamped at 0)."""
    import torch

    kl, count = 0.0, 0
    with torch.no_grad():
        for i, r in enumerate(ref):
            kl += float((r.exp() * (r - got(i))).sum(-1).double().sum())
            count += r.shape[1]
    return max(kl / count, 0.0)


def measure(model, windows, directions: dict, groups: dict, D: dict, W: dict, apply, ks=INJECT_KS,
            progress=None) -> dict:
    """unit -> {K: KL} for every unit of ``groups`` (unit -> linears): each unit's linears moved by sqrt(D[K]) times
    their direction (``directions``: linear -> tensor shaped as its weight, at unit distortion), the model's mean
    KL(source || moved) over the positions of ``windows`` but the last of each, the weights restored after each
    point. ``W``: linear -> the model's weight, ``apply(model, {linear: tensor})`` writes weights in place
    (fq.allocation.measure's). Ks of ``ks`` that ``D`` lacks are skipped."""
    import torch

    ref = []
    with torch.no_grad():
        for i in range(windows.shape[0]):
            ref.append(log_probs(model(input_ids=windows[i: i + 1]).logits))
    ks = [K for K in ks if K in D]
    out, done, total = {}, 0, len(groups) * len(ks)
    for u, names in groups.items():
        orig = {n: W[n].clone() for n in names}
        out[u] = {}
        for K in ks:
            s = math.sqrt(D[K])
            apply(model, {n: (orig[n].double() + s * directions[n].to(orig[n].device)).to(orig[n].dtype)
                          for n in names})
            out[u][K] = mean_kl(ref, lambda i: log_probs(model(input_ids=windows[i: i + 1]).logits))
            done += 1
            if progress is not None:
                progress(done, total)
        apply(model, orig)
    return out
