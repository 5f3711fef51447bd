"""dots.llm1 (Dots1): per-expert ``mlp.experts.{E}.{gate,up,down}_proj``, dense layers first."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, DenseFirst, Exl3Needs, Family, per_layer_types

DOTS1 = Family(
    name="dots1", title="dots.llm1", architectures=("Dots1ForCausalLM",), model_types=("dots1",), layout=STANDARD,
    experts_keys=("n_routed_experts", "num_local_experts"), inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=0), exl3="Dots1ForCausalLM",
    # exllamav3 defaults n_routed_experts to 128 and first_k_dense_replace to 3 (transformers: none and 0)
    exl3_needs=Exl3Needs(stated=("n_routed_experts", "first_k_dense_replace", "moe_intermediate_size",
                                 "intermediate_size", "routed_scaling_factor")),
    calibration=Calibration("transformers.models.dots1.modeling_dots1", "Dots1DecoderLayer", "Dots1RotaryEmbedding",
                            mask_type=per_layer_types, router_score="sigmoid"))
