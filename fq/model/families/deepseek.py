"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (DeepseekV3: MLA), DeepSeek-V3.2 (DSA indexer), DeepSeek-V2."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, DenseFirst, Exl3Needs, Family, LayerTypes

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
