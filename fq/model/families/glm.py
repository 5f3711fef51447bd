"""GLM-4.5 / 4.6 / 4.7 (Glm4Moe), GLM-4.7-Flash (Glm4MoeLite, MLA) and GLM-5 (GlmMoeDsa: MLA + DSA indexer)."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, DenseFirst, Exl3Needs, Family, LayerTypes

_EXPERTS = ("n_routed_experts", "num_local_experts")
# exllamav3's GLM classes default n_routed_experts to 128, first_k_dense_replace to 3, routed_scaling_factor to 2.5
# where transformers' differ, and fix n_group = topk_group = 1
_STATED = ("n_routed_experts", "moe_intermediate_size", "intermediate_size", "routed_scaling_factor", "rms_norm_eps")
_ONE_GROUP = (("n_group", (None, 1), None), ("topk_group", (None, 1), None))


def _dsa_shared(hf_cfg, layer: int) -> bool:
    types = getattr(hf_cfg, "indexer_types", None) or []
    return layer < len(types) and types[layer] != "full"


GLM4_MOE = Family(
    name="glm4_moe", title="GLM-4.5 / 4.6 / 4.7", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=1), mtp_key="num_nextn_predict_layers", exl3="Glm4MoeForCausalLM",
    exl3_needs=Exl3Needs(stated=_STATED + ("first_k_dense_replace",), values=_ONE_GROUP),
    calibration=Calibration("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeDecoderLayer",
                            "Glm4MoeRotaryEmbedding"))

GLM4_MOE_LITE = Family(
    name="glm4_moe_lite", title="GLM-4.7-Flash", architectures=("Glm4MoeLiteForCausalLM",),
    model_types=("glm4_moe_lite",), layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    # Glm4MoeLiteConfig: mlp_layer_types, else layer 0 dense (first_k_dense_replace is not read)
    moe_rule=LayerTypes(default_dense=1, reads_first_k=False), mtp_key="num_nextn_predict_layers",
    exl3="Glm4MoeLiteForCausalLM", exl3_needs=Exl3Needs(stated=_STATED + ("mlp_layer_types",), values=_ONE_GROUP),
    calibration=Calibration("transformers.models.glm4_moe_lite.modeling_glm4_moe_lite", "Glm4MoeLiteDecoderLayer",
                            "Glm4MoeLiteRotaryEmbedding"))

GLM_MOE_DSA = Family(
    name="glm_moe_dsa", title="GLM-5", architectures=("GlmMoeDsaForCausalLM",), model_types=("glm_moe_dsa",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=LayerTypes(default_dense=3), mtp_key="num_nextn_predict_layers", exl3="GlmMoeDsaForCausalLM",
    exl3_needs=Exl3Needs(stated=_STATED, values=_ONE_GROUP),
    calibration=Calibration("transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", "GlmMoeDsaDecoderLayer",
                            "GlmMoeDsaRotaryEmbedding", materialized_mask=True, shared_indexer=_dsa_shared))
