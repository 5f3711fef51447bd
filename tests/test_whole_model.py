"""Whole-model bases (recipe ``skeleton``): a calibrated Snakemake campaign on the demo model whose bases also quantize
attention, the shared experts, the dense MLP and lm_head. One linear node per (class, K, codebook) shared by the
bases that name it, LDLQ against the linears' own input Hessians, fragments attested and verified by every consumer,
the quantized tensors replacing the bf16 ones in the base directory, the derived config's whole-model bits, and the
CPU runtime loading it."""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from fq.core import canonical
from test_calibration_workflow import statement
from test_workflow import campaign, job_counts, smk, write_config

pytestmark = pytest.mark.slow

FULL = {"attention": 4, "shared": 4, "dense": 4, "head": 6}
RECIPE = {
    "format": "fq-cartridge/2", "name": "wmtest", "description": "whole-model bases",
    "nodes": [
        {"name": "w", "kind": "base", "K": 3, "codebook": "mul1", "skeleton": FULL},
        {"name": "w.r1", "kind": "stage", "K": 3, "codebook": "mul1", "parent": "w", "experts": "all"},
    ],
    "products": [{"name": "w", "chain": ["w"]}, {"name": "w.r1", "chain": ["w", "w.r1"]}],
}
# a second base naming attention at K4 too (planned only: the dry run shows the shared node)
TWO_BASES = dict(RECIPE, nodes=[*RECIPE["nodes"], {"name": "v", "kind": "base", "K": 2, "codebook": "mul1",
                                                    "skeleton": {"attention": 4}}],
                 products=[*RECIPE["products"], {"name": "v", "chain": ["v"]}])
CALIBRATION = {"text": None, "sha256": None, "rows": 4, "columns": 64, "capture": "all-experts",
               "compare_weight_only": False}


@pytest.fixture(scope="module")
def wm(tmp_path_factory):
    d = tmp_path_factory.mktemp("wm")
    write_config(d, RECIPE, calibration=CALIBRATION, windows="1-2")
    dry = smk(d, "-n")
    smk(d)
    return d, dry.stdout + dry.stderr


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_one_linear_job_per_class_and_layer_shared_by_the_bases(wm, tmp_path):
    d, dry = wm
    counts = job_counts(dry)
    # attention K4 (3 layers), shared K4 (2 MoE layers), dense K4 (layer 0), head K6
    assert counts["encode_linears"] == 3 + 2 + 1 + 1 and counts["calib_head"] == 1
    c = campaign(d)
    assert [n["name"] for n in c.plan.linears] == ["attention-K4-mul1", "shared-K4-mul1", "dense-K4-mul1",
                                                   "head-K6-mul1"]
    # a K2 base naming attention K4 as well adds its experts' jobs and no linear job
    write_config(tmp_path, TWO_BASES, calibration=CALIBRATION, windows="1-2")
    p = smk(tmp_path, "-n")
    two = job_counts(p.stdout + p.stderr)
    assert two["encode_linears"] == counts["encode_linears"] and two["encode"] > counts["encode"]
    c2 = campaign(tmp_path)
    nodes = {n["name"]: n for n in c2.plan.to_json()["nodes"]}
    assert nodes["v"]["skeleton"] == {"attention": "attention-K4-mul1"}
    assert nodes["w"]["skeleton"]["attention"] == "attention-K4-mul1"
    assert set(c2.base_linear_fragments("v")) < set(c2.base_linear_fragments("w"))


def test_linear_fragments_are_ldlq_against_their_bound_hessians(wm):
    d, _ = wm
    c = campaign(d)
    for node, layer in c.linear_jobs:
        path = Path(c.linear_fragment(node, layer))
        pred = statement(path)["predicate"]
        bound = canonical.load(c.linear_hessian_binding(layer))
        assert pred["kind"] == "linear" and pred["quant_args"]["objective"].startswith("LDLQ")
        assert pred["quant_args"]["hessian"]["sha256"] == bound["sha256"] == hashlib.sha256(
            Path(c.linear_hessian(layer)).read_bytes()).hexdigest()
        metrics = canonical.load(c.linear_metrics(node, layer))
        assert all(0 < m["proxy_err"] < 0.05 for m in metrics["linears"].values()), metrics


def test_published_base_holds_the_quantized_linears_and_verifies(wm):
    d, _ = wm
    out = d / "campaign"
    pub = out / "published"
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    index = json.loads((pub / "base" / "w" / "model.safetensors.index.json").read_text())["weight_map"]
    # no bf16 weight of a quantized linear is left; embeddings, norms and the router stay as published
    assert not [k for k in index if k.endswith("_proj.weight") and ".experts." not in k]
    assert "lm_head.weight" not in index and "lm_head.trellis" in index
    assert "model.embed_tokens.weight" in index and "model.norm.weight" in index
    assert "model.layers.1.mlp.gate.weight" in index and "model.layers.0.self_attn.q_proj.trellis" in index
    for name, shard in index.items():
        assert name in _keys(pub / "base" / "w" / shard)


def test_derived_config_states_bits_over_the_whole_model(wm):
    d, _ = wm
    base = d / "campaign" / "published" / "base" / "w"
    q = json.loads((base / "config.json").read_text())["quantization_config"]
    assert q["expert_bits"] == 3 and q["head_bits"] == 6 and q["linear_bits"] == FULL
    assert q["calibration"] == {"rows": CALIBRATION["rows"], "cols": CALIBRATION["columns"]}
    # bits, recomputed from the published tensors: the stored bytes of every linear but the embeddings, the head and
    # the routers over the weights they hold (exllamav3's convention: head_bits apart)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    mods: dict = {}
    for name, shard in index.items():
        mod, _, leaf = name.rpartition(".")
        with safe_open(str(base / shard), "pt") as f:
            t = f.get_tensor(name)
        mods.setdefault(mod, {})[leaf] = t
    n_bytes = n_weights = 0
    for mod, ts in mods.items():
        if mod == "lm_head" or mod.endswith(("embed_tokens", ".gate")):
            continue
        if "trellis" in ts:
            n_weights += ts["trellis"].shape[0] * 16 * ts["trellis"].shape[1] * 16
        elif "weight" in ts and ts["weight"].dim() == 2:
            n_weights += ts["weight"].numel()
        else:
            continue
        n_bytes += sum(t.numel() * t.element_size() for k, t in ts.items() if k != "bias")
    assert q["bits"] == round(8 * n_bytes / n_weights, 4) and 3 < q["bits"] < 4.5


def test_a_tampered_linear_fragment_is_refused_by_verify(wm, tmp_path):
    d, _ = wm
    out = d / "campaign"
    pub = shutil.copytree(out / "published", tmp_path / "published")
    frag = pub / "base" / "w" / "shared-K4-mul1-layer002.safetensors"
    raw = bytearray(frag.read_bytes())
    raw[-3] ^= 0x40
    frag.write_bytes(bytes(raw))
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "shared-K4-mul1-layer002.safetensors" in p.stderr, p.stderr


def test_cpu_runtime_loads_whole_model_products(wm):
    """fq's runtime reconstructs every quantized linear from its fragment; the product's logits stay close to the
    source's and the stage still improves on its whole-model base."""
    from fq.provenance.attest import keys
    from fq.runtime.load import load_checkpoint, load_product

    d, _ = wm
    out = d / "campaign"
    pub = keys.load_public(out / "signer.pub")
    src = load_checkpoint(out / "demo-model")
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(src(input_ids=ids).logits.float(), -1)
    kl = {}
    for p in ("w", "w.r1"):
        m = load_product(out / "published" / "assemblies" / f"{p}.assembly.intoto.jsonl", pub,
                         root=out / "published")
        tensors = m.state.tensors
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
        w = src.state_dict()["model.layers.0.self_attn.q_proj.weight"].float()
        assert q.shape == w.shape and 0 < float((q - w).norm() / w.norm()) < 0.2
        with torch.no_grad():
            lp = torch.log_softmax(m.model(input_ids=ids).logits.float(), -1)
        kl[p] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert all(0 < v < 0.05 for v in kl.values()), kl
    assert kl["w.r1"] < kl["w"], kl
