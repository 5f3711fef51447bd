"""Synthetic checkpoint *metadata* (config.json, index, shard sizes) of each naming family.

No payloads: enough to load a SourceModel, plan and price a campaign for a model nobody has
downloaded, in tests and in docs/pricing.md. Tensors are laid out in layer order and packed into
shards of a target size like the Hugging Face writer does, so shards straddle layers (and hence
windows); with ``skeleton_only_first`` the embeddings, final norm, lm_head and dense layers get a
shard of their own that holds no routed expert, as in the GLM-5.2 index the seed describes.

    python -m fq.model.source_synth glm5 OUT_DIR
    # writes OUT_DIR/{config.json, model.safetensors.index.json, sizes.json}

``write_sparse_shards`` adds the shards themselves as sparse files: real headers (each routed expert matrix at the
(out, in) the config makes, every other tensor one bf16 element) over payloads that are holes, so a directory can be
loaded (and its headers checked, as ``load_source`` checks them) without writing gigabytes.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fq.core import canonical
from fq.core.atomic import write_text
from fq.errors import FqError
from fq.model.source import INDEX_NAME

GB = 10**9


def synthetic_checkpoint(family: str, *, hidden: int, inter: int, n_experts: int, n_layers: int, first_dense: int = 0,
                         mtp_layers: int = 0, vocab: int = 32000, dense_inter: int | None = None,
                         shard_bytes: int = 5 * GB, skeleton_only_first: bool = True, model_type: str | None = None,
                         dtype: str = "bfloat16", extra_config: dict | None = None) -> tuple[dict, dict, dict[str, int]]:
    """(config, index, sizes) of a synthetic MoE checkpoint of ``family`` (deepseek | qwen3_moe | mixtral)."""
    if family not in ("deepseek", "qwen3_moe", "mixtral"):
        raise FqError(f"family: expected deepseek, qwen3_moe or mixtral, got {family!r}")
    if family != "deepseek" and (first_dense or mtp_layers):
        raise FqError(f"{family}: first_dense and mtp_layers exist only in the deepseek family")
    dense_inter = dense_inter or 4 * inter
    config = _config(family, hidden, inter, n_experts, n_layers, first_dense, mtp_layers, vocab, dense_inter, dtype)
    if model_type:  # another model type of the same naming: its architecture comes from the registry (by model_type)
        config["model_type"] = model_type
        config.pop("architectures")
    config.update(extra_config or {})

    head = [("model.embed_tokens.weight", vocab * hidden), ("model.norm.weight", hidden), ("lm_head.weight", vocab * hidden)]
    layers = [_layer_tensors(family, layer, hidden, inter, n_experts, dense_inter, layer < first_dense,
                             layer >= n_layers) for layer in range(n_layers + mtp_layers)]
    groups: list[list[tuple[str, int]]] = []
    if skeleton_only_first:
        groups.append(head + [t for layer in layers[:first_dense] for t in layer])
        groups.append([t for layer in layers[first_dense:] for t in layer])
    else:
        groups.append(head + [t for layer in layers for t in layer])

    bytes_per = 4 if dtype == "float32" else 2
    shards: list[list[tuple[str, int]]] = []
    for gi, group in enumerate(groups):
        current: list[tuple[str, int]] = []
        for name, numel in group:
            size = numel * bytes_per
            if current and sum(s for _, s in current) + size > shard_bytes:
                shards.append(current)
                current = []
            current.append((name, size))
        if current:
            shards.append(current)
    n = len(shards)
    weight_map, sizes = {}, {}
    for i, tensors in enumerate(shards, 1):
        shard = f"model-{i:05d}-of-{n:05d}.safetensors"
        for name, _ in tensors:
            weight_map[name] = shard
        # payload plus a header of ~100 bytes per tensor entry
        sizes[shard] = sum(s for _, s in tensors) + 8 + 64 + 100 * len(tensors)
    index = {"metadata": {"total_size": sum(s for t in shards for _, s in t)}, "weight_map": weight_map}
    return config, index, sizes


def glm5_like(mtp: bool = False) -> tuple[dict, dict, dict[str, int]]:
    """GLM-5-shaped: hidden 6144, moe_intermediate 2048, 256 experts, 3 dense + 75 MoE layers,
    MLA attention with a DSA indexer, one shared expert, ~5.4 GB shards, a skeleton-only first shard."""
    return synthetic_checkpoint(
        "deepseek", hidden=6144, inter=2048, n_experts=256, n_layers=78, first_dense=3, mtp_layers=int(mtp),
        vocab=154880, dense_inter=12288, shard_bytes=5_360_000_000, model_type="glm_moe_dsa",
        extra_config={"architectures": ["GlmMoeDsaForCausalLM"], "n_shared_experts": 1, "num_experts_per_tok": 8,
                      "num_attention_heads": 64, "q_lora_rank": 2048, "kv_lora_rank": 512, "qk_nope_head_dim": 192,
                      "qk_rope_head_dim": 64, "v_head_dim": 256,
                      # the DSA indexer as the published config states it (exllamav3 reads these with no default)
                      "index_n_heads": 32, "index_head_dim": 128, "index_topk": 2048},
    )


def write_synthetic(out_dir: str | Path, config: dict, index: dict, sizes: dict[str, int]) -> Path:
    """config.json, the index and sizes.json (the listing fq reads with --sizes) into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_text(out / "config.json", canonical.pretty(config))
    write_text(out / INDEX_NAME, canonical.pretty(index))
    write_text(out / "sizes.json", canonical.pretty(sizes))
    return out


def write_sparse_shards(out_dir: str | Path, config: dict, index: dict) -> dict[str, int]:
    """Every shard ``index`` names, into ``out_dir``, as a valid safetensors file whose payload is a hole (sparse:
    nothing is written but the header): routed expert matrices at the shape the config makes (a family's fused
    ``gate_up`` / ``down`` tensors at (E, ...) in its order), every other tensor one bf16 element. Returns the
    shards' sizes."""
    import math
    import struct

    from fq.model import families
    from fq.model.source import PROJECTIONS, projection_shape

    family = families.for_config(config, "config.json")
    text = family.text_view(config, "config.json")
    hidden, (inter, _) = text["hidden_size"], family.intermediate(text, "config.json")
    proj_of = dict(zip(family.layout.projections, PROJECTIONS))
    fused, pattern = family.fused_experts, family.layout.experts_pattern()

    def shape_of(name: str) -> list[int]:
        parsed = family.layout.parse(name)
        if parsed is not None:
            return list(projection_shape(hidden, inter, proj_of[parsed[2]]))
        m = pattern.fullmatch(name)
        if fused is not None and m is not None and m["rest"] in (fused.gate_up, fused.down):
            out_, in_ = (2 * inter, hidden) if m["rest"] == fused.gate_up else (hidden, inter)
            n = family.n_experts(text, "config.json")
            return [n, out_, in_] if fused.order == "out_in" else [n, in_, out_]
        return [1]

    by_shard: dict[str, list[str]] = {}
    for name, shard in sorted(index["weight_map"].items()):
        by_shard.setdefault(shard, []).append(name)
    out, sizes = Path(out_dir), {}
    for shard, names in by_shard.items():
        head: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name in names:
            shape = shape_of(name)
            n = 2 * math.prod(shape)
            head[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
            offset += n
        body = canonical.dumps(head)
        body += b" " * (-(8 + len(body)) % 8)
        with open(out / shard, "wb") as fh:
            fh.write(struct.pack("<Q", len(body)) + body)
            fh.truncate(8 + len(body) + offset)
        sizes[shard] = 8 + len(body) + offset
    return sizes


# -- tensor lists ---------------------------------------------------------------------------------


def _config(family, hidden, inter, n_experts, n_layers, first_dense, mtp_layers, vocab, dense_inter, dtype) -> dict:
    common = {"hidden_size": hidden, "num_hidden_layers": n_layers, "vocab_size": vocab, "torch_dtype": dtype}
    # what every published config states and exllamav3 reads with no default; heads as _layer_tensors sizes them
    gqa = {"num_attention_heads": max(hidden // 128, 1), "num_key_value_heads": max(hidden // 512, 1),
           "head_dim": 128, "rms_norm_eps": 1e-6}
    if family == "deepseek":
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common, "moe_intermediate_size": inter, "intermediate_size": dense_inter,
                "n_routed_experts": n_experts, "first_k_dense_replace": first_dense, "moe_layer_freq": 1,
                "num_nextn_predict_layers": mtp_layers, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "rms_norm_eps": 1e-6, "num_attention_heads": 64}
    if family == "qwen3_moe":
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common, "moe_intermediate_size": inter, "num_experts": n_experts,
                "decoder_sparse_step": 1, "mlp_only_layers": [], **gqa, "num_experts_per_tok": min(8, n_experts)}
    return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **common, "intermediate_size": inter, "num_local_experts": n_experts,
            **gqa, "num_experts_per_tok": min(2, n_experts)}


def _layer_tensors(family, layer, hidden, inter, n_experts, dense_inter, dense, mtp) -> list[tuple[str, int]]:
    p = f"model.layers.{layer}"
    t = [(f"{p}.input_layernorm.weight", hidden), (f"{p}.post_attention_layernorm.weight", hidden)]
    if family == "deepseek":
        heads, q_rank, kv_rank, nope, rope, v = 64, 2048, 512, 192, 64, 256
        t += [(f"{p}.self_attn.q_a_proj.weight", q_rank * hidden), (f"{p}.self_attn.q_a_layernorm.weight", q_rank),
              (f"{p}.self_attn.q_b_proj.weight", heads * (nope + rope) * q_rank),
              (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_rank + rope) * hidden),
              (f"{p}.self_attn.kv_a_layernorm.weight", kv_rank),
              (f"{p}.self_attn.kv_b_proj.weight", heads * (nope + v) * kv_rank),
              (f"{p}.self_attn.o_proj.weight", hidden * heads * v),
              (f"{p}.self_attn.indexer.wq_b.weight", 32 * 128 * q_rank), (f"{p}.self_attn.indexer.wk.weight", 128 * hidden),
              (f"{p}.self_attn.indexer.k_norm.weight", 128), (f"{p}.self_attn.indexer.weights_proj.weight", 32 * hidden)]
        if mtp:
            t += [(f"{p}.enorm.weight", hidden), (f"{p}.hnorm.weight", hidden), (f"{p}.eh_proj.weight", 2 * hidden * hidden),
                  (f"{p}.shared_head.norm.weight", hidden)]
    else:
        heads, kv_heads, head_dim = max(hidden // 128, 1), max(hidden // 512, 1), 128
        t += [(f"{p}.self_attn.q_proj.weight", heads * head_dim * hidden),
              (f"{p}.self_attn.k_proj.weight", kv_heads * head_dim * hidden),
              (f"{p}.self_attn.v_proj.weight", kv_heads * head_dim * hidden),
              (f"{p}.self_attn.o_proj.weight", hidden * heads * head_dim)]
        if family == "qwen3_moe":
            t += [(f"{p}.self_attn.q_norm.weight", head_dim), (f"{p}.self_attn.k_norm.weight", head_dim)]
    if dense:
        return t + [(f"{p}.mlp.{x}_proj.weight", dense_inter * hidden) for x in ("gate", "up", "down")]
    if family == "mixtral":
        t.append((f"{p}.block_sparse_moe.gate.weight", n_experts * hidden))
        for e in range(n_experts):
            t += [(f"{p}.block_sparse_moe.experts.{e}.{w}.weight", inter * hidden) for w in ("w1", "w2", "w3")]
        return t
    t.append((f"{p}.mlp.gate.weight", n_experts * hidden))
    if family == "deepseek":
        t.append((f"{p}.mlp.gate.e_score_correction_bias", n_experts))
        t += [(f"{p}.mlp.shared_experts.{x}_proj.weight", inter * hidden) for x in ("gate", "up", "down")]
    for e in range(n_experts):
        t += [(f"{p}.mlp.experts.{e}.{x}_proj.weight", inter * hidden) for x in ("gate", "up", "down")]
    return t


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fq.model.source_synth", description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=["glm5", "glm5-mtp"], help="which synthetic checkpoint to write")
    parser.add_argument("out", help="directory to write config.json, the index and sizes.json into")
    args = parser.parse_args(argv)
    write_synthetic(args.out, *glm5_like(mtp=args.shape == "glm5-mtp"))
    print(f"wrote {args.out}: config.json, {INDEX_NAME}, sizes.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
