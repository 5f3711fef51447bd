#!/usr/bin/env python3
"""The calibration chain's cost per GLM-5 MoE layer, projected from measured smaller layers (issue 18, section 4).

    python3 benchmarks/capture_cost.py --device cuda:0 [--experts 8,16] [--rows 2,4 --cols 2048] [--json OUT.json]

One MoE decoder layer with GLM-5's expert shapes (hidden 6144, moe_intermediate 2048, top-8 routing, a shared
expert; transformers' Glm4MoeDecoderLayer: GLM-5's own class, with MLA and the DSA indexer, changes the attention,
i.e. the fixed part, not the per-expert work) and random weights, through fq.hessian.capture.advance (all-experts capture, float64 sums), for
two expert counts (``--experts``) and two row counts (``--rows`` rows of ``--cols`` tokens), after a warm-up. Each
call's time is setup(E) + rows x per_row(E): the setup (building the layer from its checkpoint tensors and copying
it to the device) is paid once per layer, the rest scales with the tokens; both are affine in the experts. The
projection for 256 experts and 250 x 2048 tokens is printed beside fq.planning.calibration_cost's priced figure.
256 experts would need 38.7 GB of float32 weights, which is why the full layer is projected, not run.
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


def counted_flops(s: dict, rows: int, cols: int, experts: int = 256) -> float:
    """fq.planning.calibration_cost's count for this layer at ``experts``: its linears (GQA q/k/v/o, the shared
    expert), the causal attention core, the routed experts' forward and all-experts capture."""
    from fq.planning.calibration_cost import routed_flops

    t, h, q, kv = rows * cols, s["hidden"], s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    linears = 2 * q * h + 2 * kv * h + 3 * s["inter"] * h
    core = rows * 2 * cols * (cols + 1) / 2 * s["heads"] * 2 * s["head_dim"]
    return 2.0 * t * linears + core + routed_flops(t, experts, s["top_k"], h, s["inter"])


def sync(dev: str) -> None:
    if dev.startswith("cuda"):
        torch.cuda.synchronize(dev)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--experts", default="8,16")
    ap.add_argument("--rows", default="2,4", help="two row counts: the time per row is their difference")
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--small", action="store_true", help="demo-sized shapes (a quick CPU check of the script)")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    s = dict(hidden=256, inter=128, top_k=2, heads=4, kv_heads=4, head_dim=64, dense_inter=512) if args.small else GLM5
    counts = [int(e) for e in args.experts.split(",")]
    rows_list = [int(r) for r in args.rows.split(",")]
    if len(counts) != 2 or len(rows_list) != 2 or counts[0] == counts[1] or rows_list[0] == rows_list[1]:
        ap.error("--experts and --rows take two different values each")
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(max(rows_list), args.cols, s["hidden"], generator=g)
    rows = []
    for i, E in enumerate([counts[0]] + counts):  # the first pass warms up (CUDA, kernels, allocator)
        cfg = config(E, s)
        tensors = layer_tensors(cfg, E)
        for R in rows_list:
            sync(args.device)
            t = time.perf_counter()
            _, sums = capture.advance(1, hidden[:R], tensors, cfg, device=args.device, threads=None)
            sync(args.device)
            dt = time.perf_counter() - t
            del sums
            if i:
                rows.append(dict(experts=E, rows=R, tokens=R * args.cols, seconds=round(dt, 3)))
                print(f"{E} experts, {R} x {args.cols} tokens: {dt:.2f} s", flush=True)
        del tensors
    res = dict(device=args.device, gpu=torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
               shape=s, cols=args.cols, rows=rows)
    # t(E, R) = setup(E) + R * per_row(E), both affine in E: setup is the layer's build and its copy to the device
    # (once per layer), per_row the forward and the sums (scales with the tokens)
    t = {(r["experts"], r["rows"]): r["seconds"] for r in rows}
    (e0, e1), (r0, r1) = counts, rows_list
    per_row = {e: (t[e, r1] - t[e, r0]) / (r1 - r0) for e in counts}
    setup = {e: t[e, r0] - r0 * per_row[e] for e in counts}

    def at(f, e):
        return f[e0] + (f[e1] - f[e0]) * (e - e0) / (e1 - e0)

    full_rows = 250 * 2048 / args.cols
    proj = at(setup, 256) + full_rows * at(per_row, 256)
    res.update(per_row_s=per_row, setup_s=setup, projected_glm5_layer_s=proj,
               projected_setup_s=at(setup, 256), projected_compute_s=full_rows * at(per_row, 256))
    flops = counted_flops(s, 250, 2048)
    from fq.planning.calibration_cost import DEFAULT_TFLOPS

    res.update(flops_glm5_layer=flops, measured_tflops=flops / res["projected_compute_s"] / 1e12,
               priced_glm5_layer_s=flops / (DEFAULT_TFLOPS * 1e12))
    print(f"per row of {args.cols} tokens: {per_row}; setup: {setup}; projected GLM-5 layer (256 experts, 250 x 2048 "
          f"tokens): {proj:.0f} s = {proj / 3600:.3f} GPU-h (setup {res['projected_setup_s']:.0f} s), "
          f"{res['measured_tflops']:.1f} TFLOP/s of the count (setup apart); fq price's compute for it: "
          f"{res['priced_glm5_layer_s']:.0f} s",
          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
