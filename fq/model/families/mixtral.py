"""Mixtral, MiniMax-M2, MiniMax-Text-01 and Phi-3.5-MoE: ``block_sparse_moe.experts.{E}.w1/w3/w2`` (gate/up/down)."""
from fq.model.experts import MIXTRAL as LAYOUT
from fq.model.families.base import (AllLayers, Calibration, Exl3Needs, Family, linear_or_sliding_if_window,
                                     sliding_if_window)

_EXPERTS = ("num_local_experts", "num_experts")
_RENAMES = (("block_sparse_moe.", "mlp."),)

MIXTRAL = Family(
    name="mixtral", title="Mixtral 8x7B / 8x22B", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
    layout=LAYOUT, experts_keys=_EXPERTS, inter_keys=("intermediate_size",), moe_rule=AllLayers(),
    router="block_sparse_moe.gate", exl3="MixtralForCausalLM",
    exl3_needs=Exl3Needs(stated=("num_local_experts", "intermediate_size")),
    # transformers 5.x names the block mlp (block_sparse_moe. on disk) and fuses w1 (gate) / w3 (up) / w2 (down)
    calibration=Calibration("transformers.models.mixtral.modeling_mixtral", "MixtralDecoderLayer",
                            "MixtralRotaryEmbedding", renames=_RENAMES, mask_type=sliding_if_window,
                            router_score="softmax"))

MINIMAX_M2 = Family(
    name="minimax_m2", title="MiniMax-M2", architectures=("MiniMaxM2ForCausalLM",), model_types=("minimax_m2",),
    layout=LAYOUT, experts_keys=_EXPERTS, inter_keys=("intermediate_size",), moe_rule=AllLayers(),
    router="block_sparse_moe.gate", exl3="MiniMaxM2ForCausalLM",
    # exllamav3 1.6.5 looks up the router's score bias only at block_sparse_moe.gate.e_score_correction_bias (its
    # BlockSparseMLP, key_e_score_bias); MiniMax-M2 stores it at block_sparse_moe.e_score_correction_bias: the base
    # derives it under exllamav3's name (tensor_aliases.safetensors), the skeleton keeps the published one
    # (its class also asserts silu, a normalized top-k and per-layer q/k norms, each when stated: assert_cfg)
    exl3_needs=Exl3Needs(
        stated=("num_local_experts", "intermediate_size"),
        tensor_aliases=(("block_sparse_moe.e_score_correction_bias",
                         "block_sparse_moe.gate.e_score_correction_bias"),)),
    # as Mixtral, plus block_sparse_moe.e_score_correction_bias (the block's buffer, passed to its sigmoid router)
    calibration=Calibration("transformers.models.minimax_m2.modeling_minimax_m2", "MiniMaxM2DecoderLayer",
                            "MiniMaxM2RotaryEmbedding", renames=_RENAMES, router_score="sigmoid"))

MINIMAX = Family(
    name="minimax", title="MiniMax-Text-01", architectures=("MiniMaxForCausalLM",), model_types=("minimax",),
    layout=LAYOUT, experts_keys=_EXPERTS, inter_keys=("intermediate_size",), moe_rule=AllLayers(),
    router="block_sparse_moe.gate",
    # lightning (linear) attention and softmax attention layers (layer_types), experts as Mixtral's; the lightning
    # layers' decay buffers are the checkpoint's where it has them, else computed as from_pretrained does
    calibration=Calibration("transformers.models.minimax.modeling_minimax", "MiniMaxDecoderLayer",
                            "MiniMaxRotaryEmbedding", renames=_RENAMES, mask_type=linear_or_sliding_if_window,
                            derived_buffers=tuple(f"self_attn.{b}" for b in ("slope_rate", "query_decay", "key_decay",
                                                                             "diagonal_decay")),
                            router_score="softmax"))

PHIMOE = Family(
    name="phimoe", title="Phi-3.5-MoE", architectures=("PhimoeForCausalLM",), model_types=("phimoe",),
    layout=LAYOUT, experts_keys=_EXPERTS, inter_keys=("intermediate_size",), moe_rule=AllLayers(),
    router="block_sparse_moe.gate",
    # transformers 5.x names the block mlp and its router mlp.router (block_sparse_moe.gate. on disk: its
    # conversion_mapping "phimoe"), fuses w1/w3/w2 as Mixtral's; the router is sparsemixer (top-2, deterministic in
    # eval), the norms are LayerNorms with biases
    calibration=Calibration("transformers.models.phimoe.modeling_phimoe", "PhimoeDecoderLayer",
                            "PhimoeRotaryEmbedding", renames=(("block_sparse_moe.gate.", "mlp.router."),) + _RENAMES,
                            router="router", mask_type=sliding_if_window))
