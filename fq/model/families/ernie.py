"""ERNIE-4.5-MoE (text): MoE layers from ``moe_layer_start_index`` to ``moe_layer_end_index`` (-1: the last), every
``moe_layer_interval``; the expert count is ``moe_num_experts``."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, Exl3Needs, Family, Interval

def _end_index(config: dict, n_layers: int) -> list[str]:
    # exllamav3 makes every layer from moe_layer_start_index on MoE: it does not read moe_layer_end_index
    end = config.get("moe_layer_end_index", -1)
    return [] if end in (-1, n_layers - 1) else [f"moe_layer_end_index={end} (exllamav3 does not read it: every "
                                                  f"layer from moe_layer_start_index on is MoE there)"]


ERNIE4_5_MOE = Family(
    name="ernie4_5_moe", title="ERNIE-4.5-MoE (text)", architectures=("Ernie4_5_MoeForCausalLM",),
    model_types=("ernie4_5_moe",), layout=STANDARD, experts_keys=("moe_num_experts", "num_experts"),
    topk_keys=("moe_k", "num_experts_per_tok"), inter_keys=("moe_intermediate_size",), moe_rule=Interval(),
    exl3="Ernie4_5_MoeForCausalLM",
    exl3_needs=Exl3Needs(stated=("moe_num_experts", "moe_k", "moe_intermediate_size", "moe_layer_start_index"),
                         check=_end_index),  # moe_layer_interval 1: its class's assert_cfg
    # the router's score bias: mlp.moe_statics.e_score_correction_bias on disk, mlp.gate.moe_statics. in the module
    calibration=Calibration("transformers.models.ernie4_5_moe.modeling_ernie4_5_moe", "Ernie4_5_MoeDecoderLayer",
                            "Ernie4_5_MoeRotaryEmbedding", renames=(("mlp.moe_statics.", "mlp.gate.moe_statics."),),
                            router_score="softmax"))
