"""Kimi-Linear (Moonshot AI): KDA linear-attention layers and NoPE MLA layers (``linear_attn_config``), a
DeepSeek-V3-style sigmoid router with a score bias and a shared expert. Kimi-K2 is ``DeepseekV3ForCausalLM``
(``deepseek.py``).

As Moonshot publishes it: a dense layer's MLP under ``mlp.{gate,up,down}_proj``, an MoE layer's block under
``block_sparse_moe.`` (experts ``experts.{E}.w1/w3/w2``, router ``gate.weight`` and ``gate.e_score_correction_bias``,
``shared_experts.{gate,up,down}_proj``), a KDA layer's short convolutions as ``q_conv1d``/``k_conv1d``/``v_conv1d``.
transformers 5.24 names the block ``mlp``, concatenates the convolutions and moves the forget gate under
``self_attn.forget_gate`` (conversion_mapping "kimi_linear"); its ``save_pretrained`` reverts that, but renames a
dense layer's ``mlp.`` to ``block_sparse_moe.`` as well (the reverted rename is unconditional)."""
from fq.model.experts import MIXTRAL as LAYOUT
from fq.model.families.base import Calibration, Exl3Needs, Family, LayerTypes, per_layer_types

_RULE = LayerTypes(default_dense=1)  # KimiLinearConfig: mlp_layer_types, else first_k_dense_replace (default 1)
_LINEAR_KEYS = ("kda_layers", "full_attn_layers", "num_heads", "head_dim", "short_conv_kernel_size")


def _exl3_schedule(config: dict, n_layers: int) -> list[str]:
    """What exllamav3 1.6.5's KimiLinearConfig reads its layer schedule from, against transformers': the attention
    types from ``linear_attn_config`` (1-indexed ``kda_layers`` / ``full_attn_layers``, no default; transformers
    prefers ``layer_types``), the MoE layers from ``first_k_dense_replace`` (default 0) and ``moe_layer_freq``
    (default 1; transformers reads ``mlp_layer_types``, else ``first_k_dense_replace``, default 1)."""
    out = []
    la = config.get("linear_attn_config")
    missing = [k for k in _LINEAR_KEYS if not isinstance(la, dict) or la.get(k) is None]
    if not missing and not all(isinstance(la[k], list) for k in _LINEAR_KEYS[:2]):
        out.append("linear_attn_config: kda_layers and full_attn_layers must be lists of layer numbers (1-indexed)")
    elif missing:
        out.append(f"linear_attn_config lacks {', '.join(missing)} (exllamav3 reads them without a default)")
    else:
        kda, full = set(la["kda_layers"]), set(la["full_attn_layers"])
        if any(l + 1 not in kda | full for l in range(n_layers)):
            out.append("linear_attn_config does not assign every layer to kda_layers or full_attn_layers")
        theirs = ["linear_attention" if l + 1 in kda else "full_attention" for l in range(n_layers)]
        types = config.get("layer_types")
        if types is not None and types != theirs:
            out.append(f"layer_types {types} is not linear_attn_config's schedule {theirs} (exllamav3 reads the "
                       "latter)")
        if la.get("gate_lower_bound") is not None:
            out.append(f"linear_attn_config.gate_lower_bound={la['gate_lower_bound']!r} (exllamav3 bounds the KDA "
                       "forget gate with it; transformers' KimiLinearForgetGate has no bound)")
    first, freq = config.get("first_k_dense_replace", 0), config.get("moe_layer_freq", 1)
    if isinstance(first, int) and isinstance(freq, int) and freq > 0:
        theirs = [l for l in range(n_layers) if l >= first and l % freq == 0]
        ours = _RULE.layers(config, n_layers, "config.json", "Kimi-Linear")
        if theirs != ours:
            out.append(f"exllamav3 makes layers {theirs} MoE (first_k_dense_replace={first}, moe_layer_freq={freq}), "
                       f"transformers layers {ours}")
    return out


KIMI_LINEAR = Family(
    name="kimi_linear", title="Kimi-Linear", architectures=("KimiLinearForCausalLM",), model_types=("kimi_linear",),
    layout=LAYOUT, experts_keys=("num_experts", "num_local_experts"), inter_keys=("moe_intermediate_size",),
    topk_keys=("num_experts_per_token", "num_experts_per_tok"), moe_rule=_RULE, router="block_sparse_moe.gate",
    exl3="KimiLinearForCausalLM",
    # exllamav3 reads Moonshot's spellings (transformers 5.24 saves those too: its attribute_map) and defaults
    # num_shared_experts to 0, routed_scaling_factor to 1.0 and qk_rope_head_dim to 0 (transformers: 1, 2.446, 64);
    # its group-limited routing asserts one group (its assert_cfg: silu, mla_use_nope, sigmoid, moe_renormalize, no
    # next-token-prediction layers)
    exl3_needs=Exl3Needs(
        stated=("num_experts", "moe_intermediate_size", "intermediate_size", "num_shared_experts",
                "routed_scaling_factor", "rms_norm_eps", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
                "v_head_dim"),
        values=(("num_expert_group", (None, 1), 1), ("topk_group", (None, 1), 1)),
        aliases=(("num_experts", ("num_local_experts",)), ("num_experts_per_token", ("num_experts_per_tok",)),
                 ("num_shared_experts", ("n_shared_experts",)), ("num_expert_group", ("n_group",)),
                 ("moe_renormalize", ("norm_topk_prob",))),
        check=_exl3_schedule),
    # KDA layers (a recurrent state from zero over the whole row: no cache) and MLA layers without positional
    # encoding (no rotary module); a dense layer's MLP is mlp.* as published, block_sparse_moe.* as transformers saves
    # it; the shared expert is not captured (fq encodes routed experts only)
    calibration=Calibration(
        "transformers.models.kimi_linear.modeling_kimi_linear", "KimiLinearDecoderLayer", None,
        renames=(("block_sparse_moe.experts.", "mlp.experts."), ("block_sparse_moe.gate.", "mlp.gate."),
                 ("block_sparse_moe.shared_experts.", "mlp.shared_experts."), ("mlp.", "mlp."),
                 ("block_sparse_moe.", "mlp."),
                 ("self_attn.f_a_proj.", "self_attn.forget_gate.f_a_proj."),
                 ("self_attn.f_b_proj.", "self_attn.forget_gate.f_b_proj."),
                 ("self_attn.dt_bias", "self_attn.forget_gate.dt_bias"),
                 ("self_attn.A_log", "self_attn.forget_gate.A_log")),
        concats=(("self_attn.conv1d.weight", tuple(f"self_attn.{x}_conv1d.weight" for x in "qkv")),),
        mask_type=per_layer_types, router_score="sigmoid"))
