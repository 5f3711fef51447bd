"""gpt-oss's expert biases in a published base (issue 23): rule fq-exl3-expert-bias/1 splits the skeleton's fused,
interleaved ``gate_up_proj_bias`` and ``down_proj_bias`` into the per-expert ``.bias`` tensors exllamav3 1.6.5 reads
beside an EXL3 expert's trellis; every consumer recomputes the file, and a base that keeps fused biases without it is
refused (an EXL3 runtime would run the experts without their biases).

The base is provkit's, with a second skeleton shard holding layer 1's fused biases as gpt-oss publishes them.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.kits import provkit
from fq.core import canonical
from fq.errors import FqError
from fq.provenance.attest.fragment import attest_skeleton
from fq.provenance.combine import combine
from fq.provenance.exl3config import EXPERT_BIAS, QUANTIZATION_CONFIG, RULE_EXPERT_BIAS, specs, write_derived
from fq.provenance.fragments import write_skeleton
from fq.provenance.manifest import MANIFEST_NAME, write_base_manifest
from fq.provenance.verify import verify_path

BIAS_SHARD = "model-bias.safetensors"
PREFIX = "model.layers.1.mlp.experts"


def with_fused_biases(tmp_path, derived=None):
    """provkit's campaign whose base skeleton also holds the MoE layers' fused expert biases; re-derived, re-manifested,
    re-planned and re-published (``derived``: what the manifest declares; default what write_derived wrote)."""
    c = provkit.build_campaign(tmp_path)
    base = c.root / "base/k2"
    g = torch.Generator().manual_seed(5)
    gate_up = (torch.randn(provkit.N_EXPERTS, 2 * 128, generator=g) * 0.1).bfloat16()
    down = (torch.randn(provkit.N_EXPERTS, 256, generator=g) * 0.1).bfloat16()
    # every MoE layer's (a model's MoE layers hold the same tensors: fq.provenance.complete); layer 3's the same values
    biases = [(f"model.layers.{layer}.mlp.experts.{name}", t) for layer in provkit.LAYERS
              for name, t in (("gate_up_proj_bias", gate_up), ("down_proj_bias", down))]
    write_skeleton(base / BIAS_SHARD, tensors=biases, source_shard=BIAS_SHARD)
    source = dict(c.source, shards=c.source["shards"] + [{"name": BIAS_SHARD, "sha256": "3" * 64}])
    attest_skeleton(base / BIAS_SHARD, key=c.priv, campaign=c.campaign, source=source, encoder=provkit.encoder())
    wrote = write_derived(base, bits=2, codebook="mul1")
    write_base_manifest(base, node="k2", campaign=c.campaign, key=c.priv, derived=wrote if derived is None else derived)
    for product in provkit.PRODUCTS:
        provkit._plan(c, product, 1, provkit.EXPIRES, c.priv)
    provkit.publish(c)
    return c, wrote, gate_up, down


def test_the_fused_biases_are_split_per_expert_where_exllamav3_reads_them(tmp_path):
    c, wrote, gate_up, down = with_fused_biases(tmp_path)
    assert [d["name"] for d in wrote] == ["config.json", EXPERT_BIAS, QUANTIZATION_CONFIG]  # the order of derivation
    base = c.root / "base/k2"
    got = load_file(str(base / EXPERT_BIAS))  # a real safetensors file
    assert len(got) == 3 * provkit.N_EXPERTS * len(provkit.LAYERS)
    for e in range(provkit.N_EXPERTS):
        assert torch.equal(got[f"{PREFIX}.{e}.gate_proj.bias"], gate_up[e, 0::2].half())  # interleaved: even
        assert torch.equal(got[f"{PREFIX}.{e}.up_proj.bias"], gate_up[e, 1::2].half())  # odd
        assert torch.equal(got[f"{PREFIX}.{e}.down_proj.bias"], down[e].half())
    storage = canonical.loads((base / QUANTIZATION_CONFIG).read_bytes())["tensor_storage"]
    gate = storage[f"{PREFIX}.1.gate_proj"]
    assert gate["quant_format"] == "exl3" and gate["stored_tensors"][f"{PREFIX}.1.gate_proj.bias"]["dtype"] == \
        "torch.float16"
    # deterministic, and finalize is idempotent: the same bytes again
    before = (base / EXPERT_BIAS).read_bytes()
    write_derived(base, bits=2, codebook="mul1")
    assert (base / EXPERT_BIAS).read_bytes() == before
    report = verify_path(c.root, c.pub, now=provkit.NOW)
    assert report.ok, report.problems
    combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW, base_dir=base)


def test_an_edited_expert_bias_file_is_refused_by_every_consumer(tmp_path):
    c, _, _, _ = with_fused_biases(tmp_path)
    p = c.root / "base/k2" / EXPERT_BIAS
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x40  # the last expert's down bias, within the manifest's listed size
    p.write_bytes(bytes(data))
    want = f"{EXPERT_BIAS}: not the bytes rule {RULE_EXPERT_BIAS} derives"
    problems = verify_path(c.root, c.pub, now=provkit.NOW).problems
    assert any(want in m for m in problems), problems
    assert not any(QUANTIZATION_CONFIG in m for m in problems)  # derived from it: not reported again
    with pytest.raises(FqError, match=want):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW, base_dir=c.root / "base/k2")


def test_a_base_with_fused_biases_must_declare_the_per_expert_file(tmp_path):
    """An insider's manifest that leaves the file out (and a base without it): exllamav3 would load every expert
    without its bias."""
    c, _, _, _ = with_fused_biases(tmp_path, derived=None)
    base = c.root / "base/k2"
    (base / EXPERT_BIAS).unlink()
    write_derived_without = [d for d in specs(2, "mul1")]  # config.json and quantization_config.json only
    from fq.provenance.exl3config import RULES
    qc = RULES[write_derived_without[1]["rule"]]
    listed = sorted(p.name for p in base.iterdir() if p.is_file() and p.name != MANIFEST_NAME)
    (base / QUANTIZATION_CONFIG).write_bytes(qc.derive(base, qc.inputs(listed), write_derived_without[1]["params"]))
    write_base_manifest(base, node="k2", campaign=c.campaign, key=c.priv, derived=write_derived_without)
    for product in provkit.PRODUCTS:
        provkit._plan(c, product, 1, provkit.EXPIRES, c.priv)
    provkit.publish(c)
    want = f"the skeleton keeps fused expert biases but the manifest declares no {EXPERT_BIAS}"
    assert any(want in m for m in verify_path(c.root, c.pub, now=provkit.NOW).problems)
    with pytest.raises(FqError, match=want):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW, base_dir=base)


def test_a_base_without_fused_biases_declares_no_bias_file(tmp_path, campaign_copy):
    c = campaign_copy
    assert [d["name"] for d in write_derived(c.root / "base/k2", bits=2, codebook="mul1")] == \
        ["config.json", QUANTIZATION_CONFIG]
    assert not (c.root / "base/k2" / EXPERT_BIAS).exists()
