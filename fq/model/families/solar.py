"""Solar-Open: every layer MoE, DeepSeek-style expert names."""
from fq.model.experts import STANDARD
from fq.model.families.base import AllLayers, Calibration, Exl3Needs, Family

SOLAR_OPEN = Family(
    name="solar_open", title="Solar-Open", architectures=("SolarOpenForCausalLM",), model_types=("solar_open",),
    layout=STANDARD, experts_keys=("n_routed_experts", "num_local_experts"), inter_keys=("moe_intermediate_size",),
    moe_rule=AllLayers(), exl3="SolarOpenForCausalLM",
    # exllamav3 reads Solar-Open as a Glm4Moe config: intermediate_size required, routed_scaling_factor default 2.0
    exl3_needs=Exl3Needs(stated=("n_routed_experts", "moe_intermediate_size", "intermediate_size",
                                 "routed_scaling_factor")),
    # sigmoid router with e_score_correction_bias and group-limited top-k (n_group, topk_group), a shared expert
    # (not captured); full attention on every layer
    calibration=Calibration("transformers.models.solar_open.modeling_solar_open", "SolarOpenDecoderLayer",
                            "SolarOpenRotaryEmbedding", router_score="sigmoid"))
