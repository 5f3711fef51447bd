"""Qwen3-MoE (30B / 235B / 480B), Qwen3-Next, Qwen3.5-MoE (text), Qwen2-MoE.

transformers 5.x saves Qwen3-MoE's expert count as ``num_local_experts``; the authors' configs say ``num_experts``.
Qwen3-Next's next-token-prediction head (``mtp.*``) has experts of its own that no EXL3 runtime runs: outside the
``model.layers.*`` experts prefix, they are skeleton, kept verbatim."""
from fq.model.experts import STANDARD
from fq.model.families.base import (AllLayers, Calibration, Exl3Needs, Family, SparseStep, per_layer_types,
                                     sliding_if_window)

_EXPERTS = ("num_experts", "num_local_experts")


def _next_attention(config: dict, n_layers: int) -> list[str]:
    # exllamav3's Qwen3-Next takes full attention every full_attention_interval layers, not from layer_types
    every = config.get("full_attention_interval", 4)
    types = config.get("layer_types")
    want = ["full_attention" if (l + 1) % every == 0 else "linear_attention" for l in range(n_layers)]
    if types is not None and types != want:
        return [f"layer_types {types} is not every full_attention_interval={every}th layer full (exllamav3 reads "
                f"the interval)"]
    return []


# exllamav3 reads num_experts (transformers 5.x saves it as num_local_experts: the base states it)
_NEEDS = dict(stated=("num_experts", "moe_intermediate_size"), all_moe=True,
              aliases=(("num_experts", ("num_local_experts",)),))

QWEN3_MOE = Family(
    name="qwen3_moe", title="Qwen3-MoE 30B / 235B / 480B", architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",), layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=SparseStep(), exl3="Qwen3MoeForCausalLM", exl3_needs=Exl3Needs(**_NEEDS),
    calibration=Calibration("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeDecoderLayer",
                            "Qwen3MoeRotaryEmbedding", mask_type=sliding_if_window))

QWEN3_NEXT = Family(
    name="qwen3_next", title="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=SparseStep(),
    exl3="Qwen3NextForCausalLM", exl3_needs=Exl3Needs(**_NEEDS, check=_next_attention),
    # gated-delta-net (linear attention) and full-attention layers (layer_types); the shared expert and its gate
    # are not captured (fq encodes routed experts only)
    calibration=Calibration("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer",
                            "Qwen3NextRotaryEmbedding", mask_type=per_layer_types))

QWEN3_5_MOE = Family(
    name="qwen3_5_moe", title="Qwen3.5-MoE (text)", architectures=("Qwen3_5MoeForCausalLM",),
    model_types=("qwen3_5_moe_text",), layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=AllLayers(), exl3="Qwen3_5MoeForCausalLM",
    # as Qwen3-Next: gated-delta-net and full-attention layers (layer_types), a gated shared expert (not captured);
    # its text rotary (interleaved multimodal sections) gets the text positions on all three axes, as the model's
    calibration=Calibration("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer",
                            "Qwen3_5MoeTextRotaryEmbedding", mask_type=per_layer_types),
    exl3_needs=Exl3Needs(always="exllamav3 1.6.5's Qwen3_5MoeForCausalLM reads model.language_model.layers.*; the text "
                                "model as transformers saves it names its layers model.layers.*"))

QWEN2_MOE = Family(
    name="qwen2_moe", title="Qwen1.5-MoE / Qwen2-MoE", architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=SparseStep(),
    # softmax top-k router (norm_topk_prob), a sigmoid-gated shared expert (not captured: fq encodes routed experts
    # only), qkv biases; sliding attention on the layers config.layer_types names (use_sliding_window)
    calibration=Calibration("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeDecoderLayer",
                            "Qwen2MoeRotaryEmbedding", mask_type=per_layer_types))
