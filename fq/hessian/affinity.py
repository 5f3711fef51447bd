"""Router-affinity weighting of the routed experts' Hessians (config ``calibration.weighting``, docs/calibration.md).

Each token's contribution to expert e's Hessian is weighted by the router's score of e for that token:

    H_e = Σ_t c_te x_t x_tᵀ / Σ_t c_te,   c_te = score(router logit_te)

``score`` is what the family's router computes from its logits before the top-k (``Calibration.router_score``):
``sigmoid`` per expert (GLM, DeepSeek-V3, Kimi, ...) or ``softmax`` over the experts (Qwen, Mixtral, gpt-oss, ...),
before any score bias (a bias only chooses; the weights are the scores). Every token reaches every expert, with less
weight where the router would not send it: a soft all-experts capture. That is the ``affinity`` variant of
benchmarks/hessian_variants.py, which measured 0.92× the KL of all-experts at K2 and 0.94-0.95× at K3 at equal bytes
on the demo (docs/benchmarks.md).

    none           every token at weight 1: the all-experts capture, bytes as before this option existed
    affinity-down  the down projections' Hessians weighted; gate and up keep the layer's one input Hessian (no new
                   Hessian: the file grows by one float64 per expert)
    affinity       also one input Hessian per expert for its gate and up (E more hidden² sums while capturing, and
                   E more packed triangles in the file)

The scores are the router's own: transformers' routers return (logits, top-k weights, top-k indices), and the
experts module applies those top-k weights. On every batch the chain checks that the applied weights are the declared
scores at the chosen experts up to one factor per token (the router's renormalization and scaling): a declaration
that is not what the router does is an error, never a silent weighting. A family whose router is neither (Phi-3.5-
MoE's sparsemixer) declares none and is refused when the config is read.

    WEIGHTINGS
    check_weighting(family, weighting, where) -> Calibration     # refuses an unknown value or a family without scores
    router_outputs(out) -> (logits, top-k weights)                # of a transformers router's output
    scores(logits, weights, index, kind, where) -> float64 [tokens, E], checked against the applied weights
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fq.errors import FqError

if TYPE_CHECKING:
    import torch

    from fq.model.families.base import Calibration, Family

WEIGHTINGS = ("none", "affinity-down", "affinity")
WEIGHTED = WEIGHTINGS[1:]
# the applied top-k weights and the declared scores agree to float32 rounding (the router's own arithmetic); a wrong
# declaration is off by orders of magnitude (sigmoid against softmax on the same logits)
RTOL = 1e-4


def check_weighting(family: "Family", weighting, where: str) -> "Calibration":
    """The family's chain declaration, if it can weight by ``weighting``; FqError naming the family otherwise."""
    from fq.model import families

    if weighting not in WEIGHTINGS:
        raise FqError(f"{where}: calibration.weighting {weighting!r}: expected one of {', '.join(WEIGHTINGS)}")
    cal = families.check_calibration(family, where)
    if weighting != "none" and cal.router_score is None:
        have = ", ".join(sorted(f.architectures[0] for f in families.REGISTRY.values()
                                if f.calibration is not None and f.calibration.router_score is not None))
        raise FqError(f"{where}: calibration.weighting {weighting}: {family.architectures[0]} ({family.title}) has no "
                      f"router score the chain can read (its router is neither a sigmoid nor a softmax of its logits "
                      f"before the top-k); families it can weight: {have}. Use weighting: none")
    return cal


def router_outputs(out) -> tuple["torch.Tensor", "torch.Tensor"]:
    """(logits [tokens, E], applied top-k weights [tokens, k]) of a router's output."""
    if not isinstance(out, tuple) or len(out) != 3:
        raise FqError(f"router output: expected (logits, top-k weights, top-k indices), got "
                      f"{type(out).__name__} of {len(out) if isinstance(out, tuple) else 1}")
    return out[0].detach(), out[1].detach()


def scores(logits: "torch.Tensor", weights: "torch.Tensor", index: "torch.Tensor", kind: str,
           where: str) -> "torch.Tensor":
    """The router's score of every expert for every token, float64 [tokens, E]: ``kind`` (sigmoid | softmax) of
    ``logits``, refused unless the applied top-k ``weights`` are those scores at ``index`` times one factor per token."""
    import torch

    if logits.dim() != 2 or weights.shape != index.shape or weights.shape[0] != logits.shape[0]:
        raise FqError(f"{where}: router logits {list(logits.shape)}, top-k weights {list(weights.shape)}, indices "
                      f"{list(index.shape)}: expected [tokens, experts], [tokens, k], [tokens, k]")
    z = logits.double()
    if kind == "sigmoid":
        s = torch.sigmoid(z)
    elif kind == "softmax":
        s = torch.softmax(z, dim=-1)
    else:
        raise FqError(f"{where}: router score {kind!r}: expected sigmoid or softmax")
    chosen = s.gather(-1, index.long())
    w = weights.double()
    # w_k / s_k equal for every k of a token, compared by cross products (a softmax score may underflow to 0)
    lhs, rhs = w * chosen[:, :1], w[:, :1] * chosen
    bad = (lhs - rhs).abs() > RTOL * torch.maximum(lhs.abs(), rhs.abs()) + 1e-300
    if bool(bad.any()):
        t = int(bad.any(dim=-1).nonzero()[0])
        raise FqError(f"{where}: the router's applied top-k weights {w[t].tolist()} are not its {kind} scores at the "
                      f"chosen experts {chosen[t].tolist()} times one factor (token {t}): the family's router_score "
                      f"declaration is not what its router does")
    return s
