#!/usr/bin/env python3
"""The calibration chain's cost per GLM-5 MoE layer, projected from measured smaller layers (issue 18, section 4).

    python3 benchmarks/capture_cost.py --device cuda:0 [--experts 8,16] [--rows 4 --cols 2048] [--json OUT.json]

One MoE decoder layer with GLM-5's expert shapes (hidden 6144, moe_intermediate 2048, top-8 routing, a shared
expert; transformers' Glm4MoeDecoderLayer, the class fq's capture supports: GLM-5's own DSA attention is not
registered yet) and random weights, through fq.hessian.capture.advance (all-experts capture, float64 sums) with
``--rows`` x ``--cols`` tokens, once per expert count in ``--experts`` (after a warm-up). The time is affine in the
experts (attention, input H: fixed; each expert's forward on every token and its down Hessian: per expert) and
linear in the tokens, so two measured expert counts give the projection for 256 experts and 250 x 2048 tokens,
printed beside fq.planning.calibration_cost's FLOP-based figure (60 TFLOP/s). Weights live on the device: 256
experts would need 38.7 GB of float32 weights, which is why the full layer is projected, not run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fq.hessian import capture, layer as layer_mod  # noqa: E402

GLM5 = dict(hidden=6144, inter=2048, top_k=8, heads=64, kv_heads=8, head_dim=128, dense_inter=12288)


def config(experts: int, s: dict) -> dict:
    return {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "attention_bias": False,
            "first_k_dense_replace": 1, "head_dim": s["head_dim"], "hidden_act": "silu", "hidden_size": s["hidden"],
            "intermediate_size": s["dense_inter"], "max_position_embeddings": 4096,
            "moe_intermediate_size": s["inter"], "n_group": 1, "n_routed_experts": experts, "n_shared_experts": 1,
            "norm_topk_prob": True, "num_attention_heads": s["heads"], "num_experts_per_tok": min(s["top_k"], experts),
            "num_hidden_layers": 2, "num_key_value_heads": s["kv_heads"], "num_nextn_predict_layers": 0,
            "rms_norm_eps": 1e-5, "rope_parameters": {"partial_rotary_factor": 0.5, "rope_theta": 10000.0,
                                                      "rope_type": "default"},
            "routed_scaling_factor": 1.0, "tie_word_embeddings": False, "topk_group": 1, "use_qk_norm": False,
            "vocab_size": 1024}


def layer_tensors(cfg: dict, seed: int) -> dict:
    """Random checkpoint tensors of layer 1 under the checkpoint's names (routed experts one tensor each)."""
    arch = layer_mod.architecture(cfg)
    cls, _ = arch.classes()
    with torch.device("meta"):
        module = cls(layer_mod.hf_config(cfg), 1)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in module.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            E, two_i, _ = t.shape
            w = torch.randn(t.shape, generator=g) * 0.02
            for e in range(E):
                out[f"mlp.experts.{e}.gate_proj.weight"] = w[e, : two_i // 2]
                out[f"mlp.experts.{e}.up_proj.weight"] = w[e, two_i // 2 :]
        elif name == "mlp.experts.down_proj":
            w = torch.randn(t.shape, generator=g) * 0.02
            for e in range(t.shape[0]):
                out[f"mlp.experts.{e}.down_proj.weight"] = w[e]
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(t.shape)
        else:
            out[name] = torch.randn(t.shape, generator=g) * 0.02 if t.is_floating_point() else torch.zeros(t.shape,
                                                                                                          dtype=t.dtype)
    return {f"model.layers.1.{k}": v for k, v in out.items()}


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", default="8,16")
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--small", action="store_true", help="demo-sized shapes (a quick CPU check of the script)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    s = dict(hidden=256, inter=128, top_k=2, heads=4, kv_heads=4, head_dim=64, dense_inter=512) if args.small else GLM5
    counts = [int(e) for e in args.experts.split(",")]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(args.rows, args.cols, s["hidden"], generator=g)
    tokens = args.rows * args.cols
    rows = []
    for i, E in enumerate([counts[0]] + counts):  # the first run warms up (CUDA, kernels, allocator)
        cfg = config(E, s)
        tensors = layer_tensors(cfg, E)
        sync(args.device)
        t = time.perf_counter()
        _, sums = capture.advance(1, hidden, tensors, cfg, device=args.device, threads=None)
        sync(args.device)
        dt = time.perf_counter() - t
        del tensors, sums
        if i:
            rows.append(dict(experts=E, seconds=round(dt, 3)))
            print(f"{E} experts, {tokens} tokens: {dt:.2f} s", flush=True)
    res = dict(device=args.device, gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
               shape=s, tokens=tokens, rows=rows)
    if len(rows) >= 2:
        (e0, t0), (e1, t1) = (rows[0]["experts"], rows[0]["seconds"]), (rows[-1]["experts"], rows[-1]["seconds"])
        per = (t1 - t0) / (e1 - e0)
        fixed = t0 - per * e0
        scale = 250 * 2048 / tokens
        proj = (fixed + per * 256) * scale
        res.update(per_expert_s=per, fixed_s=fixed, projected_glm5_layer_s=proj)
        from fq.planning.calibration_cost import DEFAULT_TFLOPS

        t_, h, i_, E = 250 * 2048, s["hidden"], s["inter"], 256
        flops = t_ * E * 6 * h * i_ + 2 * t_ * h * h + E * 2 * t_ * i_ * i_
        res["priced_glm5_layer_s"] = flops / (DEFAULT_TFLOPS * 1e12)
        print(f"per expert {per:.3f} s, fixed {fixed:.3f} s per {tokens} tokens; projected GLM-5 layer (256 experts, "
              f"250 x 2048 tokens): {proj:.0f} s = {proj / 3600:.3f} GPU-h; fq price assumes "
              f"{res['priced_glm5_layer_s']:.0f} s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
