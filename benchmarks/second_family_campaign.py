"""A second registered family for the whole-model comparison with exllamav3 (issue 25): a tiny Qwen3-MoE trained on
the demo's corpus with the demo's tokenizer, then a calibrated whole-model campaign of it, on the CPU.

The demo model is GLM-4-MoE; a random-initialised checkpoint of another family predicts nearly uniform logits, so
every quantizer's KL to it is tiny and says little. This script trains ``Qwen3MoeForCausalLM`` (transformers' own
class and config: hidden 256, 3 MoE layers of 8 experts × 128, top-2, GQA 4/2 heads of 64, untied head; every layer
MoE, no shared expert, no dense MLP) with ``fq.model.demo_train.train_model`` (the demo's optimizer, schedule and
windows; Qwen3's own auxiliary balancing loss instead of the GLM selection bias), saves it in bf16 in three shards
with the demo tokenizer, then runs Snakemake on it: experts-only k2/k3/k4 and whole-model w2/w3/w4 (attention at K,
head K6; Qwen3-MoE has no shared or dense class), calibrated on the demo's calibration split.

    .venv/bin/python benchmarks/second_family_campaign.py WORK [--steps 450] [--cores 2]

WORK/carry/ is what the GPU box needs (``benchmarks/exl3_whole_model.py WORK/carry OUT``): published/, signer.pub,
source/ (the checkpoint) and calibration-tokens.safetensors. WORK/training.json records the training run and the
source's held-out perplexity.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

QWEN3_MOE = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
                 decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True, rms_norm_eps=1e-6,
                 tie_word_embeddings=False, max_position_embeddings=2048, eos_token_id=0, pad_token_id=0,
                 bos_token_id=0, router_aux_loss_coef=0.01)
BASES = {"k2": (2, {}), "k3": (3, {}), "k4": (4, {}),
         "w2": (2, {"attention": 2, "head": 6}), "w3": (3, {"attention": 3, "head": 6}),
         "w4": (4, {"attention": 4, "head": 6})}


def recipe() -> dict:
    nodes = [dict(name=n, kind="base", K=k, codebook="mul1", **({"skeleton": s} if s else {}))
             for n, (k, s) in BASES.items()]
    return {"format": "fq-cartridge/2", "name": "qwen3wm",
            "description": "a trained tiny Qwen3-MoE: whole-model bases against experts-only ones and exllamav3's converter",
            "nodes": nodes, "products": [{"name": n, "chain": [n]} for n in BASES]}


def train(work: Path, steps: int) -> Path:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from fq.model import demo_model, demo_train

    src = work / "source"
    if (src / "config.json").is_file():
        return src
    torch.set_num_threads(demo_train.THREADS)
    data = demo_model.DATA
    tok = Tokenizer.from_file(str(data / "tokenizer.json"))
    train_ids = torch.tensor(tok.encode(demo_model.text("train")).ids, dtype=torch.int64)
    torch.manual_seed(demo_model.SEED)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**QWEN3_MOE, output_router_logits=True))
    model, record = demo_train.train_model(train_ids, steps=steps, model=model)
    model.config.output_router_logits = False
    f32 = work / "f32"
    model.save_pretrained(f32)
    m = AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16)
    tmp = work / "source.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    m.save_pretrained(tmp, max_shard_size="3MB")  # several shards, as published checkpoints are
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(data / name, tmp / name)
    shutil.rmtree(f32)
    held = demo_train.perplexity(tmp, demo_model.text("heldout"))
    print(f"held-out perplexity {held['perplexity']:.3f} (uniform {demo_model.VOCAB})", flush=True)
    (work / "training.json").write_text(json.dumps({"config": QWEN3_MOE, "training": record, "heldout": held},
                                                   indent=1, sort_keys=True) + "\n")
    tmp.rename(src)
    return src


def campaign(work: Path, src: Path, cores: int) -> Path:
    from fq.model import demo_model

    cal = work / "calibration.txt"
    cal.write_text(demo_model.text("calibration"), encoding="utf-8")
    (work / "recipe.json").write_text(json.dumps(recipe(), indent=1))
    cfg = {"campaign": "qwen3wm", "out": "campaign", "source": {"kind": "local", "path": str(src), "revision": "trained-1"},
           "recipe": str(work / "recipe.json"), "block_size": 4, "windows": None, "windows_on_disk": 1,
           "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0}, "compare_native": False, "eval": None,
           "calibration": {"text": str(cal), "sha256": hashlib.sha256(cal.read_bytes()).hexdigest(), "rows": 16,
                           "columns": 128, "capture": "all-experts", "compare_weight_only": False},
           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}
    (work / "config.yaml").write_text(json.dumps(cfg))
    t0 = time.monotonic()
    subprocess.run([str(Path(sys.executable).with_name("snakemake")), "--snakefile", str(ROOT / "Snakefile"),
                    "--directory", str(work), "--configfile", str(work / "config.yaml"), "--cores", str(cores)],
                   check=True, cwd=work)
    print(f"campaign: {time.monotonic() - t0:.0f} s", flush=True)
    return work / "campaign"


def carry(work: Path, src: Path, out: Path) -> Path:
    c = work / "carry"
    shutil.rmtree(c, ignore_errors=True)
    c.mkdir()
    shutil.copytree(out / "published", c / "published")
    shutil.copy(out / "signer.pub", c / "signer.pub")
    shutil.copytree(src, c / "source")
    shutil.copy(out / "calibration" / "tokens.safetensors", c / "calibration-tokens.safetensors")
    return c


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("work", type=Path)
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--cores", type=int, default=2)
    args = p.parse_args(argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    src = train(work, args.steps)
    out = campaign(work, src, args.cores)
    print(f"carry: {carry(work, src, out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
