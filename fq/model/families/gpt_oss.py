"""gpt-oss-20b / 120b: fused expert tensors on disk (``mlp.experts.gate_up_proj`` with gate and up interleaved,
``mlp.experts.down_proj``, both with biases; published as MXFP4 ``*_blocks`` / ``*_scales``), router ``mlp.router``
with a bias, sliding and full attention layers with sinks."""
from fq.model.experts import STANDARD
from fq.model.families.base import AllLayers, Calibration, Exl3Needs, Family, FusedExperts, per_layer_types


def _act_inputs(experts, x, e: int):
    """GptOssExperts: gate_up_proj [E, hidden, 2I] (gate and up interleaved) with a bias, then its own clamped
    swiglu (``_apply_gate``: gate <= limit, |up| <= limit, (up + 1)·gate·σ(α·gate))."""
    return experts._apply_gate(x @ experts.gate_up_proj[e] + experts.gate_up_proj_bias[e])


def _intermediate(experts) -> int:
    return int(experts.down_proj.shape[1])  # down_proj [E, I, hidden]


GPT_OSS = Family(
    name="gpt_oss", title="gpt-oss-20b / 120b", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
    layout=STANDARD, experts_keys=("num_local_experts", "num_experts"), inter_keys=("intermediate_size",),
    topk_keys=("num_experts_per_tok", "experts_per_token"),  # the published config.json states both
    moe_rule=AllLayers(), router="mlp.router", exl3="GptOssForCausalLM",
    on_disk="`model.layers.{L}.mlp.experts.{gate_up_proj,down_proj}[_bias]` (E first; MXFP4: `*_blocks`, `*_scales`)",
    # bf16: transformers' (E, in, out), gate and up interleaved along the output; MXFP4: (E, out, in/32, 16) blocks
    fused_experts=FusedExperts(order="in_out", split="interleaved", biases=True, mxfp4=True),
    # exllamav3's gpt-oss class reads an EXL3 expert's bias as mlp.experts.{E}.{gate,up,down}_proj.bias: a base
    # derives those from the skeleton's fused biases (expert_bias.safetensors, fq.provenance.exl3config). The real
    # checkpoints' hidden = intermediate = 2880 is stored zero-padded to 2944, as exllamav3 pads it (fq.codec.shape)
    exl3_needs=Exl3Needs(),
    calibration=Calibration("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssDecoderLayer",
                            "GptOssRotaryEmbedding", fused_experts=True, act_inputs=_act_inputs,
                            intermediate=_intermediate, router="router", mask_type=per_layer_types,
                            attn_implementation="eager", router_score="softmax"))
