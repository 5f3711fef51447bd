"""Shared pieces of the TP tests: provkit's signed campaign with MoE geometry that tp 1, 2 and 4 can cut.

Hidden 128 (the skeleton router is (8, 128)), intermediate 512: gate/up (512, 128), down (128, 512),
so tp=4 gives 128 intermediate channels per rank and tp=8 is refused (64 is not a multiple of 128).

``build_whole``: the same campaign as a whole-model base (``LINEARS``: attention in layers 0, 1 and 3, a dense MLP
in layer 0, a shared expert in layer 1, lm_head), with fq's own linear-fragment writer and signer, the base
manifest and plans re-signed over them. At tp=2 attention (2 heads of 128) and the dense MLP (256) split, the
shared expert (128) and lm_head (384) stay whole; at tp=4 every linear stays whole.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fq.codec import reconstruct_chain
from fq.model.experts import STANDARD
from fq.tp.export import tp_export
from fq.tp.mesh import DeviceMesh, plan
from fq.tp.moe import moe_manifest, router_name, weight_name
from fq.tp.sources import ExportSource, ProductSource

from . import provkit

DIMS = {"gate_proj": (512, 128), "up_proj": (512, 128), "down_proj": (128, 512)}  # torch (out, in)
PRODUCT = "k2r1r2"
NOW = provkit.NOW


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Autouse in every module that imports it. Tiny tensors: one intra-op thread is fastest, and spares an
    oversubscribed two-core box torch's spin-waiting thread pool (seen: 70x slower reconstructs)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def build(tmp: Path, **kw) -> provkit.Campaign:
    return provkit.build_campaign(tmp, dims=DIMS, **kw)


def product_source(c: provkit.Campaign, product: str = PRODUCT) -> ProductSource:
    return ProductSource(c.plans[product], c.pub, now=NOW)


def export(c: provkit.Campaign, out: Path, tp: int, ep: int = 1, assign: str = "contiguous", product: str = PRODUCT):
    return tp_export(c.plans[product], c.pub, out, tp=tp, ep=ep, assign=assign, sign_key=c.priv, now=NOW)


def export_source(c: provkit.Campaign, path: Path) -> ExportSource:
    return ExportSource(path, c.pub)


def mesh_plan(source, tp: int = 1, ep: int = 1, pp: int = 1, epoch: int = 0, assign: str = "contiguous"):
    return plan(moe_manifest(source.spec(), assign), DeviceMesh(tp=tp, ep=ep, pp=pp, epoch=epoch))


def chain_sets(c: provkit.Campaign, layer: int, expert: int, proj: str, product: str = PRODUCT) -> list[dict]:
    """The unsliced tensor sets of one linear along the product's chain (what the fragments hold)."""
    return [c.sets[(n, layer, expert, proj)] for n in provkit.PRODUCTS[product] if (n, layer, expert, proj) in c.sets]


def full_weight(c: provkit.Campaign, layer: int, expert: int, proj: str, product: str = PRODUCT):
    return reconstruct_chain(chain_sets(c, layer, expert, proj, product))


def wname(layer: int, expert: int, proj: str) -> str:
    return weight_name(STANDARD, layer, expert, proj)


def rname(layer: int) -> str:
    return router_name(STANDARD, layer)


HEADS = 2  # attention heads of 128, as many key/value heads


def _attention(layer: int) -> dict:
    a = f"model.layers.{layer}.self_attn"
    return {f"{a}.q_proj": (256, 128), f"{a}.k_proj": (256, 128), f"{a}.v_proj": (256, 128), f"{a}.o_proj": (128, 256)}


def _mlp(prefix: str, inter: int) -> dict:
    return {f"{prefix}.gate_proj": (inter, 128), f"{prefix}.up_proj": (inter, 128), f"{prefix}.down_proj": (128, inter)}


LINEARS = {  # (linear node, class, layer) -> {prefix: torch (out, in)}: every layer's (provkit's 4: 1 and 3 MoE)
    **{("attention-K2-mul1", "attention", layer): _attention(layer) for layer in range(provkit.N_LAYERS)},
    ("dense-K2-mul1", "dense", 0): _mlp("model.layers.0.mlp", 256),
    ("dense-K2-mul1", "dense", 2): _mlp("model.layers.2.mlp", 256),
    ("shared-K2-mul1", "shared", 1): _mlp("model.layers.1.mlp.shared_experts", 128),
    ("shared-K2-mul1", "shared", 3): _mlp("model.layers.3.mlp.shared_experts", 128),
    ("head-K3-mul1", "head", None): {"lm_head": (384, 128)},
}


CLASSES = {"attention": 2, "dense": 2, "shared": 2, "head": 3}  # base k2's quantized classes: LINEARS' nodes


def build_whole(tmp: Path) -> provkit.Campaign:
    """``build``'s campaign with LINEARS quantized as a whole-model base (the recipe's k2 quantizes CLASSES: its
    linear nodes and their digests are fq's); ``c.sets[prefix]`` is each linear's set."""
    from safetensors import safe_open

    from fq.provenance.exl3config import write_derived

    c = build(tmp)
    c.recipe = provkit.recipe(skeleton={"k2": CLASSES})  # k2's node digest is the same: its experts are
    t = c.tree()
    base = c.root / "base/k2"
    # the skeleton variant: provkit's skeleton without the head, which the base stores as EXL3
    skel = base / provkit.SOURCE_SHARD
    with safe_open(str(skel), "pt") as f:
        kept = [(n, f.get_tensor(n)) for n in sorted(f.keys()) if n != "lm_head.weight"]
    skel.unlink()
    t.skeleton("k2", provkit.SOURCE_SHARD, kept)
    gen = torch.Generator().manual_seed(7)
    (base / "source_config.json").write_text(json.dumps(
        dict(provkit.SOURCE_CONFIG, num_attention_heads=HEADS, num_key_value_heads=HEADS)))
    names = []
    for (node, cls, layer), shapes in LINEARS.items():
        ln = c.recipe.linear_node(node)
        sets = {p: provkit.random_set(o, i, ln.K, ln.codebook, gen) for p, (o, i) in shapes.items()}
        c.sets.update(sets)
        names.append(t.linears("k2", node, layer, sets, provkit.SOURCE_SHARD))
    t.manifest("k2", write_derived(base, bits=2, codebook="mul1", linears=CLASSES))
    for product in provkit.PRODUCTS:
        c.plans[product] = provkit._plan(c, product, 1, provkit.EXPIRES, c.priv, linears=names)
    provkit.publish(c)
    return c


def whole_plan(source, tp: int = 1, ep: int = 1, pp: int = 1, epoch: int = 0, assign: str = "contiguous"):
    """A whole-model base's plan: its manifest is declared for the mesh's tp."""
    return plan(moe_manifest(source.spec(), assign, tp), DeviceMesh(tp=tp, ep=ep, pp=pp, epoch=epoch))


def unit_bytes(units) -> list:
    """What a source's admit handed the store, comparable across sources: (rank, key, bytes, views) per unit, in
    (rank, key) order."""
    return [(u.rank, u.key, bytes(u.data), u.views) for u in sorted(units, key=lambda u: (u.rank, u.key))]
