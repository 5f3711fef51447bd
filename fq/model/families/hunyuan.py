"""Hy3 (Tencent Hunyuan 3, ``HYV3ForCausalLM``): per-expert ``mlp.experts.{E}.{gate,up,down}_proj`` (transformers'
conversion mapping "qwen2_moe" fuses them on load and splits them on save), the router ``mlp.router.gate`` and its
score bias ``mlp.expert_bias``, the shared expert ``mlp.shared_mlp`` (transformers' modules ``mlp.gate``,
``mlp.e_score_correction_bias``, ``mlp.shared_experts``: its conversion mapping "hy_v3" renames them on load and back
on save); dense and sparse layers by ``mlp_layer_types`` (the published config states ``first_k_dense_replace``,
which transformers does not read and exllamav3 does); next-token-prediction layers ``model.layers.{N}`` past
``num_hidden_layers``, with routed experts of their own."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, Exl3Needs, Family, LayerTypes

_MOE = LayerTypes(default_dense=1, reads_first_k=False)  # HYV3Config: mlp_layer_types, else layer 0 dense
_THETA = 11_158_840.0  # HYV3Config.default_theta (exllamav3's default: 10000)


def _exl3_reads(config: dict, n_layers: int) -> list[str]:
    """What exllamav3 1.6.5's HYV3ForCausalLM reads otherwise than transformers' HYV3Config: the dense layers from
    first_k_dense_replace (default 1), not mlp_layer_types; q/k norms only with qk_norm (transformers always has
    them); RoPE theta 10000 where the config states none (transformers: 11158840)."""
    out = []
    first = config.get("first_k_dense_replace", 1)
    theirs = list(range(first, n_layers)) if isinstance(first, int) else None
    ours = _MOE.layers(config, n_layers, "config.json", "Hy3")
    if theirs != ours:
        out.append(f"first_k_dense_replace={first!r} makes layers {theirs} MoE in exllamav3, mlp_layer_types makes "
                   f"{ours} in transformers")
    if config.get("qk_norm", True) is not True:
        out.append(f"qk_norm={config['qk_norm']!r} (exllamav3 then skips the q/k norms transformers' HYV3Attention "
                   "always applies)")
    rope = config.get("rope_parameters")
    if config.get("rope_theta") is None and not (isinstance(rope, dict) and rope.get("rope_theta") is not None):
        out.append(f"rope_theta is not stated (exllamav3 assumes 10000, transformers {_THETA:.0f})")
    return out


HY_V3 = Family(
    name="hy_v3", title="Hy3-preview (Hunyuan 3)", architectures=("HYV3ForCausalLM",), model_types=("hy_v3",),
    layout=STANDARD, experts_keys=("num_experts", "num_local_experts"), inter_keys=("moe_intermediate_size",),
    moe_rule=_MOE, mtp_key="num_nextn_predict_layers", router="mlp.router.gate", exl3="HYV3ForCausalLM",
    # exllamav3 requires these (no default there) or defaults head_dim to hidden/heads (transformers: 128) and
    # num_key_value_heads to the head count (8); it reads num_experts only (transformers 5.x accepts
    # num_local_experts: the base states it); its assert_cfg: silu, a sigmoid router with the expert bias and a
    # normalized top-k, each when stated
    exl3_needs=Exl3Needs(stated=("head_dim", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                                 "rms_norm_eps", "num_experts"), aliases=(("num_experts", ("num_local_experts",)),),
                         check=_exl3_reads),
    # sigmoid router with the score bias for the choice only, top-k weights normalized and scaled by
    # router_scaling_factor, a shared expert (not captured); full attention on every layer
    calibration=Calibration("transformers.models.hy_v3.modeling_hy_v3", "HYV3DecoderLayer", "HYV3RotaryEmbedding",
                            renames=(("mlp.router.gate.", "mlp.gate."),
                                     ("mlp.expert_bias", "mlp.e_score_correction_bias"),
                                     ("mlp.shared_mlp.", "mlp.shared_experts.")), router_score="sigmoid"))
