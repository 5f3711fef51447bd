"""Laguna (Poolside's Laguna XS.2): per-expert ``mlp.experts.{E}.{gate,up,down}_proj`` (transformers' conversion
mapping "qwen2_moe" fuses them on load and splits them on save), the router ``mlp.gate`` and its score bias stored
under the experts prefix, ``mlp.experts.e_score_correction_bias`` (skeleton; transformers renames it
``mlp.gate.e_score_correction_bias``), the shared expert ``mlp.shared_expert``; dense and sparse layers by
``mlp_layer_types``, sliding and full attention layers each with a RoPE of its own (``rope_parameters`` keyed by layer
type) and a head count of its own (``num_attention_heads_per_layer``), a softplus output gate per head.

Its bases store each routed expert's ``up_proj`` as the source's matrix times 2^-7 (``LAYOUT``), as exllamav3 1.6.5's
LagunaForCausalLM reads it; every fq consumer multiplies it back (fq.model.experts, "Stored scales")."""
from fq.model.experts import STANDARD, ExpertLayout
from fq.model.families.base import Calibration, Exl3Needs, Family, LayerTypes, per_layer_types, rope_per_layer_type

_MOE = LayerTypes(default_dense=1, reads_first_k=False)  # LagunaConfig: mlp_layer_types, else layer 0 dense
# top-level RoPE keys exllamav3 reads before each type's rope_parameters, and the type's value when it states none
# (None: any top-level value is read instead of the type's)
_ROPE_TOP = (("rope_theta", 10000.0), ("partial_rotary_factor", 1.0), ("rope_scaling", None), ("rotary_dim", None))


# exllamav3's LagunaModel builds every MoE layer's BlockSparseMLP with interm_div = 128.0 ("Routed-expert activations
# overflow fp16"): the up projection gets Linear(weight_scale = 1/128) and the routing scale 128 x
# moe_routed_scaling_factor. weight_scale is applied only where a weight is loaded unquantized (Linear.load_fp16: what
# its converter then encodes), never by Linear.load_exl3, so an EXL3 up_proj must store W_up / 128 (a base storing
# W_up ran every routed expert's output 128 times too large: on the kit's tiny Laguna, H100, KL 0.084, top-1 0%).
# The shared expert and the dense layers' MLPs are built without it.
LAYOUT = ExpertLayout(STANDARD.prefix, STANDARD.projections, stored_scale_log2=(("up_proj", -7),))


def _exl3_reads(config: dict, n_layers: int) -> list[str]:
    """What exllamav3 1.6.5's LagunaForCausalLM reads otherwise than transformers' LagunaConfig: the dense layers from
    mlp_only_layers (default [0]), not mlp_layer_types; each layer type's RoPE from rope_parameters[type], except a
    top-level RoPE key, which it reads first for every type; the sliding layers' RoPE as default whatever its type."""
    out = []
    only = [0] if config.get("mlp_only_layers") is None else config["mlp_only_layers"]
    theirs = [l for l in range(n_layers) if l not in only]
    ours = _MOE.layers(config, n_layers, "config.json", "Laguna")
    if theirs != ours:
        out.append(f"mlp_only_layers={only!r} makes layers {theirs} MoE in exllamav3, mlp_layer_types makes {ours} "
                   "in transformers")
    rope, types = config.get("rope_parameters"), config.get("layer_types") or ["full_attention"] * n_layers
    if rope is None:
        return out  # not stated: Exl3Needs.stated says so
    if not isinstance(rope, dict) or not all(isinstance(rope.get(t), dict) for t in set(types)):
        return out + [f"rope_parameters is not stated per layer type ({', '.join(sorted(set(types)))}; exllamav3 "
                      "requires it)"]
    for key, default in _ROPE_TOP:
        top = config.get(key)
        if top is not None and (default is None or any(rope[t].get(key, default) != top for t in set(types))):
            out.append(f"{key}={top!r} at the top level (exllamav3 reads it for every layer type over "
                       "rope_parameters)")
    if rope.get("sliding_attention", {}).get("rope_type", "default") != "default" and "sliding_attention" in types:
        out.append(f"rope_parameters.sliding_attention.rope_type={rope['sliding_attention']['rope_type']!r} "
                   "(exllamav3 runs the sliding layers' RoPE as default)")
    return out


LAGUNA = Family(
    name="laguna", title="Laguna XS.2", architectures=("LagunaForCausalLM",), model_types=("laguna",),
    layout=LAYOUT, experts_keys=("num_experts",), inter_keys=("moe_intermediate_size",), moe_rule=_MOE,
    router="mlp.gate", experts_skeleton=("e_score_correction_bias",), exl3="LagunaForCausalLM",
    # exllamav3 requires these (no default there) or defaults sliding_window to -1 (transformers: 512); its
    # assert_cfg requires gating "per-head" (transformers' default is true) and norm_topk_prob true (a key
    # transformers does not define: its router always normalizes), as the published config states them
    exl3_needs=Exl3Needs(stated=("head_dim", "num_key_value_heads", "layer_types", "sliding_window", "rope_parameters",
                                 "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                                 "num_experts", "num_experts_per_tok"), check=_exl3_reads),
    # sigmoid router with the score bias for the choice only, a shared expert (not captured); each layer's mask and
    # position embeddings those of its layer type
    calibration=Calibration("transformers.models.laguna.modeling_laguna", "LagunaDecoderLayer",
                            "LagunaRotaryEmbedding", renames=(("mlp.experts.e_score_correction_bias",
                                                               "mlp.gate.e_score_correction_bias"),
                                                              ("mlp.shared_expert.", "mlp.shared_experts.")),
                            mask_type=per_layer_types,
                            rotary_kwargs=rope_per_layer_type, router_score="sigmoid"))
