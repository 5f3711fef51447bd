#!/usr/bin/env python3
"""fq price of a whole-model base beside an experts-only one, at the shapes of several registered families (issue 25).

    python benchmarks/whole_model_price.py

A K2 experts-only base and a K2 base with attention, shared experts and dense MLPs at K4 and the head at K6 (the
classes a family lacks left out), calibrated (250 x 2048 tokens), priced from config-only synthetic sources
(fq.model.source_synth: GLM-5's own shapes; DeepSeek-V3 / Kimi-K2, Qwen3-235B-A22B and Mixtral-8x22B at their
published sizes) with the shipped H200 cost table. Prints a markdown table: bpw over the model and stored GB of each
base, the added encodes' GPU-hours and their Hessians' disk.
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fq.model.source import parse_source  # noqa: E402
from fq.model.source_synth import glm5_like, synthetic_checkpoint  # noqa: E402
from fq.planning.calibration_cost import price_calibration  # noqa: E402
from fq.planning.price import default_cost_table_path, load_cost_table, price_recipe  # noqa: E402
from fq.planning.recipe import parse_recipe  # noqa: E402

SKELETON = {"attention": 4, "shared": 4, "dense": 4, "head": 6}


def sources() -> dict:
    deepseek = dict(hidden=7168, inter=2048, n_experts=256, n_layers=61, first_dense=3, vocab=129280, dense_inter=18432,
                    extra_config={"num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536,
                                  "num_experts_per_tok": 8, "n_shared_experts": 1})
    qwen3 = dict(hidden=4096, inter=1536, n_experts=128, n_layers=94, vocab=151936,
                 extra_config={"num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
                               "num_experts_per_tok": 8})
    mixtral = dict(hidden=6144, inter=16384, n_experts=8, n_layers=56, vocab=32768,
                   extra_config={"num_attention_heads": 48, "num_key_value_heads": 8, "num_experts_per_tok": 2})
    return {"GLM-5": parse_source(*glm5_like(), origin="glm5"),
            "DeepSeek-V3 / Kimi-K2": parse_source(*synthetic_checkpoint("deepseek", **deepseek), origin="deepseek-v3"),
            "Qwen3-235B-A22B": parse_source(*synthetic_checkpoint("qwen3_moe", **qwen3), origin="qwen3-235b"),
            "Mixtral-8x22B": parse_source(*synthetic_checkpoint("mixtral", **mixtral), origin="mixtral-8x22b")}


def main() -> int:
    table = load_cost_table(default_cost_table_path())
    print("| shapes | experts-only K2: bpw model, GB | K2 + linears K4, head K6: bpw model, GB | added encodes, "
          "GPU-h | their Hessians, GB |")
    print("| --- | --- | --- | --- | --- |")
    for label, src in sources().items():
        skeleton = {c: k for c, k in SKELETON.items()
                    if not (c == "shared" and not src.config.get("n_shared_experts"))
                    and not (c == "dense" and not src.dense_layers)}
        recipe = parse_recipe({"format": "fq-cartridge/2", "name": "price", "nodes": [
            {"name": "k2", "kind": "base", "K": 2, "codebook": "mul1"},
            {"name": "w2", "kind": "base", "K": 2, "codebook": "mul1", "skeleton": skeleton}],
            "products": [{"name": "k2", "chain": ["k2"]}, {"name": "w2", "chain": ["w2"]}]}, "recipe")
        p = price_recipe(recipe, src, table, calibration=price_calibration(src, 250, 2048), allow_unloadable=True)
        k2, w2 = p.products
        print(f"| {label} | {k2.model_bpw:.2f}, {k2.bytes / 1e9:.1f} | {w2.model_bpw:.2f}, {w2.bytes / 1e9:.1f} | "
              f"{sum(ln.gpu_seconds for ln in p.linears) / 3600:.2f} | "
              f"{sum(ln.hessian_bytes for ln in p.linears) / 1e9:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
