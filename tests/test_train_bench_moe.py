"""benchmarks/train_bench_moe.py (issue 41): the benchmark MoE's training script runs end to end on its tiny shape
(``--tiny``: the same code path, seconds on a CPU), writes a checkpoint that transformers and fq read, a training
record whose loss falls, and the same bytes twice; and the full shape, which only the GPU machine trains, is read by
fq's family registry from its metadata alone."""
from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from fq.model import demo_model, families
from fq.model.source import load_source, parse_source

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "train_bench_moe.py"
THREADS = "2"  # both runs alike: with 2 threads the CPU run is exact only through torch's deterministic kernels


def _module():
    spec = importlib.util.spec_from_file_location("train_bench_moe", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


bench = _module()
pytestmark = pytest.mark.usefixtures("hub_offline")  # offline for this module only


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two --tiny runs, one after the other, into new directories."""
    d = tmp_path_factory.mktemp("bench_moe")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    outs = []
    for name in ("a", "b"):
        p = subprocess.run([sys.executable, str(SCRIPT), str(d / name), "--tiny", "--threads", THREADS],
                           capture_output=True, text=True, env=env, cwd=str(ROOT), timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        outs.append(d / name)
    return outs


def _headers(model_dir: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    out = {}
    for shard in sorted(model_dir.glob("model-*.safetensors")):
        raw = shard.read_bytes()
        (n,) = struct.unpack("<Q", raw[:8])
        header = json.loads(raw[8:8 + n])
        header.pop("__metadata__", None)
        out.update({k: (v["dtype"], tuple(v["shape"])) for k, v in header.items()})
    return out


@pytest.mark.slow
def test_tiny_run_writes_the_files(runs):
    out = runs[0]
    assert sorted(p.name for p in out.iterdir()) == ["model", "text", "training.json"]
    names = sorted(p.name for p in (out / "model").iterdir())
    shards = [n for n in names if n.startswith("model-")]
    assert len(shards) >= 2 and shards == [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    assert names == sorted(["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                            "model.safetensors.index.json", *shards])
    assert {p.name: p.read_bytes() for p in (out / "text").iterdir()} == demo_model.text_files()
    data = demo_model.data()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / "model" / name).read_bytes() == data[name]
    # bf16, the routers and their correction bias float32 (as transformers keeps them)
    dtypes = {name: dt for name, (dt, _) in _headers(out / "model").items()}
    assert {n for n, dt in dtypes.items() if dt == "F32"} == {"model.layers.1.mlp.gate.weight",
                                                              "model.layers.1.mlp.gate.e_score_correction_bias"}
    assert set(dtypes.values()) == {"BF16", "F32"}


@pytest.mark.slow
def test_transformers_loads_it_offline(runs):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = runs[0] / "model"
    model = AutoModelForCausalLM.from_pretrained(d)
    tok = AutoTokenizer.from_pretrained(d)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    cfg = model.config
    for key, value in bench.TINY.items():
        got = cfg.rope_parameters["partial_rotary_factor"] if key == "partial_rotary_factor" else getattr(cfg, key)
        assert got == value, key
    text = "Return the list of the keys of a dictionary."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), demo_model.VOCAB) and torch.isfinite(logits).all()
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.abs().max() > 0  # balanced: a real bias


@pytest.mark.slow
def test_fq_reads_it(runs):
    src = load_source(runs[0] / "model")
    assert src.family == "glm4_moe" and src.model_type == "glm4_moe" and src.dtype == "bfloat16"
    assert src.moe_layers == (1,) and src.dense_layers == (0,) and src.n_experts == 8
    assert src.expert_shape("gate") == (128, 128) and src.expert_shape("down") == (128, 128)
    assert src.exl3_problems == ()  # exllamav3's Glm4MoeForCausalLM loads its bases
    assert len(src.shards) >= 2


@pytest.mark.slow
def test_training_record(runs):
    rec = json.loads((runs[0] / "training.json").read_text())
    assert rec["format"] == bench.FORMAT and rec["seed"] == demo_model.SEED and rec["config"] == bench.TINY
    tr = rec["training"]
    for key in ("steps", "batch", "seq_len", "lr", "min_lr", "warmup", "weight_decay", "betas", "clip", "bias_rate"):
        assert tr[key] == bench.TINY_TRAIN[key], key
    assert tr["tokens_seen"] == tr["steps"] * tr["batch"] * tr["seq_len"]
    curve = tr["curve"]
    assert [c["step"] for c in curve] == list(range(5, 21, 5))
    assert curve[-1]["train_loss"] < curve[0]["train_loss"] - 0.3
    vals = [c["val_loss"] for c in curve if "val_loss" in c]
    assert len(vals) == 2 and vals[-1] < vals[0]
    assert rec["heldout"]["perplexity"] < rec["heldout_before"]["perplexity"] < 1.2 * demo_model.VOCAB
    assert rec["heldout"]["perplexity"] < 0.6 * demo_model.VOCAB
    usage = rec["usage"]["layers"]
    assert list(usage) == ["1"] and len(usage["1"]["counts"]) == 8
    assert sum(usage["1"]["counts"]) == rec["usage"]["tokens"] * bench.TINY["num_experts_per_tok"]
    assert rec["parameters"] == bench.parameter_counts(bench.TINY)
    assert rec["machine"]["device"] == "cpu" and rec["machine"]["threads"] == int(THREADS)
    assert set(rec["versions"]) >= {"torch", "transformers", "tokenizers", "python"}
    assert rec["wall_s"]["train"] > 0 and rec["training"]["precision"] == "float32"


@pytest.mark.slow
def test_same_seed_same_bytes(runs):
    a, b = (d / "model" for d in runs)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for name in files:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    ra, rb = (json.loads((d / "training.json").read_text()) for d in runs)
    assert ra["training"]["curve"] == rb["training"]["curve"] and ra["heldout"] == rb["heldout"]


@pytest.mark.slow
def test_metadata_is_what_the_run_writes(runs):
    """The metadata-only path (used for the full shape below) names the tensors, dtypes and shapes, and states the
    config, that the tiny run's checkpoint holds."""
    d = runs[0] / "model"
    config, index, sizes = bench.metadata(bench.TINY, bench.TINY_TRAIN["shard_bytes"])
    assert config == json.loads((d / "config.json").read_text())
    assert sorted(index["weight_map"]) == sorted(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"])
    assert {n: (dt, s) for n, dt, s in bench.tensor_specs(bench.TINY)} == _headers(d)


def test_full_shape_is_read_by_fq():
    """The shape the GPU machine trains (no weights): realistic proportions, EXL3-friendly dims, and fq's registry
    reads its checkpoint metadata as GLM-4.5 with every MoE layer and no exllamav3 problem."""
    full = bench.FULL
    assert full["num_hidden_layers"] - full["first_k_dense_replace"] >= 8 and full["first_k_dense_replace"] == 1
    assert full["n_routed_experts"] >= 32 and full["num_experts_per_tok"] >= 4 and full["n_shared_experts"] == 1
    config, index, sizes = bench.metadata(full)
    assert families.for_config(config, "full/config.json").name == "glm4_moe"
    src = parse_source(config, index, sizes, origin="bench-moe")
    assert src.family == "glm4_moe" and src.dtype == "bfloat16"
    assert src.moe_layers == tuple(range(1, 10)) and src.dense_layers == (0,) and src.n_experts == 64
    assert src.expert_shape("gate") == (128, 512) and src.expert_shape("down") == (512, 128)
    assert src.exl3_problems == () and len(src.shards) >= 2
    for name, dtype, shape in bench.tensor_specs(full):
        if len(shape) == 2 and ".mlp.gate." not in name:
            assert shape[0] % 128 == 0 and shape[1] % 128 == 0, (name, shape)  # EXL3 tiles, exllamav3's grouped path
    counts = bench.parameter_counts(full)
    assert counts["total"] == 124_561_920 and counts["active"] == 25_471_488
    assert counts["by_class"]["routed_experts"] == 9 * 64 * 3 * 512 * 128
    assert index["metadata"]["total_size"] == sum(sizes.values()) == src.total_bytes
