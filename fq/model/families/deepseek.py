"""DeepSeek-V3 / R1 / V3.1 and Kimi-K2 (DeepseekV3: MLA), DeepSeek-V3.2 (DSA indexer), DeepSeek-V2, DeepSeek-V4
(compressed sparse attention, hyper-connections, hash-routed layers: read as DeepSeek publishes it, FP4 experts and
FP8 linears with ue8m0 scales; no calibration chain)."""
import re

from fq.model.experts import STANDARD, ExpertLayout
from fq.model.families.base import AllLayers, Calibration, DenseFirst, Exl3Needs, Family, LayerTypes

# DeepSeek-V4's own names, as its release stores them (declared here, not in fq.model.experts: that module is in the
# encoder bundle, and one family's layout must not change every campaign's encoder identity)
DEEPSEEK_NATIVE = ExpertLayout("layers.{layer}.ffn.experts.{expert}", ("w1", "w3", "w2"))

_EXPERTS = ("n_routed_experts", "num_local_experts")

# Kimi-K2 ships model_type "kimi_k2" (its own remote code) with architectures ["DeepseekV3ForCausalLM"]: the same
# model, which transformers runs as deepseek_v3 (the first model type is the one handed to transformers).
DEEPSEEK_V3 = Family(
    name="deepseek_v3", title="DeepSeek-V3 / R1 / V3.1, Kimi-K2", architectures=("DeepseekV3ForCausalLM",),
    model_types=("deepseek_v3", "kimi_k2"), layout=STANDARD, experts_keys=_EXPERTS,
    # DeepseekV3DecoderLayer: MoE from first_k_dense_replace on (moe_layer_freq, 1 in DeepSeek's configs, is unread)
    inter_keys=("moe_intermediate_size",), moe_rule=DenseFirst(default=3),
    mtp_key="num_nextn_predict_layers", exl3="DeepseekV3ForCausalLM",
    # MLA attention, sigmoid router with e_score_correction_bias and group-limited top-k (n_group, topk_group)
    calibration=Calibration("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3DecoderLayer",
                            "DeepseekV3RotaryEmbedding", router_score="sigmoid"),
    # exllamav3 1.6.5 asserts n_group, topk_group in {None, 1} (no group-limited routing): Kimi-K2 (1/1) loads,
    # DeepSeek-V3/R1 (8/4, also transformers' defaults when absent) do not
    exl3_needs=Exl3Needs(
        stated=("n_routed_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
                "routed_scaling_factor", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"),
        values=(("n_group", (1,), 8), ("topk_group", (1,), 4))))  # scoring_func, topk_method: its assert_cfg

DEEPSEEK_V32 = Family(
    name="deepseek_v32", title="DeepSeek-V3.2", architectures=("DeepseekV32ForCausalLM",),
    model_types=("deepseek_v32",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=LayerTypes(default_dense=3), mtp_key="num_nextn_predict_layers",
    # MLA with a DSA indexer on every layer (no shared indexer), as GLM-5: the indexer reads the causal mask,
    # which the model always materializes; group-limited sigmoid routing, a shared expert (not captured)
    calibration=Calibration("transformers.models.deepseek_v32.modeling_deepseek_v32", "DeepseekV32DecoderLayer",
                            "DeepseekV32RotaryEmbedding", materialized_mask=True, router_score="sigmoid"))

DEEPSEEK_V2 = Family(
    name="deepseek_v2", title="DeepSeek-V2 / V2.5", architectures=("DeepseekV2ForCausalLM",),
    model_types=("deepseek_v2",),
    layout=STANDARD, experts_keys=_EXPERTS, inter_keys=("moe_intermediate_size",),
    moe_rule=DenseFirst(default=0),
    # MLA attention (complex rotary), softmax router, greedy or group-limited greedy top-k (topk_method), a shared
    # expert (not captured)
    calibration=Calibration("transformers.models.deepseek_v2.modeling_deepseek_v2", "DeepseekV2DecoderLayer",
                            "DeepseekV2RotaryEmbedding", router_score="softmax"))

_V4_TYPES = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def _v4_attention(config: dict, n_layers: int) -> list[str] | None:
    """Each layer's attention type as exllamav3 1.6.5's DeepseekV4Config reads it: ``compress_ratios`` (0/4/128; the
    list may run past num_hidden_layers into the MTP blocks), absent, transformers' and exllamav3's shared default (2
    HCA layers, then CSA / HCA alternating); None for a list exllamav3 would not read."""
    ratios = config.get("compress_ratios")
    if ratios is None:
        return ["heavily_compressed_attention" if l < 2 or l % 2 == 0 else "compressed_sparse_attention"
                for l in range(n_layers)]
    if not isinstance(ratios, list) or len(ratios) < n_layers or any(r not in _V4_TYPES for r in ratios):
        return None
    return [_V4_TYPES[r] for r in ratios[:n_layers]]


def _v4_schedule(config: dict, n_layers: int) -> list[str]:
    """What exllamav3 1.6.5's DeepseekV4Config reads differently from transformers' DeepseekV4Config: the attention
    types from ``compress_ratios`` (0/4/128; transformers prefers ``layer_types``), the hash-routed layers from
    ``num_hash_layers`` (transformers prefers ``mlp_layer_types``), the compression rates from ``compress_rate_csa``
    / ``_hca`` (transformers: ``compress_rates``) and the compressed layers' YaRN from ``rope_scaling``
    (transformers saves ``rope_parameters``); each absent, the same defaults as transformers'."""
    out = []
    theirs = _v4_attention(config, n_layers)
    if theirs is None:
        out.append(f"compress_ratios {config.get('compress_ratios')!r}: exllamav3 reads one of 0, 4, 128 per layer")
    types = config.get("layer_types")
    if theirs is not None and types is not None and types != theirs:
        out.append(f"layer_types {types} is not exllamav3's schedule {theirs} (it reads compress_ratios)")
    n_hash = config.get("num_hash_layers", 3)
    mlp = config.get("mlp_layer_types")
    if isinstance(n_hash, int) and mlp is not None and mlp != ["hash_moe" if l < n_hash else "moe"
                                                               for l in range(n_layers)]:
        out.append(f"mlp_layer_types {mlp} is not exllamav3's first num_hash_layers={n_hash} hash-routed layers")
    rates = config.get("compress_rates")
    exl3_rates = {"compressed_sparse_attention": config.get("compress_rate_csa", 4),
                  "heavily_compressed_attention": config.get("compress_rate_hca", 128)}
    if rates is not None and rates != exl3_rates:
        out.append(f"compress_rates {rates} (exllamav3 reads compress_rate_csa / compress_rate_hca: {exl3_rates})")
    compress = (config.get("rope_parameters") or {}).get("compress") or {}
    if compress.get("rope_type", "default") != "default" and config.get("rope_scaling") is None:
        out.append(f"rope_parameters.compress is {compress.get('rope_type')!r} but rope_scaling is not stated "
                   "(exllamav3 reads the compressed layers' rope scaling there)")
    return out + _v4_fp8_grids(config)


def _v4_fp8_grids(config: dict) -> list[str]:
    """exllamav3 1.6.5 dequantizes a skeleton linear's ``.scale`` grid on load (``Linear.dequant_e8m0_blocks_``)
    with the block the grid implies, rows // grid rows: DeepSeek's 128x128 block only where each FP8 linear's dim is
    a multiple of it or at most one block (DeepSeek's Linear takes the ceil grid). Every dim of the releases is a
    multiple of 128; a config with another (a head_dim of 192) would be misread."""
    q = config.get("quantization_config")
    block = q.get("weight_block_size") if isinstance(q, dict) else None
    if not isinstance(block, list) or len(block) != 2 or not all(type(b) is int and b > 0 for b in block):
        return []
    get = {k: config.get(k, d) for k, d in (("hidden_size", None), ("q_lora_rank", None), ("head_dim", 512),
                                            ("num_attention_heads", None), ("o_groups", 8), ("o_lora_rank", 1024),
                                            ("index_n_heads", 64), ("index_head_dim", 128),
                                            ("moe_intermediate_size", None), ("n_shared_experts", 1))}
    if not all(type(v) is int and v > 0 for v in get.values()):
        return []  # a count the config lacks or states wrongly is refused where it is read
    heads = get["num_attention_heads"] * get["head_dim"]
    dims = {"hidden_size": get["hidden_size"], "q_lora_rank": get["q_lora_rank"], "head_dim": get["head_dim"],
            "num_attention_heads * head_dim": heads,
            "num_attention_heads * head_dim / o_groups": heads // get["o_groups"],
            "o_groups * o_lora_rank": get["o_groups"] * get["o_lora_rank"],
            "index_n_heads * index_head_dim": get["index_n_heads"] * get["index_head_dim"],
            "moe_intermediate_size * n_shared_experts": get["moe_intermediate_size"] * get["n_shared_experts"]}
    return [f"{k}={d} is not a multiple of the FP8 block {block}: exllamav3 would dequantize that linear's .scale "
            f"grid with another block than DeepSeek's ceil grid" for k, d in dims.items()
            if any(d > b and d % b for b in block)]


def _v4_kinds(config: dict, n_layers: int) -> list[str] | None:
    """A layer's attention type and routing (its first num_hash_layers route by token id, ``ffn.gate.tid2eid``, the
    rest by score, ``ffn.gate.bias``): what decides which tensors a DeepSeek-V4 layer holds."""
    attention, n_hash = _v4_attention(config, n_layers), config.get("num_hash_layers", 3)
    if attention is None or not isinstance(n_hash, int):
        return None
    return [f"{a}, {'hash' if l < n_hash else 'score'} routing" for l, a in enumerate(attention)]


# transformers 5.24's DeepseekV4ForCausalLM loads the release's names through its conversion mapping
# (conversion_mapping.py "deepseek_v4": embed -> embed_tokens, attn -> self_attn, w1/w3 fused into gate_up_proj, ...),
# but its reverse conversion gives back the names it saves, not the release's: ``model.`` before every decoder tensor,
# its own top-level names, and the attention's kv_norm as ``norm`` (its ``.norm.`` -> ``.kv_norm.`` rule read
# backwards). fq's runtime hands it these, so that every tensor reads back under the name it was handed.
_V4_SAVED_TOP = {"embed.weight": "model.embed_tokens.weight", "head.weight": "head.weight",
                 "norm.weight": "model.norm.weight", "hc_head_fn": "model.hc_head.hc_fn",
                 "hc_head_base": "model.hc_head.hc_base", "hc_head_scale": "model.hc_head.hc_scale"}
_V4_KV_NORM = re.compile(r"layers\.(\d+)\.attn\.kv_norm\.weight")


def _v4_transformers_name(name: str) -> str | None:
    """A release tensor's name as transformers 5.24 saves DeepSeek-V4; None for the MTP blocks (``mtp.{i}.*``), which
    its model does not build (it ignores them on load)."""
    if name.startswith("mtp."):
        return None
    if name in _V4_SAVED_TOP:
        return _V4_SAVED_TOP[name]
    m = _V4_KV_NORM.fullmatch(name)
    return f"model.layers.{m[1]}.attn.norm.weight" if m else f"model.{name}"


_TRANSFORMERS_SAVED = ("transformers 5.24 saves DeepSeek-V4 under other names (`model.layers.{L}.*`, "
                       "`model.embed_tokens`, `model.hc_head.*`, the attention's `kv_norm` as `norm`) than DeepSeek's "
                       "release and exllamav3 1.6.5's DeepseekV4ForCausalLM read (`layers.{L}.*`, `embed`, "
                       "`hc_head_*`, `attn.kv_norm`): a base of it would not load. Rename its tensors as the release "
                       "names them (transformers loads those too)")

DEEPSEEK_V4 = Family(
    name="deepseek_v4", title="DeepSeek-V4", architectures=("DeepseekV4ForCausalLM",), model_types=("deepseek_v4",),
    # DeepSeek's own tensor names, as the release stores them and exllamav3 reads them (layers.{L}.attn.*,
    # layers.{L}.ffn.{experts,gate,shared_experts}.*, embed, head, norm, hc_head_*, mtp.{i}.*: the next-token-prediction
    # blocks lie outside the layers, skeleton, their experts kept as published)
    layout=DEEPSEEK_NATIVE, experts_keys=("n_routed_experts", "num_local_experts"),
    inter_keys=("moe_intermediate_size",), moe_rule=AllLayers(), router="ffn.gate", exl3="DeepseekV4ForCausalLM",
    # the release (config: quantization_config fp8 / ue8m0 / [128, 128] and expert_dtype fp4): routed experts FP4
    # (int8 (out, in/2) beside a ue8m0 .scale (out, in/32)), the other linears FP8 e4m3 beside a ue8m0 .scale per
    # 128x128 block; fq.model.formats reads both, and exllamav3 1.6.5 dequantizes the FP8 ones a base keeps
    scale_suffix="scale", head="head.weight", layer_kinds=_v4_kinds, transformers_names=_v4_transformers_name,
    unread_layouts=((r"model\.", _TRANSFORMERS_SAVED),),
    published_formats="FP4 e2m1 experts (int8, a ue8m0 `.scale` per 32 inputs) + FP8 e4m3 linears (a ue8m0 `.scale` "
                      "per 128x128 block), as DeepSeek publishes them; bf16 / fp16 / fp32 under the release's names",
    # every layer MoE: the first num_hash_layers route by a token-id table (ffn.gate.tid2eid), the rest by a
    # sqrt-softplus router with a score bias (ffn.gate.bias); clamped SwiGLU experts (swiglu_limit), a shared expert.
    # exllamav3 defaults routed_scaling_factor to 1.0 (transformers: 1.5) and needs one KV head (assert_cfg:
    # sqrtsoftplus, noaux_tc)
    exl3_needs=Exl3Needs(stated=("n_routed_experts", "moe_intermediate_size", "num_experts_per_tok", "q_lora_rank",
                                 "routed_scaling_factor", "qk_rope_head_dim"),
                         values=(("num_key_value_heads", (1,), 1),), check=_v4_schedule),
    # no calibration chain: a layer's input and output are hc_mult hyper-connection streams [rows, cols, hc_mult,
    # hidden] (the embedding expanded before layer 0, hc_head after the last), where the chain carries [rows, cols,
    # hidden]; the hash-routed layers take the token ids (tid2eid[input_ids]), which the chain does not pass a layer;
    # the attention takes {main, compress} position embeddings and runs eager only. It would take hidden-state files
    # of the streams, the token ids beside them, and the experts' clamped activation (act_inputs: _apply_gate)
    calibration=None)
