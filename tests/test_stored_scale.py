"""Stored scales (fq.model.experts): a routed projection whose EXL3 tensors store its matrix times 2^n (Laguna's
up_proj, n = -7, as exllamav3 reads it). Why fq folds the factor into svh rather than encoding W * 2^n; the layout's
JSON (every other layout's unchanged); the quant args that must state it; and the consumers outside the encode job
and fq's CPU runtime (tests/test_families.py covers those) that undo it: eval's unsigned fragments and the TP store."""
from __future__ import annotations

import pytest
import torch

from fq.codec import encode, reconstruct
from fq.codec.ldlq import encode_ldlq
from fq.errors import FqError
from fq.model.experts import STANDARD, ExpertLayout
from fq.model.families.laguna import LAYOUT

from tests.kits.runtimekit import random_set


def _weights(std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return (torch.randn(128, 256, generator=g) * std).to(torch.bfloat16).float()


def _hessian() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1024, 256, generator=g) * torch.linspace(0.2, 3.0, 256)
    return (x.T @ x / 1024).double()


@pytest.mark.parametrize("objective", ["weight-only", "ldlq"])
def test_a_power_of_two_on_w_lands_in_suh_and_rounds_for_small_weights(objective):
    """The encoder normalizes its output-channel scales by their mean, so W * 2^-7 encodes to the same trellis and
    svh with suh * 2^-7 (weight-only and LDLQ), exactly only while suh * 2^-7 stays an fp16 normal: suh is of the
    weights' magnitude, and at std 0.005 it rounds among fp16's subnormals. fq stores the encoding of W with svh *
    2^-7 instead (svh is near 1): the same trellis and suh, and exactly 2^-7 times its matrix at any weight scale."""
    H = _hessian()

    def enc(w):
        return (encode_ldlq(w, H, 3, "mul1", 7) if objective == "ldlq" else encode(w, 3, "mul1", 7)).tensors

    for std, exact in ((0.02, True), (0.005, False)):
        W = _weights(std)
        a, b = enc(W), enc(W * 2.0 ** -7)
        assert torch.equal(a["trellis"], b["trellis"]), std
        assert torch.equal(b["suh"].float(), a["suh"].float() * 2.0 ** -7) == exact, std
        if exact:
            assert torch.equal(a["svh"], b["svh"])
        stored = LAYOUT.stored("up_proj", a)
        assert all(torch.equal(stored[x], a[x]) for x in ("trellis", "suh", "mul1"))
        assert torch.equal(stored["svh"].float(), a["svh"].float() * 2.0 ** -7)
        assert torch.equal(reconstruct(stored), reconstruct(a) * 2.0 ** -7)
        assert torch.equal(LAYOUT.source("up_proj", stored)["svh"], a["svh"])
        assert LAYOUT.stored("gate_proj", a) is a and STANDARD.stored("up_proj", a) is a


def test_the_layout_states_its_stored_scales_in_its_json_and_no_other_layout_changes():
    assert STANDARD.to_json() == {"prefix": "model.layers.{layer}.mlp.experts.{expert}",
                                  "projections": ["gate_proj", "up_proj", "down_proj"]}
    assert LAYOUT.to_json() == {**STANDARD.to_json(), "stored_scale_log2": {"up_proj": -7}}
    assert ExpertLayout.from_json(LAYOUT.to_json()) == LAYOUT and LAYOUT != STANDARD
    assert (LAYOUT.scale_log2("up_proj"), LAYOUT.scale_log2("gate_proj"), STANDARD.scale_log2("up_proj")) == (-7, 0, 0)
    for bad in ({"w3": -7}, {"up_proj": 0}, {"up_proj": -7.0}, {"up_proj": 15}, {"up_proj": True}):
        with pytest.raises(FqError, match="stored_scale_log2"):
            ExpertLayout.from_json({**STANDARD.to_json(), "stored_scale_log2": bad})
    with pytest.raises(FqError, match="expected"):
        ExpertLayout.from_json({**STANDARD.to_json(), "scales": {"up_proj": -7}})


def test_an_expert_fragments_quant_args_state_its_layouts_stored_scales():
    """An encode's bytes depend on the stored scale as on the rest of its quant args (the determinism scope): a Laguna
    fragment's quant args state it, and no other fragment's may."""
    from fq.provenance.attest.fragment import check_quant_args

    check_quant_args({"quant_args": {"stored_scale_log2": {"up_proj": -7}}, "layout": LAYOUT.to_json()}, "f")
    check_quant_args({"quant_args": {}, "layout": STANDARD.to_json()}, "f")
    check_quant_args({"quant_args": {}, "layout": None}, "a linear fragment")
    for qa, layout in (({}, LAYOUT), ({"stored_scale_log2": {"up_proj": -6}}, LAYOUT),
                       ({"stored_scale_log2": {"up_proj": -7}}, STANDARD)):
        with pytest.raises(FqError, match="quant_args stored_scale_log2"):
            check_quant_args({"quant_args": qa, "layout": layout.to_json()}, "f")


def test_eval_reads_unsigned_fragments_in_the_sources_units(tmp_path):
    """fq eval's native comparisons and weight-only twins: unsigned fragments under the layout, each set undone."""
    from fq.provenance.fragments import write_fragment
    from fq.runtime.evaluate import native_sets

    gen = torch.Generator().manual_seed(0)
    sets = {lp: random_set(*shape, 3, "mul1", 0.02, gen)
            for lp, shape in zip(LAYOUT.projections, ((128, 256), (128, 256), (256, 128)))}
    (tmp_path / "K3-mul1").mkdir()
    write_fragment(tmp_path / "K3-mul1" / "x.safetensors", layout=LAYOUT, node="native-K3-mul1", role="base", layer=1,
                   block=0, K=3, codebook="mul1", experts={0: sets})
    got = native_sets(tmp_path)[(3, "mul1")]
    for lp, tset in sets.items():
        assert torch.equal(reconstruct(got[(1, 0, lp)]), reconstruct(tset) * 2.0 ** -LAYOUT.scale_log2(lp)), lp


def test_the_tp_store_reconstructs_the_sources_matrix():
    """The manifest's up_proj entries carry the stored scale (absent from every other manifest's JSON), and the store's
    dense weight of each rank's slice is the source's units: svh times 2^7 before the slices' reconstruction."""
    from fq.tp.manifest import EXL3
    from fq.tp.mesh import DeviceMesh, plan
    from fq.tp.moe import MoeLayer, MoeSpec, moe_manifest, weight_name
    from fq.tp.sources import TensorSource
    from fq.tp.store import WeightStore

    dims = ((256, 128), (256, 128), (128, 256))
    gen = torch.Generator().manual_seed(0)
    m = moe_manifest(MoeSpec(LAYOUT, (MoeLayer(1, (0, 1), dims),)))
    assert {e.name: e.stored_scale_log2 for e in m.entries if e.stored_scale_log2} == \
        {weight_name(LAYOUT, 1, x, "up_proj"): -7 for x in (0, 1)}
    assert all(("stored_scale_log2" in e.to_json()) == (e.stored_scale_log2 != 0) for e in m.entries)
    assert "stored_scale_log2" not in str(moe_manifest(MoeSpec(STANDARD, (MoeLayer(1, (0, 1), dims),))).to_json())
    sets = {e.name: [random_set(*e.shape, 2, "mul1", 0.02, gen)] for e in m.entries if e.dtype == EXL3}
    p = plan(m, DeviceMesh(tp=2))
    loaded = WeightStore(p.mesh).fulfill(p, TensorSource(sets), ["cpu", "cpu"])
    for name, (tset,) in sets.items():
        full = reconstruct(tset) * 2.0 ** -LAYOUT.scale_log2(LAYOUT.parse(name)[2])
        pls = sorted((pl for pl in p.placements if pl.entry == name), key=lambda pl: pl.slice.start)
        assert len(pls) == 2, name
        assert torch.equal(torch.cat([loaded.weight(pl.rank, name) for pl in pls], pls[0].slice.dim), full), name
