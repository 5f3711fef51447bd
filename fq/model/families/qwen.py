"""Qwen3-MoE (30B / 235B / 480B), Qwen3-Next, Qwen3.5-MoE (the vision-language checkpoints as published, and the
text model), Qwen2-MoE, Qwen3-VL-MoE (vision-language).

transformers 5.x saves Qwen3-MoE's expert count as ``num_local_experts``; the authors' configs say ``num_experts``.
Qwen3-Next's next-token-prediction head (``mtp.*``) has experts of its own that no EXL3 runtime runs: outside the
``model.layers.*`` experts prefix, they are skeleton, kept verbatim.

Qwen3.5-MoE is published as a vision-language checkpoint, ``Qwen3_5MoeForConditionalGeneration``: the language model's
layers under ``model.language_model.layers.*`` (its routed experts fused per layer, ``mlp.experts.gate_up_proj``
(E, 2I, hidden) with gate then up, and ``mlp.experts.down_proj`` (E, hidden, I); transformers 5.24 saves them one
matrix per expert), the vision tower under ``model.visual.*`` and the MTP head under ``mtp.*``, both skeleton; its
config nests the language model's under ``text_config``."""
from fq.core.targets import EXLLAMAV3
from fq.model.experts import LANGUAGE_MODEL, STANDARD
from fq.model.families.base import (AllLayers, Calibration, Exl3Needs, Family, FusedExperts, SparseStep,
                                     per_layer_types, sliding_if_window, stated, vision_config_check)

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
                            "Qwen3MoeRotaryEmbedding", mask_type=sliding_if_window, router_score="softmax"))

QWEN3_NEXT = Family(
    name="qwen3_next", title="Qwen3-Next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=SparseStep(),
    exl3="Qwen3NextForCausalLM", exl3_needs=Exl3Needs(**_NEEDS, check=_next_attention),
    # gated-delta-net (linear attention) and full-attention layers (layer_types); the shared expert and its gate
    # are not captured (fq encodes routed experts only)
    calibration=Calibration("transformers.models.qwen3_next.modeling_qwen3_next", "Qwen3NextDecoderLayer",
                            "Qwen3NextRotaryEmbedding", mask_type=per_layer_types, router_score="softmax"))

# as Qwen3-Next: gated-delta-net and full-attention layers (layer_types), a gated shared expert (not captured); its
# text rotary (interleaved multimodal sections) gets the text positions on all three axes, as the model's own for text.
# The vision-language checkpoint's language model runs the same layers (its text_config; the vision tower is not
# calibrated: fq encodes the routed experts only)
_QWEN3_5_CHAIN = Calibration("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "Qwen3_5MoeDecoderLayer",
                             "Qwen3_5MoeTextRotaryEmbedding", mask_type=per_layer_types, router_score="softmax")

QWEN3_5_MOE = Family(
    name="qwen3_5_moe", title="Qwen3.5-MoE (text)", architectures=("Qwen3_5MoeForCausalLM",),
    model_types=("qwen3_5_moe_text",), layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=AllLayers(), exl3="Qwen3_5MoeForCausalLM", calibration=_QWEN3_5_CHAIN,
    exl3_needs=Exl3Needs(always=f"exllamav3 {EXLLAMAV3}'s Qwen3_5MoeForCausalLM reads model.language_model.layers.*; the text "
                                "model as transformers saves it names its layers model.layers.*"))

# exllamav3 1.6.5's Qwen3_5MoeForConditionalGeneration builds the vision tower's config even to run text: these
# vision_config keys have no default there (and it opens preprocessor_config.json, a side file the base carries)
_VISION_KEYS = ("deepstack_visual_indexes", "depth", "hidden_act", "hidden_size", "intermediate_size", "num_heads",
                "num_position_embeddings", "out_hidden_size", "patch_size", "spatial_merge_size",
                "temporal_patch_size", "model_type")


# ... and asserts its model_type is one of these (read_qwen3_vl_vision_config: its Qwen3-VL and Qwen3.5 classes)
_VISION_TYPES = ("qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "qwen3_5_vision", "qwen3_5_moe_vision",
                 "qwen4_exp", "qwen4_exp_vision")
_vision_config = vision_config_check(_VISION_KEYS, _VISION_TYPES)


QWEN3_5_MOE_VL = Family(
    name="qwen3_5_moe_vl", title="Qwen3.5-MoE (vision-language, as published)",
    architectures=("Qwen3_5MoeForConditionalGeneration",), model_types=("qwen3_5_moe",), layout=LANGUAGE_MODEL,
    experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=AllLayers(), text_config="text_config",
    on_disk="`model.language_model.layers.{L}.mlp.experts.{gate_up_proj,down_proj}` (E first, (out, in), gate then "
            "up; as transformers saves it: `...experts.{E}.{gate_proj,up_proj,down_proj}.weight`)",
    fused_experts=FusedExperts(order="out_in", split="halves", per_expert_too=True, runtime_fused=False),
    # exllamav3's VL class reads model.language_model.layers.* and the language model's keys from text_config (and
    # asserts silu and a normalized top-k, each when stated)
    exl3="Qwen3_5MoeForConditionalGeneration", calibration=_QWEN3_5_CHAIN,
    exl3_needs=Exl3Needs(**_NEEDS, check=_vision_config))


def _qwen3_vl_moe(config: dict, n_layers: int) -> list[str]:
    out = _vision_config(config, n_layers)
    if not stated(config, "rope_theta"):  # read from text_config (or its rope_parameters)
        out.append(f"rope_theta is not stated (exllamav3 {EXLLAMAV3}'s Qwen3VLMoeForConditionalGeneration assumes "
                   "5000000, transformers' Qwen3VLMoeTextConfig 500000)")
    return out


# Qwen3-VL-MoE as Qwen publishes it: the language model (Qwen3-MoE's layers: softmax top-k, q/k norms, no shared
# expert) under model.language_model.layers.*, its experts fused per layer in transformers 4.57's layout,
# mlp.experts.gate_up_proj (E, hidden, 2I) with gate then up along the last dim and mlp.experts.down_proj
# (E, I, hidden). transformers 5.x's module holds them transposed, (E, 2I, hidden) and (E, hidden, I): its
# conversion_mapping ("qwen3_vl_moe") transposes a tensor on load only where its shape is not the module's
# (Transpose(1, 2, check_dims)), and on save writes the module's own, so a checkpoint transformers 5.24 saves is
# (E, out, in). fq reads both (the order told by the shard headers). The vision tower (model.visual.*) is skeleton.
QWEN3_VL_MOE = Family(
    name="qwen3_vl_moe", title="Qwen3-VL-MoE 30B-A3B / 235B-A22B (vision-language)",
    architectures=("Qwen3VLMoeForConditionalGeneration",), model_types=("qwen3_vl_moe",), layout=LANGUAGE_MODEL,
    experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=SparseStep(), text_config="text_config",
    on_disk="`model.language_model.layers.{L}.mlp.experts.{gate_up_proj,down_proj}` (E first, (in, out), gate then "
            "up; as transformers saves it: (out, in))",
    fused_experts=FusedExperts(order="in_out", split="halves", saved_order="out_in"),
    # exllamav3's class reads the language model's keys from text_config (num_experts, num_experts_per_tok and
    # rms_norm_eps without a default; rope_theta defaulting to 5e6) and builds every layer MoE
    exl3="Qwen3VLMoeForConditionalGeneration",
    exl3_needs=Exl3Needs(stated=("num_experts", "moe_intermediate_size", "num_experts_per_tok", "rms_norm_eps"),
                         all_moe=True, aliases=(("num_experts", ("num_local_experts",)),), check=_qwen3_vl_moe),
    # the text model's decoder layers; its rotary (interleaved multimodal sections) gets the text positions on all
    # three axes, as the model's own forward makes them for text-only input; one causal mask (no sliding window)
    calibration=Calibration("transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe", "Qwen3VLMoeTextDecoderLayer",
                            "Qwen3VLMoeTextRotaryEmbedding", fused_transposed=True, router_score="softmax"))

QWEN2_MOE = Family(
    name="qwen2_moe", title="Qwen1.5-MoE / Qwen2-MoE", architectures=("Qwen2MoeForCausalLM",),
    model_types=("qwen2_moe",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",), moe_rule=SparseStep(),
    # softmax top-k router (norm_topk_prob), a sigmoid-gated shared expert (not captured: fq encodes routed experts
    # only), qkv biases; sliding attention on the layers config.layer_types names (use_sliding_window)
    calibration=Calibration("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeDecoderLayer",
                            "Qwen2MoeRotaryEmbedding", mask_type=per_layer_types, router_score="softmax"))
