"""LFM2-MoE (LFM2-8B-A1B): gated short-convolution and attention layers (``layer_types``), the first
``num_dense_layers`` dense, routed experts ``feed_forward.experts.{E}.w1/w3/w2`` (gate/up/down), a sigmoid router
``feed_forward.gate`` with a score bias ``feed_forward.expert_bias``, the final norm ``model.embedding_norm``."""
from fq.model.experts import ExpertLayout
from fq.model.families.base import Calibration, DenseFirst, Exl3Needs, Family, per_layer_types

LAYOUT = ExpertLayout("model.layers.{layer}.feed_forward.experts.{expert}", ("w1", "w3", "w2"))

LFM2_MOE = Family(
    name="lfm2_moe", title="LFM2-8B-A1B", architectures=("Lfm2MoeForCausalLM",), model_types=("lfm2_moe",),
    layout=LAYOUT, experts_keys=("num_experts",), inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=2, key="num_dense_layers"), router="feed_forward.gate", exl3="Lfm2MoeForCausalLM",
    # exllamav3 requires the sizes, top-k and norm_eps, defaults num_dense_layers to 0 (transformers: 2), layer_types
    # to every 4th layer attention (transformers has none) and tie_word_embeddings to False (transformers: True; the
    # published configs may spell it tie_embedding, which transformers reads and exllamav3 does not)
    exl3_needs=Exl3Needs(stated=("num_experts", "num_experts_per_tok", "moe_intermediate_size", "intermediate_size",
                                 "norm_eps", "num_dense_layers", "layer_types", "tie_word_embeddings"),
                         aliases=(("tie_word_embeddings", ("tie_embedding",)),)),
    # a conv layer runs its whole sequence from a zero state (no cache) and gets no mask; transformers 5.x fuses
    # w1 (gate) / w3 (up) / w2 (down) (conversion_mapping "lfm2_moe")
    calibration=Calibration("transformers.models.lfm2_moe.modeling_lfm2_moe", "Lfm2MoeDecoderLayer",
                            "Lfm2MoeRotaryEmbedding", moe_block="feed_forward", mask_type=per_layer_types,
                            final_norm=("embedding_norm", "operator_norm"), router_score="sigmoid"))
