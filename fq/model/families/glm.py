"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe), GLM-4.7-Flash (Glm4MoeLite, MLA), GLM-5 (GlmMoeDsa: MLA + DSA indexer) and
GLM-4.5V (Glm4vMoe: GLM-4.5-Air's language model in a vision-language wrapper)."""
from fq.core.targets import EXLLAMAV3
from fq.model.experts import LANGUAGE_MODEL, STANDARD
from fq.model.families.base import (Calibration, DenseFirst, Exl3Needs, Family, LayerTypes, stated,
                                     vision_config_check)

_EXPERTS = ("n_routed_experts", "num_local_experts")
# exllamav3's GLM classes default n_routed_experts to 128, first_k_dense_replace to 3, routed_scaling_factor to 2.5
# where transformers' differ, and fix n_group = topk_group = 1
_STATED = ("n_routed_experts", "moe_intermediate_size", "intermediate_size", "routed_scaling_factor", "rms_norm_eps")
_ONE_GROUP = (("n_group", (None, 1), None), ("topk_group", (None, 1), None))


def _indexer_types(config: dict) -> list[str] | None:
    """GLM-5's per-layer DSA indexer schedule as transformers' GlmMoeDsaConfig computes it where config.json does not
    state ``indexer_types`` (exllamav3 1.6.5's class reads it with no default): from ``index_topk_pattern`` ("F"
    full, "S" shared, or a list), else every ``index_topk_freq``-th layer from ``index_skip_topk_offset`` on runs its
    indexer (defaults 1 and 2: every layer)."""
    n = config.get("num_hidden_layers")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}[c] for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq = max(config.get("index_topk_freq", 1), 1)
    offset = config.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]


def _dsa_shared(hf_cfg, layer: int) -> bool:
    types = getattr(hf_cfg, "indexer_types", None) or []
    return layer < len(types) and types[layer] != "full"


GLM4_MOE = Family(
    name="glm4_moe", title="GLM-4.5 / 4.6 / 4.7", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=1), mtp_key="num_nextn_predict_layers", exl3="Glm4MoeForCausalLM",
    exl3_needs=Exl3Needs(stated=_STATED + ("first_k_dense_replace",), values=_ONE_GROUP),
    calibration=Calibration("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeDecoderLayer",
                            "Glm4MoeRotaryEmbedding", router_score="sigmoid"))

GLM4_MOE_LITE = Family(
    name="glm4_moe_lite", title="GLM-4.7-Flash", architectures=("Glm4MoeLiteForCausalLM",),
    model_types=("glm4_moe_lite",), layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    # Glm4MoeLiteConfig: mlp_layer_types, else layer 0 dense (first_k_dense_replace is not read)
    moe_rule=LayerTypes(default_dense=1, reads_first_k=False), mtp_key="num_nextn_predict_layers",
    exl3="Glm4MoeLiteForCausalLM", exl3_needs=Exl3Needs(stated=_STATED + ("mlp_layer_types",), values=_ONE_GROUP),
    calibration=Calibration("transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteDecoderLayer",
                            "Glm4MoeLiteRotaryEmbedding", router_score="sigmoid"))

GLM_MOE_DSA = Family(
    name="glm_moe_dsa", title="GLM-5", architectures=("GlmMoeDsaForCausalLM",), model_types=("glm_moe_dsa",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=LayerTypes(default_dense=3), mtp_key="num_nextn_predict_layers", exl3="GlmMoeDsaForCausalLM",
    exl3_needs=Exl3Needs(stated=_STATED, values=_ONE_GROUP, computed=(("indexer_types", _indexer_types),)),
    calibration=Calibration("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaDecoderLayer",
                            "GlmMoeDsaRotaryEmbedding", materialized_mask=True, shared_indexer=_dsa_shared,
                            router_score="sigmoid"))

# exllamav3 1.6.5's Glm4vMoeForConditionalGeneration builds its vision tower's config even to run text
# (read_glm4v_vision_config: these keys without a default, the model_type asserted; it opens preprocessor_config.json)
_glm4v_vision = vision_config_check(
    ("depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
     "spatial_merge_size", "temporal_patch_size", "model_type", "attention_bias", "image_size", "rms_norm_eps"),
    ("glm4v", "glm4v_moe", "glm4v_moe_vision", "glm4v_vision", "glm5_next_vision"))


def _glm4v_moe(config: dict, n_layers: int) -> list[str]:
    out = _glm4v_vision(config, n_layers)
    if not stated(config, "partial_rotary_factor"):  # read from text_config (or its rope_parameters)
        out.append(f"partial_rotary_factor is not stated (exllamav3 {EXLLAMAV3}'s Glm4vMoeForConditionalGeneration "
                   "assumes 1.0, transformers' Glm4vMoeTextConfig 0.5)")
    return out


# GLM-4.5V as Z.ai publishes it: the language model's layers under model.language_model.layers.* (layer 0 dense,
# then sigmoid-routed experts with a score bias and a shared expert, one matrix per expert: transformers'
# conversion_mapping fuses them as qwen2_moe's), the vision tower under model.visual.* (skeleton), the language
# model's config under text_config. exllamav3 reads the text keys from text_config, defaulting first_k_dense_replace
# to 3, routed_scaling_factor to 2.5 (transformers: 1, 1.0) and partial_rotary_factor to 1.0 (transformers: 0.5)
GLM4V_MOE = Family(
    name="glm4v_moe", title="GLM-4.5V / 4.6V (vision-language)", architectures=("Glm4vMoeForConditionalGeneration",),
    model_types=("glm4v_moe",), layout=LANGUAGE_MODEL, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=1), text_config="text_config", exl3="Glm4vMoeForConditionalGeneration",
    exl3_needs=Exl3Needs(stated=_STATED + ("first_k_dense_replace",),
                         values=_ONE_GROUP + (("use_qk_norm", (None, False), None),), check=_glm4v_moe),
    # its partial multimodal rotary gets the text positions on all three axes, as the model's own forward makes them
    # for text-only input; one causal mask
    calibration=Calibration("transformers.models.glm4v_moe.modeling_glm4v_moe", "Glm4vMoeTextDecoderLayer",
                            "Glm4vMoeTextRotaryEmbedding", router_score="sigmoid"))
