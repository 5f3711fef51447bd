"""Published bases of every registered family in a real EXL3 runtime: exllamav3 1.6.5 loads each base directory of
each family's published campaign (benchmarks/family_campaigns.py builds them on the CPU: tiny checkpoints that
transformers built, FP8 sources among them) and its logits agree with fq's own reference forward (fq.runtime: the
verified product in transformers, routed experts = fq's reconstruction in float32, FP8 skeleton tensors
dequantized) within fp16 tolerance.

A base whose experts are stored zero-padded (family.json ``stored_shapes``: the gpt-oss campaigns of dims that are not
multiples of 128) is also loaded once more to check that every routed expert is an EXL3 linear at the stored shapes,
trimmed back to the model's (``out_features_unpadded``), with its bias at the stored output width.

A base that derives tensors under the names exllamav3 reads (``tensor_aliases.safetensors``: MiniMax-M2's router score
bias) is also checked for exllamav3 having loaded each of them (every MoE block's ``e_score_correction_bias``, equal
to the derived copy), and run once more from a copy without that file (the control: what exllamav3 computes without
the bias), whose agreement is recorded beside the base's.

Needs CUDA and exllamav3 (skipped otherwise, as in CI); the reference half alone runs on the CPU
(``test_fq_reference_runs_each_campaigns_bases_on_the_cpu``), where the campaigns are built. FQ_EXL3_FAMILIES names the directory of campaigns (one
folder per campaign: published/, signer.pub, family.json); FQ_EXL3_FAMILIES_JSON a file for the measured agreement
(docs/data/families_exl3.json; docs/benchmarks.md has the command).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import cuda
from tests.kits.exl3kit import base_agreement, exllamav3_or_skip

ROWS, SEQ, VOCAB = 4, 64, 512


def _campaigns() -> list[Path]:
    d = os.environ.get("FQ_EXL3_FAMILIES")
    if not d:
        return []
    return sorted(p for p in Path(d).iterdir() if (p / "family.json").is_file())


@cuda
@pytest.mark.parametrize("camp", _campaigns() or [None], ids=lambda p: p.name if p else "none")
def test_exllamav3_loads_each_familys_base_and_matches_the_reference(camp, tmp_path):
    if camp is None:
        pytest.skip("set FQ_EXL3_FAMILIES to the directory benchmarks/family_campaigns.py wrote")
    ex = exllamav3_or_skip()
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication

    meta = json.loads((camp / "family.json").read_text())
    root = camp / "published"
    key = keys.load_public(camp / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    bases = sorted(name for name, e in products.items() if len(e["chain"]) == 1)
    assert bases, "the campaign publishes no bare base"
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    out = {}
    padded = {}
    aliased = {}
    for name in bases:
        if meta.get("stored_shapes"):
            padded[name] = padded_experts(ex, root / "base" / products[name]["chain"][0], meta)
        out[name] = base_agreement(ex, root, products[name], key, ids)
        print(meta["architecture"], meta["source"], name, out[name])
        assert out[name]["kl_ref_exl3"] < 1e-3 and out[name]["top1_agreement"] > 0.95, out[name]
        base_dir = root / "base" / products[name]["chain"][0]
        if (base_dir / ALIASES).is_file():
            aliased[name] = aliased_tensors(ex, root, products[name], key, ids, base_dir, tmp_path)
            print(meta["architecture"], meta["source"], name, "without", ALIASES, aliased[name]["without_file"])
            assert aliased[name]["without_file"]["kl_ref_exl3"] > out[name]["kl_ref_exl3"], aliased[name]
    path = os.environ.get("FQ_EXL3_FAMILIES_JSON")
    if path:
        doc = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        doc[camp.name] = {**meta, "bases": out, **({"padded_experts": padded} if padded else {}),
                          **({"tensor_aliases": aliased} if aliased else {})}
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


@pytest.mark.parametrize("camp", _campaigns() or [None], ids=lambda p: p.name if p else "none")
def test_fq_reference_runs_each_campaigns_bases_on_the_cpu(camp):
    """The CPU half of the device test, run where the campaigns are built (no CUDA, no exllamav3): fq's reference
    forward (``load_product``: the whole tree verified, the product built in transformers) of every bare base, on
    the device test's ids, gives finite logits of the vocabulary's width. A campaign fq's runtime cannot build fails
    here, before it travels to the GPU box."""
    if camp is None:
        pytest.skip("set FQ_EXL3_FAMILIES to the directory benchmarks/family_campaigns.py wrote")
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.load import load_product

    root, key = camp / "published", keys.load_public(camp / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    bases = sorted(name for name, e in products.items() if len(e["chain"]) == 1)
    assert bases, "the campaign publishes no bare base"
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    for name in bases:
        with torch.no_grad():
            logits = load_product(root / products[name]["file"], key, state=None).model(ids).logits
        assert logits.shape == (ROWS, SEQ, VOCAB) and torch.isfinite(logits).all(), name


def padded_experts(ex, base_dir: Path, meta: dict) -> dict:
    """exllamav3's routed-expert linears of a padded base: EXL3, at the stored (out, in), trimmed to the model's where
    the output goes back into the residual stream (down), each bias as wide as the stored output."""
    model = ex.Model.from_config(ex.Config.from_directory(str(base_dir)))
    model.load("cuda:0")
    seen = 0
    try:
        for m in model:
            if not hasattr(m, "downs"):
                continue
            for proj, lins in (("gate", m.gates), ("up", m.ups), ("down", m.downs)):
                (out_f, in_f), (out_p, in_p) = meta["expert_shapes"][proj], meta["stored_shapes"][proj]
                for lin in lins:
                    assert lin.quant_type == "exl3", (lin.key, lin.quant_type)
                    assert (lin.out_features, lin.in_features) == (out_p, in_p), lin.key
                    assert (lin.out_features_unpadded, lin.in_features_unpadded) == (out_f, in_f), lin.key
                    assert tuple(lin.inner.trellis.shape[:2]) == (in_p // 16, out_p // 16), lin.key
                    assert lin.inner.bias is None or tuple(lin.inner.bias.shape) == (out_p,), lin.key
                    assert lin.trim_padded_out == (proj == "down"), lin.key
                    seen += 1
    finally:
        model.unload()
    assert seen, f"{base_dir}: exllamav3 built no routed experts"
    return {"expert_linears": seen, "stored_shapes": meta["stored_shapes"]}


ALIASES = "tensor_aliases.safetensors"


def aliased_tensors(ex, root: Path, product: dict, key, ids, base_dir: Path, tmp: Path) -> dict:
    """exllamav3 loaded every router score bias the base derives (each MoE block's ``e_score_correction_bias``, equal to
    the derived tensor), and the control: the same base without the derived file, against the same reference."""
    import shutil

    from safetensors.torch import load_file

    derived = load_file(str(base_dir / ALIASES))
    model = ex.Model.from_config(ex.Config.from_directory(str(base_dir)))
    model.load("cuda:0")
    seen = 0
    try:
        for m in model:
            if not hasattr(m, "e_score_correction_bias_key") or not hasattr(m, "downs"):
                continue
            want = derived.get(f"{m.key}.gate.e_score_correction_bias")
            if want is None:
                continue
            got = m.e_score_correction_bias
            assert got is not None, f"{m.key}: exllamav3 routes without the score bias"
            assert torch.equal(got.float().cpu(), want.float()), m.key
            seen += 1
    finally:
        model.unload()
    assert seen == len(derived), (seen, sorted(derived))
    copy = tmp / "without-aliases"
    shutil.copytree(base_dir, copy, ignore=shutil.ignore_patterns(ALIASES))
    return {"biases_loaded": seen, "without_file": base_agreement(ex, root, product, key, ids, exl3_dir=copy)}
