"""AFMoE (Arcee's Trinity Nano / Mini / Large): per-expert ``mlp.experts.{E}.{gate,up,down}_proj`` (transformers'
conversion mapping "qwen2_moe" fuses them on load and splits them on save), the router ``mlp.router.gate`` with its
score bias ``mlp.expert_bias`` beside it, dense layers first (``num_dense_layers``), sliding and full attention layers
(RoPE on the sliding ones only), gated attention and four norms per layer; with muP the model scales the token
embeddings by sqrt(hidden_size)."""
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, DenseFirst, Exl3Needs, Family, per_layer_types


def _route_norm(config: dict, n_layers: int) -> list[str]:
    # transformers' AfmoeTokenChoiceRouter always normalizes the top-k scores; exllamav3 does only with route_norm
    if config.get("route_norm", True) is not True:
        return [f"route_norm={config['route_norm']!r} (exllamav3 then leaves the top-k weights unnormalized; "
                "transformers' AFMoE router always normalizes them)"]
    return []


def _mup_scale(hf_cfg) -> float:
    return hf_cfg.hidden_size ** 0.5 if hf_cfg.mup_enabled else 1.0  # AfmoeModel.forward


AFMOE = Family(
    name="afmoe", title="Trinity Nano / Mini / Large (AFMoE)", architectures=("AfmoeForCausalLM",),
    model_types=("afmoe",), layout=STANDARD, experts_keys=("num_experts",), inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=1, key="num_dense_layers"), router="mlp.router.gate", exl3="AfmoeForCausalLM",
    # exllamav3 reads these without transformers' defaults: num_dense_layers 0 (1), sliding_window -1 (1024), head_dim
    # hidden/heads (128), num_shared_experts 0 (2); layer_types and the sizes it requires (its assert_cfg: silu, a
    # sigmoid score_func, n_group = topk_group = 1, each when stated)
    exl3_needs=Exl3Needs(stated=("num_dense_layers", "layer_types", "sliding_window", "head_dim", "intermediate_size",
                                 "moe_intermediate_size", "num_experts", "num_experts_per_tok", "num_shared_experts"),
                         check=_route_norm),
    # sigmoid router with the score bias (mlp.expert_bias, the block's own parameter) added for the choice only, a
    # shared expert (not captured); the sliding layers' mask and window from layer_types
    calibration=Calibration("transformers.models.afmoe.modeling_afmoe", "AfmoeDecoderLayer", "AfmoeRotaryEmbedding",
                            router="router", mask_type=per_layer_types, embed_scale=_mup_scale,
                            router_score="sigmoid"))
