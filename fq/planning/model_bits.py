"""Bits per weight over the whole model and over the routed experts, side by side (whole-model bases).

exllamav3's ``quantization_config.bits`` counts every linear of the model but the embeddings and the head (which has
its own ``head_bits``); fq's experts-only accounting counts the routed experts alone. For a product of a recipe:

    experts  the chain's nominal bits over the routed experts (``Recipe.product_bpw``)
    model    (W_experts · experts + Σ_class W_class · K_class + W_other · 16) / (W_experts + Σ W_class + W_other):
             nominal K of each class the base quantizes, 16 for a class it keeps as published and for ``other``
             linears (``fq.model.linears.linear_weights``); the head apart
    head     the base's head bits (16: as published)

The figures are nominal (K bits per weight); a published base's ``quantization_config.bits`` states the stored
bits (trellis, scales and markers: a few hundredths above K).

    product_bits(recipe, product, weights) -> {"experts": int, "model": float, "head": int}
"""
from __future__ import annotations

from typing import Mapping

from fq.planning.recipe import UNQUANTIZED

BODY = ("attention", "shared", "dense")


def product_bits(recipe, product, weights: Mapping[str, int]) -> dict:
    base = recipe.node(product.chain[0])
    experts = recipe.product_bpw(product)
    num = weights["experts"] * experts + weights.get("other", 0) * UNQUANTIZED
    den = weights["experts"] + weights.get("other", 0)
    for cls in BODY:
        num += weights.get(cls, 0) * base.skeleton_bits(cls)
        den += weights.get(cls, 0)
    return {"experts": experts, "model": round(num / den, 4) if den else float(experts),
            "head": base.skeleton_bits("head")}
