"""MiMo-V2-Flash (MiMoV2Flash): sliding-window and full attention layers of their own KV widths and rope thetas, sinks
on the sliding ones, a dense layer 0, sigmoid routing with a score bias, per-expert ``mlp.experts.{E}.*_proj``.

Published as ``MiMoV2FlashForCausalLM`` (model_type ``mimo_v2_flash``), FP8 with 128x128 block scales: q/k/v
projections apart, the sinks as ``self_attn.attention_sink_bias`` (transformers' ``self_attn.sinks``), next-token
prediction layers under ``model.mtp.layers.*`` (dense MLPs: skeleton). Its config states the layer pattern as
``hybrid_layer_pattern`` / ``moe_layer_freq``, which transformers 5.24 does not read: its ``layer_types`` and
``mlp_layer_types`` default to the release's (full attention on layer 0 and every 6th, layer 0 dense)."""
from fq.core.targets import EXLLAMAV3
from fq.model.experts import STANDARD
from fq.model.families.base import Calibration, Exl3Needs, Family, LayerTypes, per_layer_types, rope_per_layer_type

MIMO_V2_FLASH = Family(
    name="mimo_v2_flash", title="MiMo-V2-Flash", architectures=("MiMoV2FlashForCausalLM",),
    model_types=("mimo_v2_flash",), layout=STANDARD, experts_keys=("n_routed_experts", "num_local_experts"),
    inter_keys=("moe_intermediate_size",),
    # MiMoV2FlashDecoderLayer: mlp_layer_types[l] == "sparse"; absent, layer 0 dense (first_k_dense_replace unread)
    moe_rule=LayerTypes(default_dense=1, reads_first_k=False),
    # exllamav3's MiMo-V2 class is the fused-qkv releases' (model_type mimo_v2, MiMo-V2.5); its Config asserts
    # architectures[0] is its arch_string exactly
    exl3="MiMoV2ForCausalLM",
    exl3_needs=Exl3Needs(always=f"exllamav3 {EXLLAMAV3}'s MiMo-V2 class loads architectures MiMoV2ForCausalLM "
                                "only (the fused-qkv MiMo-V2 releases: it reads a TP-interleaved self_attn.qkv_proj, V "
                                "padded to head_dim); MiMo-V2-Flash states MiMoV2FlashForCausalLM and stores q_proj, "
                                "k_proj and v_proj apart"),
    # eager attention (no sdpa: sinks); the rotary module keeps one rope per layer type (theta 5e6 full, 1e4 sliding)
    calibration=Calibration("transformers.models.mimo_v2_flash.modeling_mimo_v2_flash", "MiMoV2FlashDecoderLayer",
                            "MiMoV2FlashRotaryEmbedding", mask_type=per_layer_types, attn_implementation="eager",
                            renames=(("self_attn.attention_sink_bias", "self_attn.sinks"),),
                            rotary_kwargs=rope_per_layer_type, router_score="sigmoid"))
