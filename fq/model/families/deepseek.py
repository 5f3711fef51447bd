"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (DeepseekV3: MLA), DeepSeek-V3.2 (DSA indexer), DeepSeek-V2, DeepSeek-V4
(compressed sparse attention, hyper-connections, hash-routed layers; not read yet)."""
from fq.model.experts import STANDARD, ExpertLayout
from fq.model.families.base import AllLayers, Calibration, DenseFirst, Exl3Needs, Family, LayerTypes

# DeepSeek-V4's own names, as its release stores them (declared here, not in fq.model.experts: that module is in the
# encoder bundle, and a family no campaign reads yet must not change every campaign's encoder identity)
DEEPSEEK_NATIVE = ExpertLayout("layers.{layer}.ffn.experts.{expert}", ("w1", "w3", "w2"))

_EXPERTS = ("n_routed_experts", "num_local_experts")

# Kimi-K2 ships model_type "kimi_k2" (its own remote code) with architectures ["DeepseekV3ForCausalLM"]: the same
# model, which transformers runs as deepseek_v3 (the first model type is the one handed to transformers).
DEEPSEEK_V3 = Family(
    name="deepseek_v3", title="DeepSeek-V3 / R1 / V3.1, Kimi-K2", architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"), layout=STANDARD, experts_keys=_EXPERTS,
    # DeepseekV3DecoderLayer: MoE from first_k_dense_replace on (moe_layer_freq, 1 in DeepSeek's configs, is unread)
    inter_keys=("moe_intermediate_size",), moe_rule=DenseFirst(default=3),
    mtp_key="num_nextn_predict_layers", exl3="DeepseekV3ForCausalLM",
    # MLA attention, sigmoid router with e_score_correction_bias and group-limited top-k (n_group, topk_group)
    calibration=Calibration("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3DecoderLayer",
                            "DeepseekV3RotaryEmbedding"),
    # exllamav3 1.6.5 asserts n_group, topk_group in {None, 1} (no group-limited routing): Kimi-K2 (1/1) loads,
    # DeepSeek-V3/R1 (8/4, also transformers' defaults when absent) do not
    exl3_needs=Exl3Needs(
        stated=("n_routed_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
                "routed_scaling_factor", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        values=(("n_group", (1,), 8), ("topk_group", (1,), 4))))  # scoring_func, topk_method: its assert_cfg

DEEPSEEK_V32 = Family(
    name="deepseek_v32", title="DeepSeek-V3.2", architectures=("DeepseekV32ForCausalLM",),
    model_types=("deepseek_v32",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=LayerTypes(default_dense=3), mtp_key="num_nextn_predict_layers",
    # MLA with a DSA indexer on every layer (no shared indexer), as GLM-5: the indexer reads the causal mask,
    # which the model always materializes; group-limited sigmoid routing, a shared expert (not captured)
    calibration=Calibration("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32DecoderLayer",
                            "DeepseekV32RotaryEmbedding", materialized_mask=True))

DEEPSEEK_V2 = Family(
    name="deepseek_v2", title="DeepSeek-V2 / V2.5", architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=0),
    # MLA attention (complex rotary), softmax router, greedy or group-limited greedy top-k (topk_method), a shared
    # expert (not captured)
    calibration=Calibration("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2DecoderLayer",
                            "DeepseekV2RotaryEmbedding"))

_V4_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _v4_schedule(config: dict, n_layers: int) -> list[str]:
    """What exllamav3 1.6.5's DeepseekV4Config reads differently from transformers' DeepseekV4Config: the attention
    types from ``compress_ratios`` (0/4/128; transformers prefers ``layer_types``), the hash-routed layers from
    ``num_hash_layers`` (transformers prefers ``mlp_layer_types``), the compression rates from ``compress_rate_csa``
    / ``_hca`` (transformers: ``compress_rates``) and the compressed layers' YaRN from ``rope_scaling``
    (transformers saves ``rope_parameters``); each absent, the same defaults as transformers'."""
    out = []
    ratios = config.get("compress_ratios")
    if ratios is None:  # both default to 2 HCA layers, then CSA / HCA alternating
        theirs = ["heavily_compressed_attention" if l < 2 or l % 2 == 0 else "compressed_sparse_attention"
                  for l in range(n_layers)]
    elif not isinstance(ratios, list) or len(ratios) < n_layers or any(r not in _V4_TYPES for r in ratios):
        theirs = None
        out.append(f"compress_ratios {ratios!r}: exllamav3 reads one of 0, 4, 128 per layer")
    else:
        theirs = [_V4_TYPES[r] for r in ratios[:n_layers]]
    types = config.get("layer_types")
    if theirs is not None and types is not None and types != theirs:
        out.append(f"layer_types {types} is not exllamav3's schedule {theirs} (it reads compress_ratios)")
    n_hash = config.get("num_hash_layers", 3)
    mlp = config.get("mlp_layer_types")
    if isinstance(n_hash, int) and mlp is not None and mlp != ["hash_moe" if l < n_hash else "moe"
                                                               for l in range(n_layers)]:
        out.append(f"mlp_layer_types {mlp} is not exllamav3's first num_hash_layers={n_hash} hash-routed layers")
    rates = config.get("compress_rates")
    exl3_rates = {"compressed_sparse_attention": config.get("compress_rate_csa", 4),
                  "heavily_compressed_attention": config.get("compress_rate_hca", 128)}
    if rates is not None and rates != exl3_rates:
        out.append(f"compress_rates {rates} (exllamav3 reads compress_rate_csa / compress_rate_hca: {exl3_rates})")
    compress = (config.get("rope_parameters") or {}).get("compress") or {}
    if compress.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        out.append(f"rope_parameters.compress is {compress.get('rope_type')!r} but rope_scaling is not stated "
                   "(exllamav3 reads the compressed layers' rope scaling there)")
    return out


DEEPSEEK_V4 = Family(
    name="deepseek_v4", title="DeepSeek-V4", architectures=("DeepseekV4ForCausalLM",), model_types=("deepseek_v4",),
    # DeepSeek's own tensor names, as the release stores them and exllamav3 reads them (layers.{L}.attn.*,
    # layers.{L}.ffn.{experts,gate,shared_experts}.*, embed, head, hc_head_*, mtp.{i}.*: the next-token-prediction
    # blocks lie outside the layers, skeleton)
    layout=DEEPSEEK_NATIVE, experts_keys=("n_routed_experts", "num_local_experts"),
    inter_keys=("moe_intermediate_size",), moe_rule=AllLayers(), router="ffn.gate", exl3="DeepseekV4ForCausalLM",
    unread="DeepSeek's releases store the routed experts as packed FP4 (two e2m1 values per int8 byte, a ue8m0 "
           "`.scale` per 32 inputs: `expert_dtype` fp4) and the other linears as FP8 e4m3 with ue8m0 `.scale` "
           "grids, which fq.model.formats does not read; transformers 5.24 saves a bf16 checkpoint under other names "
           "(`model.layers.{L}.ffn.*`, `model.embed_tokens`) than the release and exllamav3 (`layers.{L}.ffn.*`, "
           "`embed`)",
    # every layer MoE: the first num_hash_layers route by a token-id table (ffn.gate.tid2eid), the rest by a
    # sqrt-softplus router with a score bias (ffn.gate.bias); clamped SwiGLU experts (swiglu_limit), a shared expert.
    # exllamav3 defaults routed_scaling_factor to 1.0 (transformers: 1.5) and needs one KV head (assert_cfg:
    # sqrtsoftplus, noaux_tc)
    exl3_needs=Exl3Needs(stated=("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "q_lora_rank",
                                 "routed_scaling_factor", "qk_rope_head_dim"),
                         values=(("num_key_value_heads", (1,), 1),), check=_v4_schedule),
    # no calibration chain: a layer's input and output are hc_mult hyper-connection streams [rows, cols, hc_mult,
    # hidden] (the embedding expanded before layer 0, hc_head after the last), where the chain carries [rows, cols,
    # hidden]; the hash-routed layers take the token ids (tid2eid[input_ids]), which the chain does not pass a layer;
    # the attention takes {main, compress} position embeddings and runs eager only. It would take hidden-state files
    # of the streams, the token ids beside them, and the experts' clamped activation (act_inputs: _apply_gate)
    calibration=None)
