"""The weight manifest of an MoE product, and a reference MoE layer forward.

``MoeSpec`` is the geometry of a product's routed experts (layout, per layer: expert ids, (out, in)
of gate/up/down, and the router tensor if the base skeleton has one) — what ``moe_manifest`` needs
to declare, per layer:

- the router ``{moe}.gate.weight``: ``Replicate()`` (every rank routes every token);
- every expert's ``gate``/``up``: ``ExpertParallel(SplitOutput())`` — intermediate channels cut;
- every expert's ``down``: ``ExpertParallel(SplitInput(reduce="{moe}.experts.down_reduce"))``;
- one ``Collective`` per layer, ``all_reduce`` over ``tp`` x ``ep``: the down projections' partial
  sums (tp) and the experts living on other ranks (ep) are added in one reduction of the layer output.

A whole-model base's spec also lists its quantized non-expert linears (``fq.tp.linears.LinearSpec``) and the
config's head counts; its manifest is then declared for one tp (``moe_manifest(spec, assign, tp)``), each linear
split as tp-export cuts it at that tp (``fq.tp.linears.linear_manifest``) and every row-split one reducing into
its own declared all-reduce over tp.

``moe_forward`` is the plain computation (router softmax, top-k with renormalized weights, SiLU-gated
MLP). Given only a rank's experts and slices it computes that rank's partial sum; the partial sums of
all ranks add up to the full layer (that is what the scheduled all-reduce does).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from fq.errors import FqError
from fq.model.experts import ExpertLayout
from fq.tp.linears import LinearSpec, linear_manifest
from fq.tp.manifest import (EXL3, Collective, ExpertParallel, TpManifest, Replicate, SplitInput, SplitOutput,
                            WeightEntry)

ROLES = ("gate", "up", "down")  # the layout's projections, in its order


def moe_prefix(layout: ExpertLayout, layer: int) -> str:
    """``model.layers.L.mlp`` for ``model.layers.{layer}.mlp.experts.{expert}``."""
    head, _, tail = layout.prefix.rpartition(".")
    if tail != "{expert}" or not head.endswith(".experts"):
        raise FqError(f"expert layout {layout.prefix!r}: expected a prefix ending in '.experts.{{expert}}'")
    return head[: -len(".experts")].format(layer=layer)


def router_name(layout: ExpertLayout, layer: int) -> str:
    return f"{moe_prefix(layout, layer)}.gate.weight"


def reduce_name(layout: ExpertLayout, layer: int) -> str:
    return f"{moe_prefix(layout, layer)}.experts.down_reduce"


def weight_name(layout: ExpertLayout, layer: int, expert: int, proj: str) -> str:
    return layout.key(layer, expert, proj, "weight")


@dataclass(frozen=True)
class MoeLayer:
    layer: int
    experts: tuple[int, ...]
    dims: tuple[tuple[int, int], ...]  # (out, in) of gate, up, down
    router: tuple[str, str, tuple[int, ...]] | None = None  # (name, safetensors dtype, shape)

    def to_json(self) -> dict:
        return {"layer": self.layer, "experts": list(self.experts), "dims": [list(d) for d in self.dims],
                "router": None if self.router is None else
                {"name": self.router[0], "dtype": self.router[1], "shape": list(self.router[2])}}


@dataclass(frozen=True)
class MoeSpec:
    layout: ExpertLayout
    layers: tuple[MoeLayer, ...]
    linears: tuple[LinearSpec, ...] = ()  # a whole-model base's quantized non-expert linears
    heads: tuple = (None, None)  # its config's (num_attention_heads, num_key_value_heads): the split rule reads them

    def __post_init__(self):
        for ml in self.layers:
            (gi, gh), (ui, uh), (dh, di) = ml.dims  # (out, in) each
            if not (gi == ui == di and gh == uh == dh):
                raise FqError(f"layer {ml.layer}: gate {ml.dims[0]}, up {ml.dims[1]}, down {ml.dims[2]} (out, in) are "
                              "not an MoE MLP (gate/up (I, H), down (H, I))")
            if not ml.experts or list(ml.experts) != sorted(set(ml.experts)):
                raise FqError(f"layer {ml.layer}: experts must be ascending and unique")

    def to_json(self) -> dict:
        out = {"layout": self.layout.to_json(), "layers": [ml.to_json() for ml in self.layers]}
        if self.linears:  # absent for experts-only products: their specs (and exports) stay as they were
            out.update(linears=[lin.to_json() for lin in self.linears], heads=list(self.heads))
        return out

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "MoeSpec":
        try:
            layers = tuple(MoeLayer(ml["layer"], tuple(ml["experts"]), tuple(tuple(d) for d in ml["dims"]),
                                    None if ml["router"] is None else
                                    (ml["router"]["name"], ml["router"]["dtype"], tuple(ml["router"]["shape"])))
                           for ml in obj["layers"])
            linears = tuple(LinearSpec.from_json(lin) for lin in obj.get("linears", ()))
            heads = tuple(obj["heads"]) if linears else (None, None)
            return cls(ExpertLayout.from_json(obj["layout"], f"{where}: layout"), layers, linears, heads)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, FqError):
                raise
            raise FqError(f"{where}: not an MoE spec ({type(e).__name__}: {e})") from None


def moe_manifest(spec: MoeSpec, assign: str = "contiguous", tp: int | None = None) -> TpManifest:
    """The product's manifest; ``tp`` is needed (and bound into it) only where the spec has linears."""
    entries, collectives = [], []
    layout = spec.layout
    for ml in spec.layers:
        if ml.router is not None:
            name, dtype, shape = ml.router
            entries.append(WeightEntry(name, ml.layer, None, tuple(shape), dtype, "router", Replicate()))
        op = reduce_name(layout, ml.layer)
        collectives.append(Collective(op, ml.layer, ("tp", "ep")))
        for x in ml.experts:
            for role, proj, dims in zip(ROLES, layout.projections, ml.dims):
                inner = SplitInput(op) if role == "down" else SplitOutput()
                entries.append(WeightEntry(weight_name(layout, ml.layer, x, proj), ml.layer, x, tuple(dims), EXL3,
                                           role, ExpertParallel(inner, assign), layout.scale_log2(proj)))
    if not spec.linears:
        return TpManifest(tuple(entries), tuple(collectives))
    if tp is None:
        raise FqError("a whole-model base's linears are split by what tp divides: declare its manifest for one tp "
                      "(moe_manifest(spec, assign, tp))")
    more, reductions = linear_manifest(spec.linears, spec.heads, tp)
    return TpManifest(tuple(entries + more), tuple(collectives + reductions), tp)


def route(x: torch.Tensor, router: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids (T, k), weights (T, k)): softmax over the router logits, top-k, renormalized."""
    probs = torch.softmax(x.float() @ router.float().t(), dim=-1)
    w, idx = torch.topk(probs, top_k, dim=-1)
    return idx, w / w.sum(dim=-1, keepdim=True)


def moe_forward(x: torch.Tensor, router: torch.Tensor, experts: dict, top_k: int) -> torch.Tensor:
    """Sum over the given experts of ``w * down(silu(gate x) * up x)`` for the tokens routed to them.

    ``experts[e] = (gate, up, down)`` dense float weights ``(out, in)``; slices (gate/up rows a:b, down
    columns a:b) give this rank's partial sum. Router row ``e`` scores expert ``e``. Weights stored zero-padded
    (``fq.codec.shape``: a hidden size that is not a multiple of 128) are used as exllamav3 uses them: the input
    zero-extended to gate/up's padded width, down's output trimmed to the router's (the model's) hidden size."""
    idx, w = route(x, router, top_k)
    y = torch.zeros(x.shape[0], router.shape[1], dtype=torch.float32, device=x.device)
    for e in sorted(experts):
        gate, up, down = experts[e]
        hit = (idx == e)
        tokens = hit.any(dim=-1).nonzero().flatten()
        if tokens.numel() == 0:
            continue
        xe = x[tokens].float()
        if xe.shape[1] < gate.shape[1]:
            xe = torch.nn.functional.pad(xe, (0, gate.shape[1] - xe.shape[1]))
        h = torch.nn.functional.silu(xe @ gate.t()) * (xe @ up.t())
        y[tokens] += (w[tokens] * hit[tokens]).sum(dim=-1, keepdim=True) * (h @ down.t())[:, : y.shape[1]]
    return y
