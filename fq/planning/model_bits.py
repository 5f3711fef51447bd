"""Bits per weight over the whole model and over the routed experts, side by side (whole-model bases).

exllamav3's ``quantization_config.bits`` counts every linear of the model but the embeddings and the head (which has
its own ``head_bits``); fq's experts-only accounting counts the routed experts alone. For a product of a recipe:

    experts  the chain's nominal bits over the routed experts (``Recipe.product_bpw``)
    model    (W_experts · experts + Σ_class W_class · K_class + W_other · 16) / (W_experts + Σ W_class + W_other):
             nominal K of each class the base quantizes (plus each stage residual's on it: ``class_bits``), 16 for
             a class it keeps as published and for ``other``
             linears (``linear_weights``); the head apart
    head     the head's bits (16: as published)

A stage that also corrects a class (recipe ``skeleton`` on a stage) adds its K to that class: the product's linears
are the sum of the chain's reconstructions, as its experts are.

The figures are nominal (K bits per weight); a published base's ``quantization_config.bits`` states the stored
bits (trellis, scales and markers: a few hundredths above K).

    linear_shapes(source) -> {tensor prefix: (class, (out, in))}   # from config.json, meta device
    linear_weights(source) -> {"experts", "attention", "shared", "dense", "head", "other": weights}
    hessian_groups(names) -> [(linears reading one input), ...]
    product_bits(recipe, product, weights) -> {"experts": int, "model": float, "head": int}
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from fq.core import cache, kbits

from fq.model.linears import HEAD, source_linears
from fq.planning.recipe import UNQUANTIZED

BODY = ("attention", "shared", "dense")


def class_bits(recipe, product, layer_weights: Mapping | None = None) -> dict[str, float]:
    """Nominal bits per weight of each non-expert class in ``product``: the sum of K over its chain's linear nodes
    of that class (the base's, then every stage residual on it: ``Recipe.chain_linears``), 16 where the base keeps it.
    A budgeted base's class whose K varies per layer: the mean over layers weighted by ``layer_weights``
    ({class: {layer: weights}}, ``linear_layer_weights``)."""
    base = recipe.node(product.chain[0])
    if base.is_budgeted:  # its stages correct experts only (fq.planning.recipe refuses a skeleton on them)
        out = {}
        for cls in (*BODY, "head"):
            K = base.skeleton_bits(cls)
            if not kbits.is_one(K):
                w = layer_weights[cls]
                K = round(sum(w[layer] * k for layer, k in K) / sum(w[layer] for layer, _ in K), 4)
            out[cls] = K
        return out
    chains = recipe.chain_linears(product.chain[-1])
    return {cls: sum(ln.K for ln in chains[cls]) if cls in chains else UNQUANTIZED for cls in (*BODY, "head")}


def product_bits(recipe, product, weights: Mapping[str, int], layer_weights: Mapping | None = None) -> dict:
    experts = recipe.product_bpw(product)
    bits = class_bits(recipe, product, layer_weights)
    num = weights["experts"] * experts + weights.get("other", 0) * UNQUANTIZED
    den = weights["experts"] + weights.get("other", 0)
    for cls in BODY:
        num += weights.get(cls, 0) * bits[cls]
        den += weights.get(cls, 0)
    return {"experts": experts, "model": round(num / den, 4) if den else float(experts), "head": bits["head"]}


ROUTER_SUFFIXES = (".gate.weight", ".router.weight")


def linear_shapes(source) -> dict[str, tuple[str, tuple[int, int]]]:
    """Every 2-D linear weight but the routed experts, embeddings and routers: tensor prefix -> (class, (out, in)),
    class one of LINEAR_CLASSES or ``other`` (a DSA indexer, linear-attention projections, ...: stored as
    published). Shapes come from transformers' own decoder layer built from the config on the meta device (no
    weights read), so a hub source is counted from its config.json alone. Next-token-prediction layers are not
    listed (exllamav3 does not load them).

    Building that layer imports torch and the family's transformers module: about 4 s, in every Snakemake parse and
    every job that plans. The shapes are a function of config.json, the transformers and torch versions and the fq
    code that derives them, so they are cached under a key of all four (fq.core.cache)."""
    by_name = {lin.name: lin.cls for d in source_linears(source).values() for v in d.values() for lin in v}
    config = dict(source.config)
    key = _shapes_key(config)
    cached = cache.get_json("linear-shapes", key)
    if not (isinstance(cached, dict) and isinstance(cached.get("linears"), dict) and _is_shape(cached.get("head"))
            and all(_is_shape(v) for v in cached["linears"].values())):
        cached = _built_shapes(config, f"{source.origin}/config.json")
        cache.put_json("linear-shapes", key, cached)
    out = {name: (by_name.get(name, "other"), (int(o), int(i))) for name, (o, i) in cached["linears"].items()}
    if not source.tied_embeddings:
        out[HEAD] = ("head", tuple(int(x) for x in cached["head"]))
    return out


def _is_shape(v) -> bool:
    return isinstance(v, list) and len(v) == 2 and all(type(x) is int and x > 0 for x in v)


_SHAPE_CODE = ("planning/model_bits.py", "hessian/layer.py", "model/linears.py", "model/families")


def _shapes_key(config: dict) -> str:
    """sha256 of config.json (canonical), the transformers and torch versions, and fq's code that derives the shapes."""
    import hashlib
    from importlib import metadata

    from fq.core import canonical

    h = hashlib.sha256(canonical.dumps(config))
    for dist in ("transformers", "torch"):
        try:
            h.update(f"{dist}={metadata.version(dist)};".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=?;".encode())
    root = Path(__file__).resolve().parents[1]
    for rel in _SHAPE_CODE:
        for f in sorted((root / rel).rglob("*.py")) if (root / rel).is_dir() else [root / rel]:
            h.update(f.relative_to(root).as_posix().encode() + b"\0" + f.read_bytes())
    return h.hexdigest()


def _built_shapes(config: dict, where: str) -> dict:
    """{"linears": {tensor prefix: [out, in]}, "head": [vocab, hidden]} from transformers' decoder layers built on
    the meta device (``linear_shapes``)."""
    import torch

    from fq.hessian import layer as layer_mod

    arch = layer_mod.architecture(config, where)
    hfc = layer_mod.hf_config(config)
    layer_cls, _ = arch.classes()
    out: dict = {}
    built: dict = {}
    for layer in range(arch.n_layers(config, where)):
        # layers alike in what shapes them (MoE or dense, per-layer attention and indexer types, Laguna's per-layer
        # head counts) are built once
        key = (arch.is_moe(config, layer),) + tuple(
            getattr(hfc, k)[layer] if isinstance(getattr(hfc, k, None), (list, tuple)) else None
            for k in ("layer_types", "indexer_types", "num_attention_heads_per_layer"))
        if key not in built:
            with torch.device("meta"):
                built[key] = {k: tuple(v.shape) for k, v in layer_cls(hfc, layer).state_dict().items()}
        prefix = arch.prefix.format(layer=layer)
        for rel, shape in built[key].items():
            name = prefix + arch.checkpoint_name(rel)
            if len(shape) != 2 or ".experts." in name or not name.endswith(".weight") \
                    or name.endswith(ROUTER_SUFFIXES):
                continue
            out[name[: -len(".weight")]] = [int(shape[0]), int(shape[1])]
    return {"linears": out, "head": [int(hfc.vocab_size), int(hfc.hidden_size)]}


def linear_layer_weights(source, shapes: dict | None = None) -> dict[str, dict]:
    """{class: {layer: weights}} of the non-expert classes (head: layer None), for per-layer K."""
    shapes = linear_shapes(source) if shapes is None else shapes
    out: dict = {}
    for cls, layers in source_linears(source).items():
        for layer, lins in layers.items():
            out.setdefault(cls, {})[layer] = sum(shapes[lin.name][1][0] * shapes[lin.name][1][1]
                                                 for lin in lins if lin.name in shapes)
    return out


def linear_weights(source, shapes: dict | None = None) -> dict[str, int]:
    """Weights per class as exllamav3 counts bits: ``experts`` (routed, every MoE layer including next-token-
    prediction ones), each class of LINEAR_CLASSES, and ``other`` (``linear_shapes``)."""
    out = {"experts": len(source.moe_layers) * source.n_experts * 3 * source.hidden_size
           * source.moe_intermediate_size, "attention": 0, "shared": 0, "dense": 0, "head": 0, "other": 0}
    for cls, (o, i) in (linear_shapes(source) if shapes is None else shapes).values():
        out[cls] += o * i
    return out


# linears that read one input share its Hessian (fq.hessian.capture groups them by the tensors they see)
POST_NORM = ("q_proj", "k_proj", "v_proj", "q_a_proj", "kv_a_proj_with_mqa")


def hessian_groups(names) -> list[tuple[str, ...]]:
    """The input groups of one layer's linears of one class (tensor prefixes), as the capture finds them in the
    registered families: the post-norm readers of attention together, gate and up together, every other alone."""
    groups: dict = {}
    for n in sorted(names):
        parent, _, leaf = n.rpartition(".")
        key = (parent.rpartition(".")[0] + ".attn-in") if leaf in POST_NORM else \
            (parent + ".mlp-in") if leaf in ("gate_proj", "up_proj") else n
        groups.setdefault(key, []).append(n)
    return [tuple(v) for v in groups.values()]
