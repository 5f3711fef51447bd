"""A chain K2 + K1 against exllamav3's native K3 on GLM-5-shaped MoE layers (issue 26, H200).

    python benchmarks/exl3_chain_glm5_speed.py WORKDIR [--layers 1] [--json OUT] [--modes ...]

Writes one-layer Glm4MoeForCausalLM directories with GLM-5's MoE shapes (hidden 6144, moe_intermediate 2048,
256 routed experts, top-8, one shared expert; attention, router, embeddings and head bf16/float32) whose routed
experts are random EXL3 tensors at K3 (the native base), K2 and K1, plus random K1 stage tensors for every expert
linear of the K2 one. Random trellis words decode to codebook values like any encoding's; the timing of a trellis
GEMM does not depend on which values they hold. Then, in one process on one GPU, the MoE block's forward (exllamav3's
BlockSparseMLP, routing and shared expert included) on 1 and 8 tokens (decode) and 2048 tokens (prefill), CUDA-event
medians:

- native-k3 / native-k2: exllamav3's own fast paths;
- per-expert-k2: the K2 base on exllamav3's per-expert path (every expert linear a chain of one);
- native-k1: a K1 base (one stage's own cost on exllamav3's fast paths);
- chain-per-expert: every expert linear a ChainLinear summing its stages' EXL3 GEMMs, the layer on exllamav3's
  per-expert path (fq.runtime.exl3's path before the grouped one; still its fallback);
- chain-grouped: fq.runtime.exl3_chain_moe (the default): one multi-expert EXL3 launch per (projection, stage) at
  decode, and at prefill per group of experts of similar row counts. Its routed sum is also compared with the
  per-expert ChainLinear sum on the same routing (decode at 1 and 8 tokens, prefill): routed_rel_diff_vs_per_expert.
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


def inputs(seed: int = 0) -> dict:
    import torch

    g = torch.Generator(device="cuda:0").manual_seed(seed)
    return {n: torch.randn(1, t, HIDDEN, generator=g, device="cuda:0").half()
            for n, t in (("decode1", 1), ("decode8", 8), ("prefill", PREFILL))}


def time_blocks(model) -> dict:
    import torch

    blocks = moe_blocks(model)
    x = inputs()

    def run(v):
        for m in blocks:
            m.forward(v, {})

    with torch.inference_mode():  # exllamav3 adds into its buffers in place, as its own model.forward does
        return {"decode_ms": round(_median_ms(lambda: run(x["decode1"]), 50), 4),
                "decode8_ms": round(_median_ms(lambda: run(x["decode8"]), 50), 4),
                "prefill_ms": round(_median_ms(lambda: run(x["prefill"]), 10), 3), "moe_layers": len(blocks)}


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


def chain_grouped(config, model, stages: dict) -> dict:
    """fq.runtime.exl3_chain_moe on every MoE block (what fq.runtime.exl3 loads by default). Returns {block key:
    {(expert, role): ChainLinear}}: the same chains for per-expert reference sums (check_routed)."""
    from fq.runtime.exl3 import ChainLinear, _stage_linear
    from fq.runtime.exl3_chain_moe import attach

    chains = {}
    for m in moe_blocks(model):
        layer = int(m.key.split(".")[2])
        base, staged = {"gate": [], "up": [], "down": []}, {}
        for role, projs, proj in (("gate", m.gates, "gate_proj"), ("up", m.ups, "up_proj"),
                                  ("down", m.downs, "down_proj")):
            for e, lin in enumerate(projs):
                base[role].append(lin.inner)
                staged[(e, role)] = [(1, _stage_linear(config, stages[(layer, e, proj)], lin.in_features,
                                                       lin.out_features, "cuda:0", f"{lin.key}.stage1"))]
        why = attach(m, base, staged)
        if why:
            raise SystemExit(f"{m.key}: grouped chain refused: {why}")
        chains[m.key] = {er: ChainLinear(base[er[1]][er[0]], [s for _, s in st]) for er, st in staged.items()}
    return chains


def _w32(chain) -> "torch.Tensor":
    """A ChainLinear's weight (in x out) in float32: the sum of its parts' reconstructions (exllamav3's own decode)."""
    w = None
    for part in chain.parts:
        t = part.get_weight_tensor().float()
        w = t if w is None else w + t
    return w


def check_routed(model, chains: dict) -> dict:
    """The grouped routed sum against the per-expert one on the same routing (max abs difference relative to the
    reference's max abs): Σ_j w_j down_e(silu(gate_e(y)) up_e(y)) with every expert linear a ChainLinear (one EXL3
    GEMM per stage, float32 sums), for the decode (1, 8 tokens) and prefill inputs. Both also against a float32
    reference (each expert's chain reconstructed, summed and applied in float32, activations never rounded to fp16):
    which of the two departs, and by how much (issue 41: the decode departure)."""
    import torch

    out = {}
    with torch.inference_mode():
        for name, v in inputs(seed=1).items():
            errs, g32, p32 = [], [], []
            for m in moe_blocks(model):
                y = v.view(-1, HIDDEN)
                sel, w = m.routing_fn(y.shape[0], m.routing_cfg, y, {})
                sel, w = sel.clone(), w.clone()
                got = m.chain_moe.routed(y, sel, w).float()
                ref = torch.zeros_like(got)
                exact = torch.zeros_like(got)
                cl = chains[m.key]
                for e in sel.unique().tolist():
                    t, j = (sel == e).nonzero(as_tuple=True)
                    x = y[t].half()
                    g = cl[(e, "gate")].forward(x, {}, torch.float)
                    u = cl[(e, "up")].forward(x, {}, torch.float)
                    a = (torch.nn.functional.silu(g) * u).half()
                    ref.index_add_(0, t, cl[(e, "down")].forward(a, {}, torch.float) * w[t, j].float()[:, None])
                    x32 = x.float()
                    a32 = torch.nn.functional.silu(x32 @ _w32(cl[(e, "gate")])) * (x32 @ _w32(cl[(e, "up")]))
                    exact.index_add_(0, t, (a32 @ _w32(cl[(e, "down")])) * w[t, j].float()[:, None])
                scale = exact.abs().max()
                errs.append(float((got - ref).abs().max() / ref.abs().max()))
                g32.append(float((got - exact).abs().max() / scale))
                p32.append(float((ref - exact).abs().max() / scale))
            out[name] = max(errs)
            out[f"{name}_grouped_vs_fp32"] = max(g32)
            out[f"{name}_per_expert_vs_fp32"] = max(p32)
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser()
    ap.add_argument("workdir", type=Path)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--modes", nargs="*", default=["native-k3", "native-k2", "native-k1", "per-expert-k2",
                                                   "chain-per-expert", "chain-grouped"])
    a = ap.parse_args(argv)
    if "native-k3" in a.modes:
        write_model(a.workdir / "k3", 3, a.layers, seed=3)
    stages = write_model(a.workdir / "k2", 2, a.layers, seed=2)
    if "native-k1" in a.modes:
        write_model(a.workdir / "k1", 1, a.layers, seed=1)
    print("models written", flush=True)
    results = {"shape": {"hidden": HIDDEN, "moe_intermediate": MOE_INTER, "experts": EXPERTS, "top_k": TOPK,
                         "prefill_tokens": PREFILL, "layers": a.layers}, "gpu": torch.cuda.get_device_name(0)}
    for mode in a.modes:
        config, model = load(a.workdir / {"native-k3": "k3", "native-k1": "k1"}.get(mode, "k2"))
        if mode == "chain-per-expert":
            chain_per_expert(config, model, stages)
        elif mode == "chain-grouped":
            chains = chain_grouped(config, model, stages)
        elif mode == "per-expert-k2":  # the per-expert path's own cost: every expert a chain of one
            from fq.runtime.exl3 import _per_expert_path

            for m in moe_blocks(model):
                _per_expert_path(m)
        elif mode not in ("native-k3", "native-k2", "native-k1"):
            raise SystemExit(f"unknown mode {mode}")
        results[mode] = time_blocks(model)
        if mode == "chain-grouped":
            results[mode]["routed_rel_diff_vs_per_expert"] = check_routed(model, chains)
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
                results[mode]["decode8_vs_k3"] = round(results[mode]["decode8_ms"] / k3["decode8_ms"], 3)
    print(json.dumps(results, indent=1))
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
