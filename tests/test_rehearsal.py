"""The campaign rehearsal's source (issue 43): ``fq.model.rehearsal`` / ``benchmarks/rehearsal_source.py``.

Fast: the CPU twin (``--tiny``: hidden 256, GLM-5's head dims, latent and index head dim, 8 experts) is written in a
second or two and checked against the published layout -- the tensor names and dtypes of transformers'
GlmMoeDsaForCausalLM as ``tests/kits/familykit.py`` saves them in DeepSeek's FP8 layout (the indexer's weights_proj
bf16, as GLM-5-FP8 keeps it), safetensors' data order, fq's source reader, transformers' strict load and a finite
forward; byte-identical for a seed, resumed shard by shard; trained-like spectra; the full-width plan's sizes (nothing
written); the rehearsal recipe's plan of the twin. Slow: the twin (a dense layer and one MoE
layer of 2 experts, one attention head) through the real Snakemake workflow with the rehearsal's recipe
(``recipes/rehearsal-glm5.json``: a whole-model K2 base with attention/shared/dense K4 and head K6 and a K1 stage on
it; its K3 experts-only base left out), calibrated on the source's tokenizer and text, through finalize and
``fq verify``. That campaign is about 83 CPU-seconds (the dev machine, idle): the five linear jobs 37 (each attention
job about 9.5: GLM-5's head dims), the two expert encodes 16 (the K1 stage's 10.7), the calibration chain 16,
Snakemake's own process 7 (4 of them the linear shapes of the twin's config, a cold cache entry: transformers' layer on
the meta device). It takes about 55 s alone on the 2 idle cores and 75-80 s in the suite, where the other worker holds
a core (this docstring said about 35 s; the commit that put the campaign in CI measured 51.5 s alone, 77 CPU-s).
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.kits import familykit as fk
from fq.errors import FqError
from fq.model import rehearsal
from fq.model.shards import read_header

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "recipes" / "rehearsal-glm5.json"


def digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def twin(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("twin") / "src"
    rehearsal.write_source(d, rehearsal.tiny(), seed=0, shard_bytes=2_000_000, progress=False)
    return d


@pytest.fixture(scope="module")
def kit_fp8(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("kit")
    return fk.to_fp8(fk.build("GlmMoeDsaForCausalLM", root / "bf16"), root / "fp8")


def headers(d: Path) -> dict[str, dict]:
    out = {}
    for p in sorted(d.glob("*.safetensors")):
        with open(p, "rb") as fh:
            out[p.name] = read_header(fh, str(p))
    return out


def test_twin_has_the_published_names_and_dtypes(twin, kit_fp8):
    """Every tensor transformers' GLM-5 saves, FP8 where DeepSeek's layout puts it; the indexer's weights_proj stays
    bf16 (GLM-5-FP8's modules_to_not_convert), the router weight bf16 beside a float32 score bias."""
    mine = {e.name: e for h in headers(twin).values() for e in h.entries}
    kit = {e.name: e for h in headers(kit_fp8).values() for e in h.entries}
    proj = {n for n in kit if n.endswith("indexer.weights_proj.weight_scale_inv")}
    assert len(proj) == 3 and set(mine) == set(kit) - proj
    for n, e in mine.items():
        if n.endswith("indexer.weights_proj.weight") or n.endswith("mlp.gate.weight"):
            assert e.dtype == "BF16", n
        else:
            assert e.dtype == kit[n].dtype, (n, e.dtype, kit[n].dtype)
    # GLM-5's own head dims where the kit's are small
    assert mine["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (512 + 64, 256)
    assert mine["model.layers.1.self_attn.kv_b_proj.weight"].shape == (2 * (192 + 256), 512)
    assert mine["model.layers.1.self_attn.o_proj.weight"].shape == (256, 2 * 256)
    assert mine["model.layers.1.self_attn.indexer.wk.weight"].shape == (128, 256)
    assert mine["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (5, 2)  # a partial block


def test_twin_shards_and_index(twin):
    index = json.loads((twin / "model.safetensors.index.json").read_text())
    hs = headers(twin)
    assert set(index["weight_map"].values()) == set(hs) and len(hs) > 2
    for shard, h in hs.items():
        assert {e.name for e in h.entries} == {n for n, s in index["weight_map"].items() if s == shard}
        dtypes = [e.dtype for e in h.entries]  # offset order: safetensors' own (float32, then bf16, then fp8)
        assert dtypes == sorted(dtypes, key=lambda t: {"F32": 0, "BF16": 1, "F8_E4M3": 2}[t]), shard
        for e in h.entries:
            if e.name.endswith("_scale_inv"):
                assert index["weight_map"][e.name[: -len("_scale_inv")]] == shard  # a scale beside its weight
    info = json.loads((twin / rehearsal.SUMMARY).read_text())
    assert {n: s["bytes"] for n, s in info["shards"].items()} == {
        n: h.file_size - h.data_start for n, h in hs.items()}
    assert info["bytes"] == index["metadata"]["total_size"]
    text = (twin / rehearsal.CALIBRATION_TEXT).read_bytes()
    assert info["calibration_text"]["sha256"] == hashlib.sha256(text).hexdigest()


def test_fq_and_transformers_read_the_twin(twin):
    from fq.hessian import calibration
    from fq.model import formats
    from fq.model.source import load_source
    from fq.runtime import load as rt

    s = load_source(twin)
    assert (s.family, s.moe_layers, s.source_format) == ("glm_moe_dsa", (1, 2), formats.SourceFormat("fp8", (128, 128)))
    assert not s.exl3_problems
    config, tensors = rt.checkpoint_state(twin)
    model = rt.build_model(config, tensors)  # strict: no missing, unexpected or mismatched key
    text = twin / rehearsal.CALIBRATION_TEXT
    cal = calibration.from_text(text, hashlib.sha256(text.read_bytes()).hexdigest(), twin, 2, 64)
    assert int(cal.tokens.max()) < config["vocab_size"]
    with torch.no_grad():
        logits = model(input_ids=cal.tokens).logits
    assert torch.isfinite(logits).all() and logits.shape == (2, 64, 512)


def test_an_fp8_linear_with_a_partial_last_block_is_read_as_exllamav3_reads_it(twin):
    """MLA's kv_a_proj_with_mqa (512 + 64 = 576 rows: 4.5 blocks of 128) as a whole-model base's attention job reads
    it: the ceil grid, the last block's scale over its 64 rows (the rehearsal found the reader refusing it)."""
    from fq.model.formats import ExpertSource, dequantize_fp8, read_matrix
    from safetensors import safe_open

    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    shard = str(twin / json.loads((twin / "model.safetensors.index.json").read_text())["weight_map"][name])
    w = read_matrix({}, ExpertSource(shard, name, (576, 256), shard, name + "_scale_inv", (128, 128)), name)
    with safe_open(shard, "pt") as f:
        q, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    assert s.shape == (5, 2) and torch.equal(w, dequantize_fp8(q, s))
    assert torch.equal(w[512:, :128], q[512:, :128].float() * s[4, 0])


def test_same_seed_same_bytes_and_a_resume_rewrites_only_what_is_missing(tmp_path, twin):
    d = tmp_path / "again"
    rehearsal.write_source(d, rehearsal.tiny(), seed=0, shard_bytes=2_000_000, progress=False)
    assert digests(d) == digests(twin)
    shards = sorted(d.glob("model-*.safetensors"))
    keep = shards[0].stat().st_mtime_ns
    shards[1].unlink()
    with open(shards[2], "r+b") as fh:  # a shard cut short: rewritten
        fh.truncate(100)
    rehearsal.write_source(d, rehearsal.tiny(), seed=0, shard_bytes=2_000_000, progress=False)
    assert digests(d) == digests(twin) and shards[0].stat().st_mtime_ns == keep
    other = tmp_path / "seed1"
    rehearsal.write_source(other, rehearsal.tiny(), seed=1, shard_bytes=2_000_000, progress=False)
    assert digests(other)[shards[0].name] != digests(twin)[shards[0].name]


def test_weights_are_trained_like(twin):
    """A decaying spectrum above a noise bulk, a few hard-read input columns; norms with outlier channels."""
    from fq.runtime.load import checkpoint_state

    _, tensors = checkpoint_state(twin)  # float32, the FP8 weights dequantized
    w = tensors["model.layers.1.mlp.experts.0.gate_proj.weight"]
    sv = torch.linalg.svdvals(w.double())
    assert sv[0] > 3 * sv[20] and sv[20] > 1.2 * sv[-1], sv[[0, 20, -1]]  # not the flat spectrum of i.i.d. noise
    cols = w.norm(dim=0)
    assert cols.max() > 2.5 * cols.median()
    norm = tensors["model.layers.1.post_attention_layernorm.weight"].float()
    assert norm.max() > 4 * norm.median() and norm.min() < norm.median() / 1.3


def test_full_width_plan_sizes():
    """GLM-5's widths, 1 dense + 2 MoE layers of 32 experts: the sizes the generator would write (nothing written)."""
    d = rehearsal.check(rehearsal.GLM5)
    plan = rehearsal.shard_plan(rehearsal.specs(d), rehearsal.SHARD_BYTES)
    info = rehearsal.summary(d, plan, 0)
    per_expert = 3 * 2048 * 6144 + 3 * 16 * 48 * 4  # fp8 gate/up/down and their 128x128 scale grids
    assert info["moe_layer"]["per_expert_bytes"] == per_expert
    assert info["classes"]["head"] == info["classes"]["embed"] == 154880 * 6144 * 2
    assert all(s["bytes"] <= rehearsal.SHARD_BYTES for s in info["shards"].values())
    assert 6.9e9 < info["bytes"] < 7.2e9
    assert 700e9 < info["projection_256"]["glm5_bytes"] < 780e9  # GLM-5-FP8 is about 750 GB
    cfg = rehearsal.config(d)
    from transformers import GlmMoeDsaConfig

    hf = GlmMoeDsaConfig()  # its defaults are zai-org/GLM-5's
    for key in ("hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads", "q_lora_rank",
                "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads",
                "index_head_dim", "index_topk", "vocab_size", "num_experts_per_tok", "n_shared_experts",
                "routed_scaling_factor", "rms_norm_eps", "max_position_embeddings"):
        assert cfg[key] == getattr(hf, key), key


def test_metadata_only_is_what_the_source_would_be(tmp_path, twin):
    """write_metadata: the twin's config.json and index byte for byte, and sizes.json its shards' file sizes (what
    fq price --sizes reads of a full-width rehearsal without writing its 5.8 GB)."""
    meta = tmp_path / "meta"
    rehearsal.write_metadata(meta, rehearsal.tiny(), shard_bytes=2_000_000)
    for name in ("config.json", "model.safetensors.index.json"):
        assert (meta / name).read_bytes() == (twin / name).read_bytes(), name
    sizes = json.loads((meta / "sizes.json").read_text())
    assert sizes == {p.name: p.stat().st_size for p in twin.glob("*.safetensors")}
    assert not list(meta.glob("*.safetensors"))


@pytest.mark.parametrize("over,needle", [({"hidden": 200}, "hidden=200"), ({"top_k": 9}, "top_k=9"),
                                         ({"experts": 0}, "experts=0")])
def test_bad_dims_are_refused_by_name(over, needle):
    with pytest.raises(FqError, match=needle):
        rehearsal.check(rehearsal.tiny(**over))


def test_the_script_writes_the_twin(tmp_path):
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rehearsal_source.py"), str(tmp_path / "s"),
                        "--tiny", "--quiet", "--layers", "0+1", "--experts", "4"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    cfg = json.loads((tmp_path / "s" / "config.json").read_text())
    assert (cfg["n_routed_experts"], cfg["num_experts_per_tok"], cfg["mlp_layer_types"]) == (4, 2, ["sparse"])
    p = subprocess.run([sys.executable, str(REPO / "benchmarks" / "rehearsal_source.py"), str(tmp_path / "t"),
                        "--width-scale", "5"], capture_output=True, text=True)
    assert p.returncode == 1 and "expected a positive multiple of 128" in p.stderr


# -- the twin through the workflow -----------------------------------------------------------------------------------
# CI's twin: 2 experts a layer (one block; top-2 of 2, the fewest a top-2 router has: each expert encode job's CPU
# is proportional to them), one attention head (MLA's kv_b_proj is heads x (192 + 256) rows at GLM-5's head dims:
# at 2 heads the attention jobs were most of the campaign's CPU) and one MoE layer after the dense one (each layer's
# attention job is about 10 s of CPU at K4: with two MoE layers the campaign took 69 s)
CAMPAIGN_DIMS = dict(experts=2, heads=1, moe_layers=1)


def campaign_config(d: Path, src: Path, key: Path, rows: int, cols: int, recipe: Path = RECIPE) -> Path:
    text = src / rehearsal.CALIBRATION_TEXT
    cfg = {"campaign": "rehearsal-twin", "out": "campaign",
           "source": {"kind": "local", "path": str(src), "revision": "twin-0"}, "recipe": str(recipe),
           "block_size": CAMPAIGN_DIMS["experts"], "windows": None, "windows_on_disk": 1, "signer_key": str(key),
           "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0}, "compare_native": False,
           "eval": None, "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"},
           "calibration": {"text": str(text), "sha256": hashlib.sha256(text.read_bytes()).hexdigest(), "rows": rows,
                           "columns": cols, "capture": "all-experts", "compare_weight_only": False}}
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.yaml").write_text(json.dumps(cfg))
    return d / "config.yaml"


def test_the_rehearsal_recipe_plans_the_twin(tmp_path, twin):
    """fq plan (pure, no job) of the twin with the rehearsal's recipe: every MoE layer's block for the three nodes,
    the whole-model base's linear jobs (attention of every layer, shared experts of the MoE layers, the dense MLP,
    the head), one calibration chain."""
    from fq.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(RECIPE), "--model", str(twin), "--block-size", "8", "--calibration", "2x64",
                 "--windows-on-disk", "1", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert [(b["layer"], b["count"]) for b in plan["blocks"]] == [(1, 8), (2, 8)]
    assert [n["name"] for n in plan["nodes"]] == ["k2.w4", "k3", "k2.w4.r1"]
    units = {u["name"]: sorted(u["layers"]) for u in plan["linears"]}
    assert units == {"attention-K4-mcg": ["0", "1", "2"], "shared-K4-mcg": ["1", "2"], "dense-K4-mcg": ["0"],
                     "head-K6-mcg": [units["head-K6-mcg"][0]]}, units
    assert "model.layers.0.self_attn.kv_a_proj_with_mqa" in plan["linears"][0]["layers"]["0"]


@pytest.mark.slow
def test_the_twin_goes_through_the_rehearsal_campaign(tmp_path):
    """The real workflow through finalize and its verification, the whole-model base of an FP8 source included (fq
    verify refused it before: its linear fragments attest the block scales they read). The two attention jobs are
    the longest (about 10 s each on the 2-core dev machine)."""
    from tests.kits.crashkit import TARGETS, smk
    from tests.test_workflow import campaign

    src = tmp_path / "src"
    rehearsal.write_source(src, rehearsal.tiny(**CAMPAIGN_DIMS), seed=0, shard_bytes=1_000_000, progress=False)
    p = subprocess.run([sys.executable, "-m", "fq", "keygen", "--out", str(tmp_path / "signer")], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr
    d = tmp_path / "run"
    # the rehearsal's recipe without its experts-only base (CI's time: an FP8 experts-only campaign is
    # test_family_campaigns.py's); the whole-model base and the stage on it as the device runs them
    doc = json.loads(RECIPE.read_text())
    doc["nodes"] = [n for n in doc["nodes"] if n["name"] != "k3"]
    doc["products"] = [p for p in doc["products"] if "k3" not in p["chain"]]
    (tmp_path / "recipe.json").write_text(json.dumps(doc))
    campaign_config(d, src, tmp_path / "signer.key", 2, 64, tmp_path / "recipe.json")
    t0 = time.monotonic()
    run = smk(d, *TARGETS, check=False)
    print(f"\nrehearsal twin campaign: {time.monotonic() - t0:.1f} s (Snakemake, through finalize and its verification)")
    out = d / "campaign"
    c = campaign(d)
    assert c.calib.calibrated_layers == (1,)
    assert len(c.fragments) == 2  # 1 MoE layer x one block x 2 nodes
    assert (out / "campaign_summary.json").is_file()  # finalize published
    base = out / "published" / "base" / "k2.w4"
    qc = json.loads((base / "quantization_config.json").read_text())
    exl3 = {k for k, e in qc["tensor_storage"].items() if e.get("quant_format") == "exl3"}
    assert {"lm_head", "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.kv_a_proj_with_mqa",
            "model.layers.1.mlp.shared_experts.up_proj"} <= exl3
    assert "model.layers.1.self_attn.indexer.wk" not in exl3  # the indexer stays as published (FP8)
    assert qc["tensor_storage"]["model.layers.1.self_attn.indexer.wk"]["stored_tensors"][
        "model.layers.1.self_attn.indexer.wk.weight"]["dtype"] == "torch.float8_e4m3fn"
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    assert (out / "published.verified").read_text().startswith("ok: ")
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(out / "published"), "--key",
                        str(tmp_path / "signer.pub")], capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
