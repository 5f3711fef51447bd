"""Tiny random mixture-of-experts checkpoints laid out the way their authors publish them, built offline.

Every family is transformers' own config class and modeling code (transformers 5.24), at one tiny size: vocab 512,
hidden 256, 3 decoder layers (layer 0 dense where the family has dense layers), 8 routed experts of intermediate size
128, top-2, 4 attention heads / 4 KV heads of 64 (MLA families: small LoRA ranks and head dims; GLM-5 at its published
latent and rope widths, 512 and 64; Laguna 8 heads on its sliding layers, as XS.2 has more there; MiMo-V2-Flash: 2 KV
heads, 4 on its sliding layers, Q/K 96 and V 64 wide), n_group = topk_group = 1, no next-token-prediction layers,
untied embeddings. Nothing is downloaded. Qwen3.5-MoE is also built as Qwen
publishes it, the vision-language ``Qwen3_5MoeForConditionalGeneration`` (the language model's config nested under
``text_config``, its layers under ``model.language_model.layers.*``, a one-block vision tower under ``model.visual.*``,
and the ``preprocessor_config.json`` the release ships); Qwen3-VL-MoE and GLM-4.5V the same way
(``Qwen3VLMoeForConditionalGeneration``, its experts fused as published; ``Glm4vMoeForConditionalGeneration``).

    ARCHS: architecture -> Recipe(model_type, keys, expert_count_key, expert_inter_key, dense_layers, ...)
    hf_config(arch, **keys) -> transformers config      # keys: what the config class is given (recipe, then **keys)
    config_of(arch, **keys) -> dict                     # config.json as transformers 5.24 writes it
    model_of(arch, seed=0, **keys) -> model             # seeded random init, bfloat16, eval
    model_class(arch) -> the transformers class it runs as;  text_of(arch, cfg) -> its language model's config keys
    build(arch, out_dir, *, seed=0, max_shard_size=None, legacy_keys=False, extra_config=None, keys=None) -> Path
    legacy_config(arch, cfg) -> dict                    # config.json in the pre-5.0 key style (torch_dtype, rope_theta)
    to_fp8(src_dir, out_dir, *, block=(128, 128)) -> Path   # DeepSeek-V3 / Kimi-K2 / MiniMax-M2 / Qwen3-FP8 layout
    to_mxfp4_gptoss(src_dir, out_dir) -> Path               # openai/gpt-oss-20b/120b layout
    as_kimi_k2(src_dir, out_dir) -> Path                    # a DeepseekV3 checkpoint relabelled as Kimi-K2
    to_fused_qwen3_5(src_dir, out_dir) -> Path              # Qwen3.5-MoE's published fused experts (E, 2I, hidden)
    to_published_qwen3_vl(src_dir, out_dir) -> Path         # Qwen3-VL-MoE's published fused experts (E, hidden, 2I)
    to_deepseek_v4_release(src_dir, out_dir, quantize=True) -> Path  # DeepSeek-V4's release: names, FP4/FP8 + ue8m0
    v4_release_name(name) -> str                            # transformers' saved name -> the release's
    fp8_quantize_ue8m0(w, block) / fp4_quantize_ue8m0(w)    # DeepSeek-V4's quantizers (ue8m0 power-of-two scales)
    fp8_target(name, tensor) -> bool                        # what the published FP8 layout stores in fp8
    fp8_quantize(w, block=(128, 128)) -> (q float8_e4m3fn, weight_scale_inv float32 (ceil(out/b0), ceil(in/b1)))
    fp8_dequantize(q, scale_inv, block=(128, 128)) -> float32
    mxfp4_quantize(w) -> (blocks uint8 (..., n/32, 16), scales uint8 (..., n/32))   # groups of 32 on w's last dim
    weight_map(dir) -> {tensor: shard};  load_tensors(dir) -> {tensor: tensor}

``build`` is seeded (``torch.manual_seed``, then transformers' own ``_init_weights`` run directly in bfloat16:
normal(0, 0.02) linears and embeddings, ones for norms, zeros for biases; expert biases, and the buffers a recipe
names (MiniMax-M2's router score bias), get seeded noise N(0, 0.05) instead of zeros, so a runtime that skips them is
caught), so two builds are byte-identical and a
``from_pretrained`` of the result gives exactly ``model_of``'s logits. It saves with ``save_pretrained(max_shard_size=
...)``, a size that gives 11-16 shards, in the checkpoint's original (published) tensor names: transformers reverts
its fused-expert conversion on save (gpt-oss is natively fused; a recipe's ``published_names`` put back what it
reverts otherwise: Kimi-Linear's dense ``mlp.``). Every tensor is bfloat16 except the routers
transformers keeps in float32 (``_keep_in_fp32_modules_strict``: ``mlp.gate.weight`` and ``e_score_correction_bias``
of the DeepSeek-style families and Ernie; AFMoE's ``mlp.expert_bias``; Hy3's, saved as ``mlp.router.gate.weight`` and
``mlp.expert_bias``).
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fq.model.synth_weights import fp8_blocks

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
CONFIG = "config.json"
DTYPE = "bfloat16"
TARGET_SHARDS = 12
# one K3 base of every routed expert, the one product: the recipe the per-family tests plan and publish
ONE_BASE_RECIPE = {"format": "fq-cartridge/2", "name": "one",
                   "nodes": [{"name": "k3", "kind": "base", "K": 3, "codebook": "mul1"}],
                   "products": [{"name": "k3", "chain": ["k3"]}]}

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, EXPERT_INTER, DENSE_INTER = 512, 256, 3, 8, 2, 128, 512
HEADS, KV_HEADS, HEAD_DIM = 4, 4, 64

# every family
_COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
               num_key_value_heads=KV_HEADS, tie_word_embeddings=False, initializer_range=0.02)
# DeepSeek-style routing (n_routed_experts, shared experts, grouped top-k)
_DEEPSEEK_MOE = dict(moe_intermediate_size=EXPERT_INTER, n_routed_experts=EXPERTS, n_shared_experts=1,
                     num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True)
# multi-head latent attention, small
_MLA = dict(kv_lora_rank=64, q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=64)
# Qwen3-Next / Qwen3.5 gated delta-net layers, small
_LINEAR_ATTN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=32, linear_value_head_dim=32,
                    linear_num_key_heads=2, linear_num_value_heads=4,
                    layer_types=["linear_attention", "linear_attention", "full_attention"])


@dataclass(frozen=True)
class Recipe:
    """One family's tiny config: transformers' ``model_type`` and the keys its config class is given."""

    model_type: str
    keys: dict = field(default_factory=dict)  # passed to the config class; every one is a key the class defines
    expert_count_key: str = ""  # the key config.json carries the routed-expert count under (as transformers saves)
    expert_inter_key: str = "moe_intermediate_size"
    dense_layers: tuple[int, ...] = ()  # layers with a dense MLP instead of routed experts
    # legacy_keys=True: config.json keys transformers 5 writes under another name than the published config
    renames: dict = field(default_factory=dict)
    rotary_dim: bool = False  # legacy_keys=True: partial RoPE as ``rotary_dim`` (MiniMax-M2), not partial_rotary_factor
    text_config: str | None = None  # a vision-language wrapper: the key its config nests the language model's under
    # buffers or parameters (name suffixes) that start at zero and get seeded noise, so a runtime that skips them is
    # caught (and a router transformers initializes to zero routes tokens apart)
    noisy_buffers: tuple[str, ...] = ()
    # (regex, replacement) of tensor names save_pretrained writes otherwise than the authors publish them, applied
    # after it (Kimi-Linear: transformers reverts its block_sparse_moe -> mlp rename on dense layers too)
    published_names: tuple[tuple[str, str], ...] = ()


ARCHS: dict[str, Recipe] = {
    "Glm4MoeForCausalLM": Recipe("glm4_moe", dict(
        _COMMON, **_DEEPSEEK_MOE, intermediate_size=DENSE_INTER, first_k_dense_replace=1,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0, rms_norm_eps=1e-5, partial_rotary_factor=0.5,
        use_qk_norm=False), "n_routed_experts", dense_layers=(0,)),
    "GlmMoeDsaForCausalLM": Recipe("glm_moe_dsa", dict(
        # GLM-5's published latent and rope widths (512, 64): at the other MLA families' latent of 64, exllamav3 1.6.5
        # gives NaN on the unquantized transformers checkpoint itself (docs/benchmarks.md)
        _COMMON, **_DEEPSEEK_MOE, **dict(_MLA, kv_lora_rank=512, qk_rope_head_dim=64), intermediate_size=DENSE_INTER,
        first_k_dense_replace=1, mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=2.5,
        rms_norm_eps=1e-5, index_topk=8, index_head_dim=64, index_n_heads=4), "n_routed_experts", dense_layers=(0,)),
    "Glm4MoeLiteForCausalLM": Recipe("glm4_moe_lite", dict(
        _COMMON, **_DEEPSEEK_MOE, **_MLA, intermediate_size=DENSE_INTER,
        mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.8, rms_norm_eps=1e-5),
        "n_routed_experts", dense_layers=(0,)),
    "DeepseekV3ForCausalLM": Recipe("deepseek_v3", dict(
        _COMMON, **_DEEPSEEK_MOE, **_MLA, intermediate_size=DENSE_INTER, first_k_dense_replace=1,
        routed_scaling_factor=2.5, num_nextn_predict_layers=0, rms_norm_eps=1e-6), "n_routed_experts",
        dense_layers=(0,)),
    "DeepseekV2ForCausalLM": Recipe("deepseek_v2", dict(
        _COMMON, **dict(_DEEPSEEK_MOE, norm_topk_prob=False), **dict(_MLA, q_lora_rank=None),
        intermediate_size=DENSE_INTER, first_k_dense_replace=1, routed_scaling_factor=1.0, topk_method="greedy",
        rms_norm_eps=1e-6), "n_routed_experts", dense_layers=(0,)),
    "Qwen3MoeForCausalLM": Recipe("qwen3_moe", dict(
        _COMMON, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rms_norm_eps=1e-6), "num_local_experts", renames={"num_local_experts": "num_experts"}),
    "Qwen3NextForCausalLM": Recipe("qwen3_next", dict(
        _COMMON, **_LINEAR_ATTN, head_dim=HEAD_DIM, intermediate_size=DENSE_INTER,
        moe_intermediate_size=EXPERT_INTER, shared_expert_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        rms_norm_eps=1e-6), "num_experts"),
    "Qwen3_5MoeForCausalLM": Recipe("qwen3_5_moe_text", dict(
        _COMMON, **_LINEAR_ATTN, head_dim=HEAD_DIM, moe_intermediate_size=EXPERT_INTER,
        shared_expert_intermediate_size=EXPERT_INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        rms_norm_eps=1e-6), "num_experts"),
    "MixtralForCausalLM": Recipe("mixtral", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, rms_norm_eps=1e-5), "num_local_experts", "intermediate_size"),
    "MiniMaxM2ForCausalLM": Recipe("minimax_m2", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, rotary_dim=HEAD_DIM // 2, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2),
        "num_local_experts", "intermediate_size", rotary_dim=True,
        # the router's score bias (exllamav3 reads it under another name: a base derives it there)
        noisy_buffers=("e_score_correction_bias",)),
    # the sparsemixer router, LayerNorms and attention with biases (no exllamav3 class)
    "PhimoeForCausalLM": Recipe("phimoe", dict(
        _COMMON, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, attention_bias=True, rms_norm_eps=1e-5), "num_local_experts", "intermediate_size"),
    # MiniMax-Text-01: lightning attention (layers 0, 2) and softmax attention (layer 1) (no exllamav3 class)
    "MiniMaxForCausalLM": Recipe("minimax", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, block_size=16, rms_norm_eps=1e-5,
        layer_types=["linear_attention", "full_attention", "linear_attention"]), "num_local_experts",
        "intermediate_size"),
    "GptOssForCausalLM": Recipe("gpt_oss", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=EXPERT_INTER, num_local_experts=EXPERTS,
        num_experts_per_tok=TOP_K, rms_norm_eps=1e-5), "num_local_experts", "intermediate_size"),
    "Dots1ForCausalLM": Recipe("dots1", dict(
        _COMMON, **dict(_DEEPSEEK_MOE, norm_topk_prob=True), intermediate_size=DENSE_INTER, first_k_dense_replace=1,
        routed_scaling_factor=2.5, rms_norm_eps=1e-5), "n_routed_experts", dense_layers=(0,)),
    "Ernie4_5_MoeForCausalLM": Recipe("ernie4_5_moe", dict(
        _COMMON, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER, moe_num_experts=EXPERTS,
        moe_k=TOP_K, moe_num_shared_experts=1, moe_layer_start_index=1, moe_layer_interval=1, use_bias=False,
        rms_norm_eps=1e-5), "moe_num_experts", dense_layers=(0,)),
    "SolarOpenForCausalLM": Recipe("solar_open", dict(
        _COMMON, head_dim=HEAD_DIM, moe_intermediate_size=EXPERT_INTER, n_routed_experts=EXPERTS, n_shared_experts=1,
        num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
        rms_norm_eps=1e-5), "n_routed_experts"),
    # as Qwen publishes Qwen3.5-MoE: the vision-language wrapper (the language model's layers under
    # model.language_model.layers.*, a one-block vision tower under model.visual.*), the text config nested
    "Qwen3_5MoeForConditionalGeneration": Recipe("qwen3_5_moe", dict(
        text_config=dict(_COMMON, **_LINEAR_ATTN, head_dim=HEAD_DIM, moe_intermediate_size=EXPERT_INTER,
                         shared_expert_intermediate_size=EXPERT_INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
                         rms_norm_eps=1e-6),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64),
        tie_word_embeddings=False), "num_experts", text_config="text_config"),
    # Trinity (AFMoE): sliding (RoPE) and full (no RoPE) attention with an output gate, four norms per layer, muP
    # embedding scale, a sigmoid router whose weight transformers initializes to zero (seeded noise here, as the
    # score bias)
    "AfmoeForCausalLM": Recipe("afmoe", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1, num_dense_layers=1, route_scale=2.826,
        global_attn_every_n_layers=2, mup_enabled=True, rms_norm_eps=1e-5), "num_experts", dense_layers=(0,),
        noisy_buffers=("expert_bias", "router.gate.weight")),
    # Laguna XS.2's pattern at tiny size: layer 0 full attention with fewer heads, the rest sliding, the score bias
    # under the experts prefix
    "LagunaForCausalLM": Recipe("laguna", dict(
        _COMMON, head_dim=HEAD_DIM, num_attention_heads_per_layer=[HEADS, 2 * HEADS, 2 * HEADS],
        layer_types=["full_attention", "sliding_attention", "sliding_attention"], intermediate_size=DENSE_INTER,
        moe_intermediate_size=EXPERT_INTER, shared_expert_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, mlp_layer_types=["dense", "sparse", "sparse"], moe_routed_scaling_factor=2.5,
        gating="per-head", rms_norm_eps=1e-6), "num_experts", dense_layers=(0,),
        noisy_buffers=("e_score_correction_bias",)),
    # Hy3: layer 0 dense, the router, its score bias and the shared expert under their published names
    "HYV3ForCausalLM": Recipe("hy_v3", dict(
        _COMMON, head_dim=HEAD_DIM, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER,
        num_experts=EXPERTS, num_experts_per_tok=TOP_K, num_shared_experts=1,
        mlp_layer_types=["dense", "sparse", "sparse"], router_scaling_factor=2.826, rms_norm_eps=1e-5), "num_experts",
        dense_layers=(0,), noisy_buffers=("e_score_correction_bias",)),
    # KDA (layers 0, 2) and NoPE MLA (layer 1) as Moonshot's linear_attn_config states them (1-indexed), the keys in
    # Moonshot's spelling (transformers saves them so); q_lora_rank None as published (q_proj)
    "KimiLinearForCausalLM": Recipe("kimi_linear", dict(
        _COMMON, **dict(_MLA, q_lora_rank=None), intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER,
        num_experts=EXPERTS, num_experts_per_token=TOP_K, num_shared_experts=1, num_expert_group=1, topk_group=1,
        moe_renormalize=True, moe_router_activation_func="sigmoid", routed_scaling_factor=2.446,
        first_k_dense_replace=1, moe_layer_freq=1, mla_use_nope=True, num_nextn_predict_layers=0, rms_norm_eps=1e-5,
        linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2], num_heads=4, head_dim=32,
                                short_conv_kernel_size=4),
        pad_token_id=None, bos_token_id=1, eos_token_id=2), "num_experts", dense_layers=(0,),
        noisy_buffers=("e_score_correction_bias",),
        published_names=((r"model\.layers\.(\d+)\.block_sparse_moe\.(gate_proj|up_proj|down_proj)\.weight",
                          r"model.layers.\1.mlp.\2.weight"),)),
    # read as DeepSeek publishes it (to_deepseek_v4_release: FP4 / FP8 with ue8m0 scales, under DeepSeek's own names;
    # the layout save_pretrained writes is refused): one hash-routed layer, then sliding, compressed-sparse and
    # heavily-compressed attention, 2 streams; the hash table and the score bias seeded (zero at init)
    "DeepseekV4ForCausalLM": Recipe("deepseek_v4", dict(
        _COMMON, num_key_value_heads=1, head_dim=HEAD_DIM, partial_rotary_factor=0.5, q_lora_rank=128,
        moe_intermediate_size=EXPERT_INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_shared_experts=1,
        routed_scaling_factor=1.5, o_groups=2, o_lora_rank=64, index_n_heads=2, index_head_dim=32, index_topk=4,
        sliding_window=16, hc_mult=2, num_nextn_predict_layers=0, rms_norm_eps=1e-6,
        mlp_layer_types=["hash_moe", "moe", "moe"],
        layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]),
        "n_routed_experts", noisy_buffers=("e_score_correction_bias", "tid2eid")),
    # as Qwen publishes Qwen3-VL-MoE: Qwen3-MoE's language model in the vision-language wrapper, its experts fused
    # (E, hidden, 2I) / (E, I, hidden) as transformers saves them too; a one-block vision tower with one deepstack
    # merger (the releases: 27 blocks, deepstack at 8, 16, 24); interleaved multimodal rotary sections of the kit's
    # head_dim / 2 (the releases: [24, 20, 20] of 64) at the releases' rope_theta
    "Qwen3VLMoeForConditionalGeneration": Recipe("qwen3_vl_moe", dict(
        text_config=dict(_COMMON, head_dim=HEAD_DIM, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER,
                         num_experts=EXPERTS, num_experts_per_tok=TOP_K, decoder_sparse_step=1, mlp_only_layers=[],
                         rms_norm_eps=1e-6, rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                                                 mrope_section=[12, 10, 10], mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        tie_word_embeddings=False), "num_local_experts", text_config="text_config"),
    # as Z.ai publishes GLM-4.5V: GLM-4.5-Air's language model (layer 0 dense, sigmoid routing with a score bias, a
    # shared expert, qkv biases, partial multimodal rotary: sections of head_dim / 4, the releases' [8, 12, 12] of 32)
    # in the vision-language wrapper, one matrix per expert; a one-block vision tower
    "Glm4vMoeForConditionalGeneration": Recipe("glm4v_moe", dict(
        text_config=dict(_COMMON, **_DEEPSEEK_MOE, head_dim=HEAD_DIM, intermediate_size=DENSE_INTER,
                         first_k_dense_replace=1, routed_scaling_factor=1.0, rms_norm_eps=1e-5,
                         rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                              mrope_section=[4, 6, 6])),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=56),
        tie_word_embeddings=False), "n_routed_experts", dense_layers=(0,), text_config="text_config",
        noisy_buffers=("e_score_correction_bias",)),
    "Qwen2MoeForCausalLM": Recipe("qwen2_moe", dict(
        _COMMON, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER,
        shared_expert_intermediate_size=EXPERT_INTER, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=False, rms_norm_eps=1e-6), "num_experts"),
    # full attention (layer 0) and sliding attention with sinks and twice the KV heads (layers 1, 2: layer_types'
    # default), Q/K heads wider than V; layer 0 dense (mlp_layer_types' default); sigmoid routing with a score bias
    "MiMoV2FlashForCausalLM": Recipe("mimo_v2_flash", dict(
        _COMMON, num_key_value_heads=2, head_dim=96, v_head_dim=64, intermediate_size=DENSE_INTER,
        moe_intermediate_size=EXPERT_INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1,
        topk_group=1, norm_topk_prob=True, rms_norm_eps=1e-5), "n_routed_experts", dense_layers=(0,),
        noisy_buffers=("e_score_correction_bias",)),
    # short-convolution layers 0, 2 and an attention layer 1; layer 0 dense (num_dense_layers); the router's score
    # bias feed_forward.expert_bias
    "Lfm2MoeForCausalLM": Recipe("lfm2_moe", dict(
        _COMMON, intermediate_size=DENSE_INTER, moe_intermediate_size=EXPERT_INTER, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, num_dense_layers=1, norm_topk_prob=True, use_expert_bias=True, norm_eps=1e-5,
        layer_types=["conv", "full_attention", "conv"]), "num_experts", dense_layers=(0,),
        noisy_buffers=("expert_bias",)),
}


def hf_config(arch: str, **keys):
    """The transformers config of ``arch``'s recipe, ``keys`` over it (architectures and dtype set)."""
    import transformers

    r = ARCHS[arch]
    cfg = transformers.AutoConfig.for_model(r.model_type, **{**r.keys, **keys})
    cfg.architectures = [arch]
    cfg.dtype = torch.bfloat16
    for key in getattr(cfg, "sub_configs", {}):  # a vision-language wrapper's text and vision configs, as saved
        if getattr(cfg, key, None) is not None:
            getattr(cfg, key).dtype = torch.bfloat16
    return cfg


def config_of(arch: str, **keys) -> dict:
    """config.json of ``arch``'s tiny model as transformers writes it."""
    return json.loads(hf_config(arch, **keys).to_json_string())


def model_class(arch: str):
    """The transformers class a checkpoint of ``arch`` is run with (the auto class transformers would pick: a causal
    LM, or a vision-language wrapper's own class, which runs text-only input_ids too)."""
    import transformers

    return getattr(transformers, arch) if ARCHS[arch].text_config else transformers.AutoModelForCausalLM


def text_of(arch: str, cfg: dict) -> dict:
    """The language model's part of config.json ``cfg`` (a vision-language wrapper nests it)."""
    key = ARCHS[arch].text_config
    return cfg[key] if key else cfg


def model_of(arch: str, seed: int = 0, **keys):
    """The tiny model, seeded random init, bfloat16, eval mode."""
    cfg = hf_config(arch, **keys)
    torch.manual_seed(seed)
    cls = model_class(arch)
    make = cls.from_config if hasattr(cls, "from_config") else cls._from_config
    model = make(cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # expert biases start at zero: seeded noise, so a runtime that skips them is caught
        for name, param in model.named_parameters():
            if ".experts." in name and name.endswith("bias") and not param.any():
                param.normal_(0.0, 0.05)
        for name, buf in list(model.named_buffers()) + list(model.named_parameters()):
            if name.endswith(ARCHS[arch].noisy_buffers) and not buf.any():
                if buf.is_floating_point():
                    buf.normal_(0.0, 0.05)
                else:  # a token -> experts table (DeepSeek-V4's tid2eid, zero at init: every token to expert 0):
                    # distinct experts per token
                    n = getattr(cfg, "num_local_experts", None) or EXPERTS
                    buf.copy_(torch.rand(buf.shape[0], n).argsort(-1)[:, : buf.shape[1]])
    return model


def _shard_size(model) -> int:
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    return max(1, math.ceil(total / TARGET_SHARDS))


def legacy_config(arch: str, cfg: dict) -> dict:
    """``cfg`` (config.json as transformers 5 writes it) in the pre-5.0 key style most published checkpoints carry:
    ``torch_dtype``; top-level ``rope_theta`` / ``partial_rotary_factor`` (MiniMax-M2: ``rotary_dim``) and, for a
    non-default RoPE, ``rope_scaling``; the recipe's renames (Qwen3-MoE: ``num_experts``). transformers reads both."""
    r = ARCHS[arch]
    cfg = dict(cfg)
    if "dtype" in cfg:
        cfg["torch_dtype"] = cfg.pop("dtype")
    rope = dict(cfg.pop("rope_parameters", None) or {})
    if "rope_theta" in rope:
        cfg["rope_theta"] = rope.pop("rope_theta")
    if "partial_rotary_factor" in rope:
        factor = rope.pop("partial_rotary_factor")
        if r.rotary_dim:
            cfg["rotary_dim"] = int(round(factor * cfg["head_dim"]))
        else:
            cfg["partial_rotary_factor"] = factor
    if rope.get("rope_type", "default") != "default":
        cfg["rope_scaling"] = rope
    for old, new in r.renames.items():
        if old in cfg:
            cfg[new] = cfg.pop(old)
    return cfg


def build(arch: str, out_dir, *, seed: int = 0, max_shard_size: int | str | None = None, legacy_keys: bool = False,
          extra_config: dict | None = None, keys: dict | None = None) -> Path:
    """Save ``arch``'s tiny model (seeded) to ``out_dir`` as bfloat16 safetensors shards; returns ``out_dir``.

    ``max_shard_size`` defaults to 1/12 of the weights (11-16 shards); ``legacy_keys`` writes config.json in the
    published pre-5.0 key style (``legacy_config``); ``extra_config`` keys are merged into config.json last (keys a
    published config carries that transformers' class does not define, e.g. GLM-4.7-Flash's first_k_dense_replace);
    ``keys`` go to the config class over the recipe's (e.g. ``{"mlp_only_layers": [0]}``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model_of(arch, seed, **(keys or {}))
    model.save_pretrained(out, max_shard_size=max_shard_size or _shard_size(model))
    _rename_tensors(out, ARCHS[arch].published_names)
    cfg = json.loads((out / CONFIG).read_text())
    cfg.setdefault("dtype", DTYPE)
    if legacy_keys:
        cfg = legacy_config(arch, cfg)
    if extra_config:
        cfg = _merged(cfg, extra_config)
    _write_json(out / CONFIG, cfg)
    if ARCHS[arch].text_config:  # a vision-language checkpoint ships its image processor's config
        _write_json(out / PREPROCESSOR, PREPROCESSORS.get(arch, QWEN3_VL_PREPROCESSOR))
    return out


def _rename_tensors(d: Path, renames) -> None:
    """The tensors of the checkpoint in ``d`` renamed by ``renames`` ((regex, replacement), the first that matches the
    whole name), in place: their shards rewritten, the index too."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    wmap = weight_map(d)
    new = {n: next((re.sub(p, r, n) for p, r in renames if re.fullmatch(p, n)), n) for n in wmap}
    for shard in sorted({wmap[n] for n in wmap if new[n] != n}):
        with safe_open(d / shard, "pt") as f:
            meta, tensors = f.metadata(), {new[k]: f.get_tensor(k) for k in f.keys()}
        save_file(tensors, d / shard, metadata=meta or {"format": "pt"})
    if any(new[n] != n for n in wmap):
        index = json.loads((d / INDEX).read_text())
        index["weight_map"] = dict(sorted((new[n], s) for n, s in wmap.items()))
        _write_json(d / INDEX, index)


def _merged(cfg: dict, extra: dict) -> dict:
    """``extra`` over ``cfg``; an object in both is merged key by key (a nested text_config / vision_config)."""
    out = dict(cfg)
    for k, v in extra.items():
        out[k] = _merged(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


PREPROCESSOR = "preprocessor_config.json"
# what Qwen3.5's releases ship (Qwen2VLImageProcessorFast, as exllamav3's Qwen3.5 VL class requires), written as
# JSON: transformers' fast image processors need torchvision, which the kit does not
QWEN3_VL_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessorFast", "processor_class": "Qwen3VLProcessor",
                         "size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                         "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                         "image_std": [0.5, 0.5, 0.5]}
# GLM-4.5V's: transformers' Glm4vImageProcessor defaults (exllamav3's GLM-4V classes read these keys, the type asserted)
GLM4V_PREPROCESSOR = {"image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor",
                      "size": {"shortest_edge": 112 * 112, "longest_edge": 28 * 28 * 15000}, "patch_size": 14,
                      "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                      "image_std": [0.26862954, 0.26130258, 0.27577711]}
PREPROCESSORS = {"Glm4vMoeForConditionalGeneration": GLM4V_PREPROCESSOR}


# --- checkpoint reading / writing ---------------------------------------------------------------------------------

def _write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def weight_map(src_dir) -> dict[str, str]:
    """tensor name -> shard file of a checkpoint directory (sharded or single-file)."""
    src = Path(src_dir)
    if (src / INDEX).exists():
        return dict(json.loads((src / INDEX).read_text())["weight_map"])
    from safetensors import safe_open

    with safe_open(src / SINGLE, "pt") as f:
        return {k: SINGLE for k in f.keys()}


def load_tensors(src_dir) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory."""
    from safetensors.torch import load_file

    src = Path(src_dir)
    out = {}
    for shard in sorted(set(weight_map(src).values())):
        out.update(load_file(src / shard))
    return out


def _rewrite(src_dir, out_dir, convert, config_update) -> Path:
    """Each shard of ``src_dir`` through ``convert(name, tensor) -> {name: tensor}`` into the same shard file name of
    ``out_dir``; index and config.json rewritten, every other file copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wmap = weight_map(src)
    new_map, total = {}, 0
    for shard in sorted(set(wmap.values())):
        with safe_open(src / shard, "pt") as f:
            meta = f.metadata()
            tensors = {}
            for name in sorted(f.keys()):
                tensors.update(convert(name, f.get_tensor(name)))
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, out / shard, metadata=meta or {"format": "pt"})
        for k, v in tensors.items():
            new_map[k] = shard
            total += v.numel() * v.element_size()
    if (src / INDEX).exists():
        index = json.loads((src / INDEX).read_text())
        index["weight_map"] = dict(sorted(new_map.items()))
        index.setdefault("metadata", {})["total_size"] = total
        _write_json(out / INDEX, index)
    cfg = json.loads((src / CONFIG).read_text())
    config_update(cfg)
    _write_json(out / CONFIG, cfg)
    for p in sorted(src.iterdir()):
        if p.name in (INDEX, CONFIG) or p.name.endswith(".safetensors"):
            continue
        if p.is_file():
            shutil.copyfile(p, out / p.name)
    return out


# --- FP8 (DeepSeek-V3 block scaling) ------------------------------------------------------------------------------

_FP8_SKIP = ("embed_tokens", "lm_head", "norm", "e_score_correction_bias")
_FP8_ROUTERS = (".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight")


def fp8_target(name: str, t: torch.Tensor) -> bool:
    """Whether the published FP8 layout stores ``name`` in fp8: a 2-D linear weight inside the decoder layers, not
    the router (``mlp.gate.weight``), norms, embeddings or lm_head."""
    if t.ndim != 2 or not name.endswith(".weight") or ".layers." not in name:
        return False
    if any(s in name for s in _FP8_SKIP) or ".router." in name or name.endswith(_FP8_ROUTERS):
        return False
    return True


def fp8_quantize(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's block quantizer: per (b0, b1) block s = amax|w| / 448 (zero blocks: 1), q = (w / s) in e4m3;
    returns (q, s float32 of shape (ceil(out/b0), ceil(in/b1))) — ``weight_scale_inv`` is s (w ~ q * s). The
    rehearsal source's writer (fq.model.synth_weights.fp8_blocks) is the same quantizer."""
    return fp8_blocks(w, block)


def fp8_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block=(128, 128)) -> torch.Tensor:
    b0, b1 = block
    s = scale_inv.repeat_interleave(b0, 0).repeat_interleave(b1, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def to_fp8(src_dir, out_dir, *, block=(128, 128)) -> Path:
    """A bf16 checkpoint in the published DeepSeek-V3 FP8 layout: each fp8 target (``fp8_target``) becomes
    float8_e4m3fn beside a float32 ``NAME_scale_inv`` (``...weight_scale_inv``) in the same shard; config.json gains
    the block-fp8 ``quantization_config``."""
    block = (int(block[0]), int(block[1]))

    def convert(name, t):
        if not fp8_target(name, t):
            return {name: t}
        q, s = fp8_quantize(t, block)
        return {name: q, name + "_scale_inv": s}

    def update(cfg):
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": list(block)}
        cfg.setdefault("dtype", DTYPE)

    return _rewrite(src_dir, out_dir, convert, update)


def with_outlier_channels(src_dir, out_dir, *, spread: float = 2.0, seed: int = 3) -> Path:
    """``src_dir`` with every decoder layer's pre-MLP norm (``post_attention_layernorm``) scaling its channels by a
    seeded log-uniform profile, exp(U(-spread, spread)): the routed experts' inputs then have the unequal channel
    magnitudes of a trained model (a random model's are all alike, so an input Hessian is near a multiple of the
    identity and LDLQ has nothing to weigh). A norm stored zero-centred (Qwen3-Next, Qwen3.5: it scales by 1 + w, and
    the kit's are all zero) gets profile - 1."""
    def convert(name, t):
        if not name.endswith("post_attention_layernorm.weight"):
            return {name: t}
        w = t.float()
        profile = torch.exp((torch.rand(w.shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1) * spread)
        return {name: ((profile - 1) if not w.any() else w * profile).to(t.dtype)}

    return _rewrite(src_dir, out_dir, convert, lambda cfg: None)


# --- MXFP4 (gpt-oss) ----------------------------------------------------------------------------------------------

# e2m1 magnitudes of codes 0..7 (bit 3 is the sign), as transformers' FP4_VALUES
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MX_GROUP = 32


def mxfp4_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP MX fp4: ``w`` (..., n) in groups of 32 along n, each an e8m0 scale 2^(byte-127) and 32 e2m1 codes, two per
    byte, low nibble first. Returns (blocks uint8 (..., n/32, 16), scales uint8 (..., n/32)). The scale is the
    smallest power of two that puts the group's amax within e2m1's 6.0, codes round to nearest."""
    *lead, n = w.shape
    assert n % MX_GROUP == 0, f"last dim {n} not a multiple of {MX_GROUP}"
    x = w.float().reshape(*lead, n // MX_GROUP, MX_GROUP)
    amax = x.abs().amax(dim=-1, keepdim=True)
    mant, e = torch.frexp(amax / 6.0)  # amax/6 = mant * 2^e, mant in [0.5, 1): ceil(log2) exactly
    exp = torch.where(mant == 0.5, e - 1, e).float()
    exp = torch.where(amax > 0, exp, torch.full_like(exp, -127.0)).clamp(-127, 127)
    y = x / torch.exp2(exp)
    mags = torch.tensor(E2M1)
    idx = (y.abs().unsqueeze(-1) - mags).abs().argmin(dim=-1)  # ties: the lower code (round half down)
    codes = (idx | ((y < 0) & (idx > 0)).long() << 3).to(torch.uint8)
    codes = codes.reshape(*lead, n // MX_GROUP, MX_GROUP // 2, 2)
    blocks = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return blocks.contiguous(), scales.contiguous()


GPTOSS_NOT_CONVERT = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def to_mxfp4_gptoss(src_dir, out_dir) -> Path:
    """A bf16 gpt-oss checkpoint (transformers' layout: ``mlp.experts.gate_up_proj`` (E, hidden, 2I), gate/up
    interleaved on the last dim; ``down_proj`` (E, I, hidden)) in openai/gpt-oss' published MXFP4 layout:
    ``gate_up_proj_blocks`` (E, 2I, hidden/32, 16) / ``_scales`` (E, 2I, hidden/32), ``down_proj_blocks``
    (E, hidden, I/32, 16) / ``_scales`` (E, hidden, I/32), i.e. (out, in) with groups of 32 inputs; biases kept."""

    def convert(name, t):
        if name.endswith(".mlp.experts.gate_up_proj") or name.endswith(".mlp.experts.down_proj"):
            blocks, scales = mxfp4_quantize(t.transpose(1, 2))  # (E, out, in)
            return {name + "_blocks": blocks, name + "_scales": scales}
        return {name: t}

    def update(cfg):
        cfg["quantization_config"] = {"modules_to_not_convert": list(GPTOSS_NOT_CONVERT), "quant_method": "mxfp4"}

    return _rewrite(src_dir, out_dir, convert, update)


# --- Kimi-K2 ------------------------------------------------------------------------------------------------------

KIMI_AUTO_MAP = {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"}


def as_kimi_k2(src_dir, out_dir) -> Path:
    """A DeepseekV3ForCausalLM checkpoint (bf16 or ``to_fp8``'s) relabelled as moonshotai/Kimi-K2 publishes it:
    config.json ``model_type`` "kimi_k2" and an ``auto_map`` to its remote code; every other file copied as is."""
    src, out = Path(src_dir), Path(out_dir)
    cfg = json.loads((src / CONFIG).read_text())
    if cfg.get("architectures") != ["DeepseekV3ForCausalLM"]:
        raise ValueError(f"as_kimi_k2: expected a DeepseekV3ForCausalLM checkpoint, got {cfg.get('architectures')}")
    out.mkdir(parents=True, exist_ok=True)
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name != CONFIG:
            shutil.copyfile(p, out / p.name)
    cfg["model_type"] = "kimi_k2"
    cfg["auto_map"] = dict(KIMI_AUTO_MAP)
    _write_json(out / CONFIG, cfg)
    return out


# --- DeepSeek-V4 as DeepSeek publishes it (native names, FP4 routed experts, FP8 linears, ue8m0 scales) ---------

# what DeepSeek's inference model.py builds as an FP8 Linear (its default dtype under "dtype": "fp8"): attention's
# wq_a, wq_b, wkv, wo_a (FP8 in the checkpoint, dequantized by its convert.py), wo_b, the indexer's wq_b, the shared
# expert; the router, the indexer's weights_proj and the compressors' wkv / wgate are bf16, the embeddings and head too
V4_FP8 = re.compile(r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]"
                    r"|e_proj|h_proj)\.weight")
V4_FP4 = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
V4_QUANTIZATION = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                   "weight_block_size": [128, 128]}
# transformers 5.24's names for the release's top-level tensors (its conversion mapping for deepseek_v4, reversed)
_V4_TOP = {"embed_tokens.weight": "embed.weight", "hc_head.hc_fn": "hc_head_fn", "hc_head.hc_base": "hc_head_base",
           "hc_head.hc_scale": "hc_head_scale"}


def v4_release_name(name: str) -> str:
    """A tensor name as transformers 5.24 saves DeepSeek-V4 (``model.layers.0.attn.norm.weight``) as the release
    names it (``layers.0.attn.kv_norm.weight``: DeepSeek's Attention.kv_norm, which exllamav3 reads)."""
    name = name.removeprefix("model.")
    name = _V4_TOP.get(name, name)
    return re.sub(r"^(layers\.\d+\.attn)\.norm\.weight$", r"\1.kv_norm.weight", name)


def _pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2 x), exactly (frexp: x = m * 2^e, m in [0.5, 1))."""
    m, e = torch.frexp(x)
    return torch.ldexp(torch.ones_like(x), torch.where(m == 0.5, e - 1, e))


def fp8_quantize_ue8m0(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's FP8 weight quantization (its kernels' act_quant with scale_fmt ue8m0, per b0 x b1 block of the
    ceil grid): s = 2^ceil(log2(amax / 448)) (amax at least 1e-4), q = (w / s) in e4m3 (round to nearest even).
    Returns (q float8_e4m3fn, s float8_e8m0fnu (ceil(out/b0), ceil(in/b1)))."""
    b0, b1 = block
    rows, cols = w.shape
    gr, gc = -(-rows // b0), -(-cols // b1)
    x = torch.zeros(gr * b0, gc * b1)
    x[:rows, :cols] = w.float()
    blocks = x.view(gr, b0, gc, b1)
    scale = _pow2_ceil(blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4) / 448.0)
    q = (blocks / scale[:, None, :, None]).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q.view(gr * b0, gc * b1)[:rows, :cols].contiguous(), scale.to(torch.float8_e8m0fnu)


def fp4_quantize_ue8m0(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A routed expert as DeepSeek-V4 stores it: e2m1 codes in groups of 32 inputs, each with a ue8m0 scale
    2^ceil(log2(amax / 6)) (its kernels' fp4_act_quant; ``mxfp4_quantize``), two codes a byte, the lower input in the
    low nibble. Returns (int8 (out, in/2), float8_e8m0fnu (out, in/32))."""
    blocks, scales = mxfp4_quantize(w)
    return blocks.reshape(w.shape[0], -1).view(torch.int8).contiguous(), scales.view(torch.float8_e8m0fnu)


def to_deepseek_v4_release(src_dir, out_dir, *, quantize: bool = True) -> Path:
    """A DeepSeek-V4 checkpoint as transformers 5.24 saves it (bf16, ``model.layers.*``) in the layout DeepSeek
    publishes (deepseek-ai/DeepSeek-V4-Flash / -Pro): the release's names (``v4_release_name``), every routed expert
    matrix FP4 (``fp4_quantize_ue8m0``: ``NAME.weight`` I8 beside ``NAME.scale`` F8_E8M0), every FP8 linear
    (``V4_FP8``) e4m3 beside a ue8m0 ``NAME.scale`` per 128x128 block (``fp8_quantize_ue8m0``), norms bf16 (DeepSeek's
    model.py: "rmsnorm in the checkpoint is stored in bf16"), the rest as saved; config.json gains DeepSeek's
    ``quantization_config`` and ``expert_dtype: "fp4"``. Shards as in ``src_dir``. ``quantize=False``: the release's
    names only, every tensor as saved (a bf16 checkpoint as DeepSeek names it)."""

    def convert(name, t):
        name = v4_release_name(name)
        if not quantize:
            return {name: t}
        if V4_FP4.fullmatch(name):
            q, s = fp4_quantize_ue8m0(t)
        elif V4_FP8.fullmatch(name):
            q, s = fp8_quantize_ue8m0(t)
        else:
            return {name: t.to(torch.bfloat16) if name.endswith("norm.weight") else t}
        return {name: q, name[: -len("weight")] + "scale": s}

    def update(cfg):
        if quantize:
            cfg["quantization_config"] = dict(V4_QUANTIZATION)
            cfg["expert_dtype"] = "fp4"

    return _rewrite(src_dir, out_dir, convert, update)


# --- Qwen3.5-MoE as published (fused experts) ------------------------------------------------------------------

_PER_EXPERT = re.compile(r"^(?P<pre>.+\.mlp\.experts\.)(?P<e>[0-9]+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")


def to_fused_qwen3_5(src_dir, out_dir) -> Path:
    """A Qwen3.5-MoE checkpoint as transformers 5.24 saves it (one matrix per expert) in the layout Qwen publishes:
    per layer ``{prefix}.mlp.experts.gate_up_proj`` (E, 2I, hidden), each expert's gate rows then its up rows, and
    ``{prefix}.mlp.experts.down_proj`` (E, hidden, I): the parameters of transformers' own ``Qwen3_5MoeExperts``. Each
    layer's fused pair goes to the shard that held its expert 0's gate; index and config rewritten, other files
    copied."""
    from safetensors.torch import load_file, save_file

    src, out = Path(src_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    wmap = weight_map(src)
    per: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    home: dict[str, str] = {}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    for shard in sorted(set(wmap.values())):
        for name, t in load_file(src / shard).items():
            m = _PER_EXPERT.match(name)
            if m is None:
                shards.setdefault(shard, {})[name] = t
                continue
            per.setdefault(m["pre"], {}).setdefault(int(m["e"]), {})[m["proj"]] = t
            if m["e"] == "0" and m["proj"] == "gate_proj":
                home[m["pre"]] = shard
    for pre, experts in per.items():
        n = len(experts)
        shards.setdefault(home[pre], {})[pre + "gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in range(n)]).contiguous()
        shards[home[pre]][pre + "down_proj"] = torch.stack([experts[e]["down_proj"] for e in range(n)]).contiguous()
    new_map, total = {}, 0
    for shard, tensors in sorted(shards.items()):
        save_file(tensors, out / shard, metadata={"format": "pt"})
        for k, v in tensors.items():
            new_map[k] = shard
            total += v.numel() * v.element_size()
    _write_json(out / INDEX, {"metadata": {"total_size": total}, "weight_map": dict(sorted(new_map.items()))})
    for p in sorted(src.iterdir()):
        if p.is_file() and p.name != INDEX and not p.name.endswith(".safetensors"):
            shutil.copyfile(p, out / p.name)
    return out


# --- Qwen3-VL-MoE as published (fused experts, (E, in, out)) ---------------------------------------------------

def to_published_qwen3_vl(src_dir, out_dir) -> Path:
    """A Qwen3-VL-MoE checkpoint as transformers 5.24 saves it (fused experts as its module holds them,
    ``gate_up_proj`` (E, 2I, hidden), ``down_proj`` (E, hidden, I)) in the layout Qwen publishes: dims 1 and 2 swapped,
    (E, hidden, 2I) with gate then up along the last dim and (E, I, hidden). transformers cannot load this one at the
    kit's sizes (hidden = 2I: its check_dims Transpose leaves the square gate_up as it is); fq reads it."""
    def convert(name, t):
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            return {name: t.transpose(1, 2).contiguous()}
        return {name: t}

    return _rewrite(src_dir, out_dir, convert, lambda cfg: None)


# dims that are multiples of 16 (MXFP4: of 32) but not of 128, as gpt-oss-20b/120b's 2880: build(arch, d,
# keys=PADDED_KEYS[arch]) gives a checkpoint whose routed experts EXL3 stores zero-padded (fq.codec.shape: hidden 160
# at 256, intermediate 96 at 128)
PADDED_KEYS = {"GptOssForCausalLM": {"hidden_size": 160, "intermediate_size": 96}}

# keys the published configs carry that transformers' classes do not write, and exllamav3 reads: build(arch, d,
# extra_config=PUBLISHED_KEYS.get(arch)) gives a checkpoint whose base exllamav3 1.6.5 loads
PUBLISHED_KEYS = {"SolarOpenForCausalLM": {"intermediate_size": DENSE_INTER},
                  "Qwen3NextForCausalLM": {"full_attention_interval": 3},  # transformers derives layer_types from it
                  # Qwen3.5's vision_config states it (no deepstack); exllamav3 reads it without a default
                  "Qwen3_5MoeForConditionalGeneration": {"vision_config": {"deepstack_visual_indexes": []}},
                  # Trinity's router keys (transformers' router is sigmoid and normalizes, keyless)
                  "AfmoeForCausalLM": {"route_norm": True, "score_func": "sigmoid", "n_group": 1, "topk_group": 1},
                  # exllamav3 requires norm_topk_prob (transformers' router always normalizes, keyless) and reads
                  # the dense layers from mlp_only_layers
                  "LagunaForCausalLM": {"norm_topk_prob": True, "mlp_only_layers": [0], "decoder_sparse_step": 1},
                  # Hy3's router and layer keys, which exllamav3 reads and transformers does not define
                  "HYV3ForCausalLM": {"first_k_dense_replace": 1, "num_nextn_predict_layers": 0, "qk_norm": True,
                                      "route_norm": True, "moe_router_use_sigmoid": True,
                                      "moe_router_enable_expert_bias": True},
                  # DeepSeek-V4 states its schedule as exllamav3 reads it (transformers writes layer_types and
                  # mlp_layer_types instead)
                  "DeepseekV4ForCausalLM": {"compress_ratios": [0, 4, 128], "num_hash_layers": 1},
                  # Qwen3-VL's releases name the vision config qwen3_vl_moe (transformers 5.24 writes
                  # qwen3_vl_moe_vision, which exllamav3 1.6.5's vision reader refuses)
                  "Qwen3VLMoeForConditionalGeneration": {"vision_config": {"model_type": "qwen3_vl_moe"}}}


# --- one-node campaigns of a kit checkpoint (tests/test_family_campaigns.py, benchmarks/family_campaigns.py) -----

CAMPAIGN_RECIPE = {"format": "fq-cartridge/2", "name": "famc",
                   "description": "one K3 base (the CPU's cheapest Viterbi)",
                   "nodes": [{"name": "a", "kind": "base", "K": 3, "codebook": "mul1"}],
                   "products": [{"name": "a", "chain": ["a"]}]}
ROWS, COLUMNS = 2, 32  # calibration tokens: the least that still gives every expert a full-rank-ish Hessian input


def token_file(path: Path, rows: int = ROWS, cols: int = COLUMNS) -> tuple[Path, str]:
    """rows x cols seeded ids below the kit's vocab, as fq.hessian.calibration.save_tokens writes them."""
    from fq.hessian import calibration as hc

    ids = torch.randint(0, VOCAB, (rows, cols), generator=torch.Generator().manual_seed(0))
    hc.save_tokens(path, hc.CalibrationTokens(ids, hc.token_digest(ids), {"kind": "test", "seed": 0}))
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def campaign_config(d: Path, source: Path, *, calibrated: bool, allow_unloadable: bool = False,
                    weight_only_twins: bool = False, tokens: tuple[int, int] = (ROWS, COLUMNS),
                    recipe: dict | None = None, compare_native: bool = False) -> Path:
    """``d/config.yaml`` (and ``d/recipe.json``): a campaign of ``source`` with one K3 base (or ``recipe``), one block
    per layer, one window, on the CPU; calibrated with ``token_file``'s ``tokens`` (rows, columns; the kit has no
    tokenizer), with each fragment's weight-only twin where ``weight_only_twins`` (calibration.compare_weight_only) and
    the one-pass encodes of multi-node products where ``compare_native``; the signer key made at init
    (``OUT/signer.pub``)."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "recipe.json").write_text(json.dumps(recipe or CAMPAIGN_RECIPE))
    cfg = {"campaign": "famc", "out": "campaign", "source": {"kind": "local", "path": str(source), "revision": "kit-1"},
           "recipe": str(d / "recipe.json"), "block_size": EXPERTS, "windows": None, "windows_on_disk": 1,
           "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0}, "compare_native": compare_native,
           "eval": None,
           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}
    if allow_unloadable:
        cfg["allow_unloadable"] = True
    if calibrated:
        path, sha = token_file(d / "tokens.safetensors", *tokens)
        cfg["calibration"] = {"text": None, "tokens": str(path), "sha256": sha, "rows": tokens[0], "columns": tokens[1],
                              "capture": "all-experts", "compare_weight_only": weight_only_twins}
    path = d / "config.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
    return path
