"""The non-expert linears of a source checkpoint, by class: what a whole-model base may quantize.

Classes (``fq.planning.recipe.LINEAR_CLASSES``), named from the checkpoint's tensor names as exllamav3's
architectures load them as linears (``modules/linear.py``: EXL3 storage when ``trellis``/``suh``/``svh`` exist,
else the 16-bit ``.weight``):

- ``attention``: a decoder layer's ``self_attn.{q,k,v,o}_proj``, or MLA's ``q_a_proj``, ``q_b_proj``,
  ``kv_a_proj_with_mqa``, ``kv_b_proj`` and ``o_proj``. A DSA indexer's linears, linear-attention projections and
  any other attention tensor stay as published.
- ``shared``: an MoE layer's shared expert(s), ``mlp.shared_expert(s).{gate,up,down}_proj``.
- ``dense``: a dense layer's MLP, ``mlp.{gate,up,down}_proj``.
- ``head``: ``lm_head`` (not when the embeddings are tied: the head is then the embedding matrix, which stays).

Next-token-prediction layers (past ``num_hidden_layers``) keep every tensor as published. A linear's companions --
its FP8 block scales (``weight_scale_inv``, ``weight_scale``) -- leave the skeleton with it; a ``.bias`` stays.

    ModelLinear(name, cls, layer)       name: the tensor prefix (``model.layers.3.self_attn.q_proj``)
    source_linears(source) -> {cls: {layer: (ModelLinear, ...)}}     layer None: the head
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fq.model.formats import SCALE_SUFFIX

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj", "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
MLP = ("gate_proj", "up_proj", "down_proj")
HEAD = "lm_head"
# what a quantized linear takes out of the skeleton besides its weight (FP8 block scales)
COMPANIONS = ("weight", SCALE_SUFFIX, "weight_scale")


@dataclass(frozen=True, order=True)
class ModelLinear:
    name: str  # tensor prefix: ``{name}.weight`` in the source, ``{name}.trellis`` ... in a base
    cls: str
    layer: int | None  # None: the head

    @property
    def weight(self) -> str:
        return f"{self.name}.weight"


def classify(name: str, layers_prefix: str, moe_layers, n_layers: int) -> ModelLinear | None:
    """The Linear a ``.weight`` tensor name is, or None (not a quantizable non-expert linear)."""
    if name == f"{HEAD}.weight":
        return ModelLinear(HEAD, "head", None)
    m = re.fullmatch(re.escape(layers_prefix) + r"(\d+)\.(.+)\.weight", name)
    if not m:
        return None
    layer, rest = int(m.group(1)), m.group(2)
    if layer >= n_layers:  # next-token-prediction layers stay as published
        return None
    prefix = name[: -len(".weight")]
    parts = rest.split(".")
    if len(parts) == 2 and parts[0] == "self_attn" and parts[1] in ATTENTION:
        return ModelLinear(prefix, "attention", layer)
    if len(parts) == 3 and parts[0] == "mlp" and parts[1] in ("shared_expert", "shared_experts") and parts[2] in MLP:
        return ModelLinear(prefix, "shared", layer) if layer in moe_layers else None
    if len(parts) == 2 and parts[0] == "mlp" and parts[1] in MLP and layer not in moe_layers:
        return ModelLinear(prefix, "dense", layer)
    return None


def source_linears(source) -> dict[str, dict[int | None, tuple[ModelLinear, ...]]]:
    """{class: {layer: linears sorted by name}} of a SourceModel's non-expert linears (head: layer None)."""
    tied = source.tied_embeddings
    layers_prefix = source.family_entry.layout.layers
    out: dict[str, dict] = {}
    for t in source.skeleton_tensors:
        lin = classify(t, layers_prefix, set(source.moe_layers), source.num_hidden_layers)
        if lin is None or (lin.cls == "head" and tied):
            continue
        out.setdefault(lin.cls, {}).setdefault(lin.layer, []).append(lin)
    return {c: {l: tuple(sorted(v)) for l, v in sorted(d.items(), key=lambda kv: -1 if kv[0] is None else kv[0])}
            for c, d in out.items()}


def removed_tensors(name: str, skeleton_tensors: set[str]) -> tuple[str, ...]:
    """The skeleton tensors the quantized linear ``name`` (a tensor prefix) replaces: its weight and block scales."""
    return tuple(t for t in (f"{name}.{s}" for s in COMPANIONS) if t in skeleton_tensors)

