"""Allocation units: the groups of linears that take one K together, under exllamav3 1.6.5's loadability rules.

exllamav3's loader asserts one K for all experts of a projection in a layer (``modules/multilinear.py``); gate, up
and down may differ from each other and every layer may differ, and every other linear is a module of its own. fq
allocates by these units (per decoder layer; names as the transformers module tree has them):

| unit | linears |
| --- | --- |
| ``L{l}.attention`` | the layer's attention projections (q/k/v/o, or MLA's) |
| ``L{l}.dense`` | a dense layer's MLP gate/up/down |
| ``L{l}.shared`` | an MoE layer's shared expert(s) gate/up/down |
| ``L{l}.routed_gate_up`` | every routed expert's gate and up (one K: the experts' fused input projection) |
| ``L{l}.routed_down`` | every routed expert's down (one K) |
| ``head`` | ``lm_head`` |

Attention is one unit (not q/k/v/o apart) and a shared expert one unit: the classes fq's recipes and linear nodes
quantize (docs/whole_model.md), whose encode jobs would otherwise split.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

UNIT_KINDS = ("attention", "dense", "shared", "routed_gate_up", "routed_down", "head")

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)$")


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str
    layer: int | None  # None for the head


def unit_of(linear: str) -> Unit:
    """The allocation unit a linear (a module name as fq.allocation.sensitivity names them) belongs to."""
    if linear.endswith("lm_head"):
        return Unit("head", "head", None)
    m = _LAYER.search(linear)
    if m is None:
        raise ValueError(f"{linear}: not a decoder layer's linear nor the head")
    layer = int(m.group(1))
    e = _EXPERT.search(linear)
    if e is not None and ".shared_expert" not in linear:
        kind = "routed_down" if e.group(2) == "down_proj" else "routed_gate_up"
    elif ".self_attn." in linear or ".attention." in linear:
        kind = "attention"
    elif ".shared_expert" in linear:
        kind = "shared"
    elif ".mlp." in linear:
        kind = "dense"
    else:
        raise ValueError(f"{linear}: no allocation unit for it")
    return Unit(f"L{layer}.{kind}", kind, layer)


def expert_of(linear: str) -> int | None:
    """The routed expert a linear belongs to (None: not a routed expert's)."""
    e = _EXPERT.search(linear)
    return int(e.group(1)) if e is not None and ".shared_expert" not in linear else None


def group_units(linears) -> dict[str, list[str]]:
    """unit name -> its linears (sorted), for an iterable of linear names."""
    out: dict[str, list[str]] = {}
    for name in linears:
        out.setdefault(unit_of(name).name, []).append(name)
    return {u: sorted(v) for u, v in sorted(out.items(), key=lambda kv: order(kv[0]))}


def order(unit: str):
    """The sort key of a unit name: by layer (the head last), then by kind as UNIT_KINDS lists them."""
    if unit == "head":
        return (1 << 30, 0)
    layer, kind = unit[1:].split(".", 1)
    return (int(layer), UNIT_KINDS.index(kind))
