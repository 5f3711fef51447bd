"""A chain K2 + K1 against exllamav3's native K3 on GLM-5-shaped MoE layers (issue 26, H200).

    python benchmarks/exl3_chain_glm5_speed.py WORKDIR [--layers 1] [--json OUT] [--modes ...]

Writes two one-layer Glm4MoeForCausalLM directories with GLM-5's MoE shapes (hidden 6144, moe_intermediate 2048,
256 routed experts, top-8, one shared expert; attention, router, embeddings and head bf16/float32): one whose routed
experts are random EXL3 K3 tensors (the native base) and one at K2, plus random K1 stage tensors for every expert
linear. Random trellis words decode to codebook values like any encoding's; the timing of a trellis GEMM does not
depend on which values they hold. Then, in one process on one GPU, the MoE block's forward (exllamav3's
BlockSparseMLP, routing included) at batch 1 (decode) and over 2048 tokens (prefill), CUDA-event medians:

- native-k3 / native-k2: exllamav3's own fast paths;
- per-expert-k2: the K2 base on exllamav3's per-expert path (every expert linear a chain of one);
- chain-per-expert: fq.runtime.exl3's current chain (every expert linear a ChainLinear summing its stages' EXL3
  GEMMs; the layer on exllamav3's per-expert path);
- any other mode named in CHAIN_MODES (fq.runtime.exl3).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, MOE_INTER, EXPERTS, TOPK, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 6144, 2048, 256, 8, 1024, 48, 8, 128
PREFILL = 2048


def config(layers: int) -> dict:
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": HIDDEN,
            "intermediate_size": 12288, "moe_intermediate_size": MOE_INTER, "n_routed_experts": EXPERTS,
            "n_shared_experts": 1, "num_experts_per_tok": TOPK, "first_k_dense_replace": 0,
            "num_hidden_layers": layers, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM, "partial_rotary_factor": 0.5, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "hidden_act": "silu", "n_group": 1,
            "topk_group": 1, "tie_word_embeddings": False, "max_position_embeddings": 4096, "rope_theta": 1e6,
            "attention_bias": False, "torch_dtype": "bfloat16", "use_qk_norm": False}


def exl3_random(out_f: int, in_f: int, K: int, g, device) -> dict:
    """Random EXL3 tensors of one (out, in) linear at K bits, mul1 codebook: trellis words uniform, suh random signs
    over sqrt(in), svh a small positive scale (outputs of a sane magnitude)."""
    import torch

    from fq.codec import marker_value

    trellis = torch.randint(-32768, 32768, (in_f // 16, out_f // 16, 16 * K), generator=g, device=device,
                            dtype=torch.int32).to(torch.int16)
    suh = (torch.randint(0, 2, (in_f,), generator=g, device=device) * 2 - 1).half() / in_f ** 0.5
    svh = torch.full((out_f,), 0.02, device=device, dtype=torch.half)
    return {"trellis": trellis.cpu(), "suh": suh.cpu(), "svh": svh.cpu(),
            "mul1": torch.tensor(marker_value("mul1"), dtype=torch.int32)}


def write_model(d: Path, K: int, layers: int, seed: int) -> dict:
    """The model directory at expert bits K; returns {(layer, expert, proj): K1 stage tensors} when K == 2."""
    import torch
    from safetensors.torch import save_file

    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config(layers)))
    g = torch.Generator(device="cuda:0").manual_seed(seed)
    dev = "cuda:0"

    def bf(*shape, scale=0.02):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(torch.bfloat16).cpu()

    dense = {"model.embed_tokens.weight": bf(VOCAB, HIDDEN, scale=1.0), "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
             "lm_head.weight": bf(VOCAB, HIDDEN)}
    stages = {}
    for L in range(layers):
        p = f"model.layers.{L}"
        dense.update({f"{p}.input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                      f"{p}.post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                      f"{p}.self_attn.q_proj.weight": bf(HEADS * HEAD_DIM, HIDDEN),
                      f"{p}.self_attn.k_proj.weight": bf(KV_HEADS * HEAD_DIM, HIDDEN),
                      f"{p}.self_attn.v_proj.weight": bf(KV_HEADS * HEAD_DIM, HIDDEN),
                      f"{p}.self_attn.o_proj.weight": bf(HIDDEN, HEADS * HEAD_DIM),
                      f"{p}.mlp.gate.weight": bf(EXPERTS, HIDDEN).float(),
                      f"{p}.mlp.gate.e_score_correction_bias": torch.zeros(EXPERTS),
                      f"{p}.mlp.shared_experts.gate_proj.weight": bf(MOE_INTER, HIDDEN),
                      f"{p}.mlp.shared_experts.up_proj.weight": bf(MOE_INTER, HIDDEN),
                      f"{p}.mlp.shared_experts.down_proj.weight": bf(HIDDEN, MOE_INTER)})
        experts = {}
        for e in range(EXPERTS):
            for proj, (o, i) in (("gate_proj", (MOE_INTER, HIDDEN)), ("up_proj", (MOE_INTER, HIDDEN)),
                                 ("down_proj", (HIDDEN, MOE_INTER))):
                for s, t in exl3_random(o, i, K, g, dev).items():
                    experts[f"{p}.mlp.experts.{e}.{proj}.{s}"] = t
                if K == 2:
                    stages[(L, e, proj)] = exl3_random(o, i, 1, g, dev)
        save_file(experts, str(d / f"experts-{L:03d}.safetensors"))
    save_file(dense, str(d / "model.safetensors"))
    return stages


def _median_ms(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def moe_blocks(model) -> list:
    return [m for m in model if hasattr(m, "ups") and hasattr(m, "downs") and hasattr(m, "routing_fn")]


def time_blocks(model, seed: int = 0) -> dict:
    import torch

    g = torch.Generator(device="cuda:0").manual_seed(seed)
    blocks = moe_blocks(model)
    x1 = torch.randn(1, 1, HIDDEN, generator=g, device="cuda:0").half()
    xp = torch.randn(1, PREFILL, HIDDEN, generator=g, device="cuda:0").half()

    def run(x):
        for m in blocks:
            m.forward(x, {})

    with torch.inference_mode():  # exllamav3 adds into its buffers in place, as its own model.forward does
        return {"decode_ms": round(_median_ms(lambda: run(x1), 50), 4),
                "prefill_ms": round(_median_ms(lambda: run(xp), 10), 3), "moe_layers": len(blocks)}


def load(d: Path):
    import exllamav3 as ex

    config = ex.Config.from_directory(str(d))
    model = ex.Model.from_config(config)
    model.load("cuda:0")
    return config, model


def chain_per_expert(config, model, stages: dict) -> None:
    """fq.runtime.exl3's current chain: ChainLinear on every expert linear, the per-expert path."""
    from fq.runtime.exl3 import ChainLinear, _per_expert_path, _stage_linear

    for m in moe_blocks(model):
        layer = int(m.key.split(".")[2])
        for projs, proj in ((m.gates, "gate_proj"), (m.ups, "up_proj"), (m.downs, "down_proj")):
            for e, lin in enumerate(projs):
                st = _stage_linear(config, stages[(layer, e, proj)], lin.in_features, lin.out_features, "cuda:0",
                                   f"{lin.key}.stage1")
                lin.inner = ChainLinear(lin.inner, [st])
        _per_expert_path(m)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", nargs="*", default=["native-k3", "native-k2", "per-expert-k2", "chain-per-expert"])
    a = ap.parse_args(argv)
    write_model(a.workdir / "k3", 3, a.layers, seed=3)
    stages = write_model(a.workdir / "k2", 2, a.layers, seed=2)
    print("models written", flush=True)
    results = {"shape": {"hidden": HIDDEN, "moe_intermediate": MOE_INTER, "experts": EXPERTS, "top_k": TOPK,
                         "prefill_tokens": PREFILL, "layers": a.layers}, "gpu": torch.cuda.get_device_name(0)}
    for mode in a.modes:
        config, model = load(a.workdir / ("k3" if mode == "native-k3" else "k2"))
        if mode == "chain-per-expert":
            chain_per_expert(config, model, stages)
        elif mode == "per-expert-k2":  # the per-expert path's own cost: every expert a chain of one
            from fq.runtime.exl3 import _per_expert_path

            for m in moe_blocks(model):
                _per_expert_path(m)
        elif mode not in ("native-k3", "native-k2"):
            from fq.runtime.exl3 import CHAIN_MODES

            CHAIN_MODES[mode](config, model, stages)
        results[mode] = time_blocks(model)
        print(mode, results[mode], flush=True)
        model.unload()
        del model
        torch.cuda.empty_cache()
    k3 = results.get("native-k3")
    if k3:
        for mode in a.modes:
            if mode != "native-k3":
                results[mode]["decode_vs_k3"] = round(results[mode]["decode_ms"] / k3["decode_ms"], 3)
                results[mode]["prefill_vs_k3"] = round(results[mode]["prefill_ms"] / k3["prefill_ms"], 3)
    print(json.dumps(results, indent=1))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
