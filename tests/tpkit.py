"""Shared pieces of the TP tests: provkit's signed campaign with MoE geometry that tp 1, 2 and 4 can cut.

Hidden 128 (the skeleton router is (8, 128)), intermediate 512: gate/up (512, 128), down (128, 512),
so tp=4 gives 128 intermediate channels per rank and tp=8 is refused (64 is not a multiple of 128).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import provkit
from fq.codec import reconstruct_chain
from fq.model.experts import STANDARD
from fq.tp.export import tp_export
from fq.tp.mesh import DeviceMesh, plan
from fq.tp.moe import moe_manifest, router_name, weight_name
from fq.tp.sources import ExportSource, ProductSource

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
