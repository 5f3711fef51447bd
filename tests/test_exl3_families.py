"""Published bases of every registered family in a real EXL3 runtime: exllamav3 1.6.5 loads each base directory of
each family's published campaign (benchmarks/family_campaigns.py builds them on the CPU: tiny checkpoints that
transformers built, FP8 sources among them) and its logits agree with fq's own reference forward (fq.runtime: the
verified product in transformers, routed experts = fq's reconstruction in float32, FP8 skeleton tensors
dequantized) within fp16 tolerance.

Needs CUDA and exllamav3 (skipped otherwise, as in CI). FQ_EXL3_FAMILIES names the directory of campaigns (one
folder per campaign: published/, signer.pub, family.json); FQ_EXL3_FAMILIES_JSON a file for the measured agreement
(docs/data/families_exl3.json; docs/benchmarks.md has the command).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from conftest import cuda
from exl3kit import base_agreement, exllamav3_or_skip

ROWS, SEQ, VOCAB = 4, 64, 512


def _campaigns() -> list[Path]:
    d = os.environ.get("FQ_EXL3_FAMILIES")
    if not d:
        return []
    return sorted(p for p in Path(d).iterdir() if (p / "family.json").is_file())


@cuda
@pytest.mark.parametrize("camp", _campaigns() or [None], ids=lambda p: p.name if p else "none")
def test_exllamav3_loads_each_familys_base_and_matches_the_reference(camp):
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
    for name in bases:
        out[name] = base_agreement(ex, root, products[name], key, ids)
        print(meta["architecture"], meta["source"], name, out[name])
        assert out[name]["kl_ref_exl3"] < 1e-3 and out[name]["top1_agreement"] > 0.95, out[name]
    path = os.environ.get("FQ_EXL3_FAMILIES_JSON")
    if path:
        doc = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        doc[camp.name] = {**meta, "bases": out}
        Path(path).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
