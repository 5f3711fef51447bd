"""The calibration chain (fq.hessian) on every registered family besides GLM (tests/test_hessian.py covers
Glm4MoeForCausalLM and GLM-5's GlmMoeDsaForCausalLM) and Qwen3.5-MoE's VL checkpoint (tests/test_qwen3_5_vl.py), the
vision-language wrappers Qwen3-VL-MoE and GLM-4.5V run on tokens alone: on a tiny random checkpoint that
transformers itself builds and saves in several shards, the layer modules equal the full model's layers tensor for
tensor, the chain reproduces the full model's layer outputs, the input Hessian is XᵀX of the MoE block input hooked
on the full model, and the down-projection Hessians (all experts and routed-only) are those of the down projection's
input as the full model's own experts module computes it (checked against that module's output)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fq.errors import FqError
from fq.hessian import capture, layer as layer_mod

ROWS, COLS = 2, 32
VOCAB, HIDDEN, INTER, N_EXPERTS, TOP_K = 512, 256, 128, 8, 2
COMMON = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256, num_experts_per_tok=TOP_K, bos_token_id=0,
              eos_token_id=1, pad_token_id=None)
MLA = dict(num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
           v_head_dim=32)

# model_type -> (architecture, transformers config arguments, the MoE layers)
FAMILIES = {
    # group-limited routing: 4 groups of 2 experts, the top-2 chosen within the best 2 groups
    "deepseek_v3": ("DeepseekV3ForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, first_k_dense_replace=1, n_routed_experts=N_EXPERTS,
        n_shared_experts=1, n_group=4, topk_group=2, **MLA), [1, 2]),
    "qwen3_moe": ("Qwen3MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, head_dim=64, mlp_only_layers=[0],
        norm_topk_prob=True), [1, 2]),
    # a sliding window shorter than the rows: the chain must make the sliding mask the model makes
    "mixtral": ("MixtralForCausalLM", dict(intermediate_size=INTER, num_local_experts=N_EXPERTS, sliding_window=16),
                [0, 1, 2]),
    "minimax_m2": ("MiniMaxM2ForCausalLM", dict(intermediate_size=INTER, num_local_experts=N_EXPERTS, head_dim=64),
                   [0, 1, 2]),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, n_routed_experts=N_EXPERTS, n_shared_experts=1, **MLA),
        [1, 2]),
    "qwen3_next": ("Qwen3NextForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS,
        shared_expert_intermediate_size=INTER, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention"], mlp_only_layers=[0]), [1, 2]),
    # sliding (layers 0, 2) and full (layer 1) attention with sinks; swiglu_limit low enough that the clamp acts
    "gpt_oss": ("GptOssForCausalLM", dict(intermediate_size=INTER, num_local_experts=N_EXPERTS, head_dim=64,
                                          sliding_window=16, swiglu_limit=0.3), [0, 1, 2]),
    # layer 2 sliding (max_window_layers)
    "dots1": ("Dots1ForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, first_k_dense_replace=1, n_routed_experts=N_EXPERTS,
        n_shared_experts=1, head_dim=64, sliding_window=16, max_window_layers=2), [1, 2]),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, moe_num_experts=N_EXPERTS, moe_k=TOP_K,
        moe_layer_start_index=1, moe_num_shared_experts=1, head_dim=64), [1, 2]),
    # a gated shared expert, qkv biases, layer 0 dense (mlp_only_layers); layers 0 and 2 sliding (layer_types)
    "qwen2_moe": ("Qwen2MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS,
        shared_expert_intermediate_size=INTER, mlp_only_layers=[0], norm_topk_prob=True, use_sliding_window=True,
        sliding_window=16, max_window_layers=3), [1, 2]),
    # the sparsemixer router (mlp.router, block_sparse_moe.gate on disk), LayerNorms and attention with biases, a
    # sliding window
    "phimoe": ("PhimoeForCausalLM", dict(
        intermediate_size=INTER, num_local_experts=N_EXPERTS, sliding_window=16, attention_bias=True), [0, 1, 2]),
    # group-limited sigmoid routing (4 groups of 2, the best 2) with a score bias, a shared expert
    "solar_open": ("SolarOpenForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, n_routed_experts=N_EXPERTS, n_shared_experts=1,
        n_group=4, topk_group=2, head_dim=64), [0, 1, 2]),
    # MLA, layer 0 dense, group-limited greedy softmax routing (4 groups of 2, the best 2), a shared expert
    "deepseek_v2": ("DeepseekV2ForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, first_k_dense_replace=1, n_routed_experts=N_EXPERTS,
        n_shared_experts=1, topk_method="group_limited_greedy", n_group=4, topk_group=2, **MLA), [1, 2]),
    # MLA with a DSA indexer whose top-8 of 32 columns makes the attention sparse; group-limited sigmoid routing
    "deepseek_v32": ("DeepseekV32ForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, first_k_dense_replace=1, n_routed_experts=N_EXPERTS,
        n_shared_experts=1, n_group=4, topk_group=2, index_topk=8, index_head_dim=32, index_n_heads=2, **MLA),
        [1, 2]),
    # gated-delta-net (layers 0, 2) and gated full attention (layer 1), every layer MoE with a gated shared expert
    "qwen3_5_moe_text": ("Qwen3_5MoeForCausalLM", dict(
        moe_intermediate_size=INTER, num_experts=N_EXPERTS, shared_expert_intermediate_size=INTER, head_dim=64,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=32, linear_value_head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention"]), [0, 1, 2]),
    # lightning attention (layers 0, 2: blocks of 16, so that 32 columns carry state across blocks) and sliding
    # softmax attention (layer 1), residual scales that act; layer 0's decay buffers are left out of the checkpoint
    # (DERIVED_LEFT_OUT), layer 2's kept
    "minimax": ("MiniMaxForCausalLM", dict(
        intermediate_size=INTER, num_local_experts=N_EXPERTS, head_dim=64, block_size=16, sliding_window=16,
        layer_types=["linear_attention", "full_attention", "linear_attention"], linear_attn_alpha_factor=1.5,
        linear_attn_beta_factor=0.75, full_attn_alpha_factor=1.25, mlp_alpha_factor=0.5, mlp_beta_factor=2.0),
        [0, 1, 2]),
    # Phi-3.5-MoE's long-context rotary, config.json as Phi-3.5-MoE publishes it (rope_scaling, type longrope):
    # 32 columns are past original_max_position_embeddings (16), the long regime (test_phimoe_longrope_short_rows:
    # the short one)
    "phimoe-longrope": ("PhimoeForCausalLM", dict(
        intermediate_size=INTER, num_local_experts=N_EXPERTS, sliding_window=16, attention_bias=True,
        rope_parameters=dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=16,
                             short_factor=[1.0 + 0.05 * i for i in range(32)],
                             long_factor=[2.0 + 0.25 * i for i in range(32)], short_mscale=1.1, long_mscale=1.3)),
        [0, 1, 2]),
    # Trinity (AFMoE): layer 0 dense, sliding (RoPE) and full (no RoPE) attention with an output gate, four norms per
    # layer, the muP embedding scale, a sigmoid router with its score bias (mlp.expert_bias), a shared expert
    "afmoe": ("AfmoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, num_shared_experts=1,
        num_dense_layers=1, head_dim=64, sliding_window=16, global_attn_every_n_layers=2, mup_enabled=True,
        route_scale=2.5), [1, 2]),
    # Laguna: sliding (layers 0, 2) and full (layer 1) attention, each type with its own RoPE (full: partial, another
    # theta) and its own head count, a softplus gate per head; the score bias stored under the experts prefix
    "laguna": ("LagunaForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, shared_expert_intermediate_size=INTER,
        num_experts=N_EXPERTS, head_dim=64, gating="per-head", num_attention_heads_per_layer=[4, 8, 4],
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], sliding_window=16,
        moe_routed_scaling_factor=2.5), [1, 2]),
    # Hy3: layer 0 dense (mlp_layer_types), the router and its score bias under their published names
    # (mlp.router.gate, mlp.expert_bias), the shared expert mlp.shared_mlp, q/k norms
    "hy_v3": ("HYV3ForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, num_shared_experts=1, head_dim=64,
        router_scaling_factor=2.826), [1, 2]),
    # full attention (layer 0, theta 5e6) and sliding attention with sinks and twice the KV heads (layers 1, 2,
    # theta 1e4), a window shorter than the rows, Q/K wider than V, a value scale; layer 0 dense; sigmoid routing
    # with a score bias
    "mimo_v2_flash": ("MiMoV2FlashForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, n_routed_experts=N_EXPERTS, head_dim=96, v_head_dim=64,
        sliding_window=16), [1, 2]),
    # short convolutions (layers 0, 2) and attention with q/k norms (layer 1); layer 0 dense (num_dense_layers);
    # sigmoid routing with a score bias (feed_forward.expert_bias)
    "lfm2_moe": ("Lfm2MoeForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, num_dense_layers=1,
        layer_types=["conv", "full_attention", "conv"]), [1, 2]),
    # KDA (layers 0, 2: one chunk of 64 with 32 columns) and MLA without positional encoding (layer 1), layer 0 dense
    # (first_k_dense_replace), group-limited sigmoid routing (4 groups of 2, the best 2) with a score bias, a shared
    # expert; saved by transformers, so layer 0's dense MLP is block_sparse_moe.* (Moonshot's mlp.*:
    # tests/kits/familykit)
    "kimi_linear": ("KimiLinearForCausalLM", dict(
        intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, num_shared_experts=1,
        num_expert_group=4, topk_group=2, first_k_dense_replace=1, **dict(MLA, q_lora_rank=None),
        linear_attn_config=dict(kda_layers=[1, 3], full_attn_layers=[2], num_heads=2, head_dim=32,
                                short_conv_kernel_size=4)), [1, 2]),
    # vision-language wrappers (text_config, vision_config: COMMON goes to the language model's), run on tokens alone:
    # Qwen3-MoE's layers (layer 0 dense: mlp_only_layers), the fused experts stored (E, in, out), a multimodal rotary
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", dict(
        text_config=dict(intermediate_size=512, moe_intermediate_size=INTER, num_experts=N_EXPERTS, head_dim=64,
                         mlp_only_layers=[0], rope_parameters=dict(rope_type="default", rope_theta=5000000.0,
                                                                   mrope_section=[12, 10, 10], mrope_interleaved=True)),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=64, deepstack_visual_indexes=[0])), [1, 2]),
    # GLM-4.5-Air's layers (layer 0 dense, group-limited sigmoid routing: 4 groups of 2, the best 2, a score bias, a
    # shared expert, qkv biases) with a partial multimodal rotary
    "glm4v_moe": ("Glm4vMoeForConditionalGeneration", dict(
        text_config=dict(intermediate_size=512, moe_intermediate_size=INTER, n_routed_experts=N_EXPERTS,
                         n_shared_experts=1, first_k_dense_replace=1, n_group=4, topk_group=2, head_dim=64,
                         routed_scaling_factor=2.5, rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                                         partial_rotary_factor=0.5,
                                                                         mrope_section=[4, 6, 6])),
        vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2, out_hidden_size=HIDDEN,
                           image_size=56)), [1, 2]),
}
# parameters transformers' _init_weights starts at zero, made non-zero so that they act (AFMoE's router)
NOISY = {"afmoe": ("router.gate.weight",)}
# layer -> the derived buffers (Calibration.derived_buffers) removed from the saved checkpoint
DERIVED_LEFT_OUT = {"minimax": {0: ("self_attn.slope_rate", "self_attn.query_decay", "self_attn.key_decay",
                                    "self_attn.diagonal_decay")}}


def _model_type(case: str) -> str:
    return case.split("-")[0]


def _close(a, b, rtol=1e-5):
    """max |a - b| relative to max |b| (tests/test_hessian.py's measure)."""
    return float((a - b).abs().max()) <= rtol * float(b.abs().max())


def _save_tiny(case: str, d: Path) -> Path:
    """A tiny random checkpoint of ``case``'s model type, saved by transformers in several shards; every bias (the
    routers' e_score_correction_bias, gpt-oss's router, expert and attention biases) and gpt-oss's attention sinks
    made non-zero, so that they act. A longrope config.json is rewritten as published (rope_scaling, rope_theta);
    the DERIVED_LEFT_OUT buffers are removed from the shards and the index."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    name, args, _ = FAMILIES[case]
    if "text_config" in args:  # a vision-language wrapper: the common keys are its language model's
        cfg = AutoConfig.for_model(_model_type(case), **{**args, "text_config": {**COMMON, **args["text_config"]}})
    else:
        cfg = AutoConfig.for_model(_model_type(case), **{**COMMON, **args})
    torch.manual_seed(0)
    cls = _model_class(name)
    m = cls.from_config(cfg) if hasattr(cls, "from_config") else cls._from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            if name.endswith(("bias", "sinks") + NOISY.get(case, ())):
                t.add_(0.05 * torch.randn(t.shape, generator=g))
    m.save_pretrained(d, max_shard_size="1MB")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 3
    gone = [f"model.layers.{L}.{n}" for L, names in DERIVED_LEFT_OUT.get(case, {}).items() for n in names]
    for shard in sorted({index["weight_map"].pop(n) for n in gone}):
        t = load_file(str(d / shard))
        save_file({k: v for k, v in t.items() if k not in gone}, str(d / shard), metadata={"format": "pt"})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    rope = args.get("rope_parameters", {})
    if rope.get("rope_type") == "longrope":
        c = json.loads((d / "config.json").read_text())
        r = dict(c.pop("rope_parameters"))
        c["rope_theta"] = r.pop("rope_theta")
        r["type"] = r.pop("rope_type")
        c["rope_scaling"] = r
        (d / "config.json").write_text(json.dumps(c))
    return d


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    made: dict = {}

    def get(case: str) -> Path:
        if case not in made:
            made[case] = _save_tiny(case, tmp_path_factory.mktemp(case) / "model")
        return made[case]
    return get


def _tokens(cols: int = COLS):
    return torch.randint(0, VOCAB, (ROWS, cols), generator=torch.Generator().manual_seed(2))


def _model_class(name: str):
    """The class transformers runs a checkpoint of ``name`` with: a causal LM, or a vision-language wrapper's own."""
    import transformers

    from fq.model import families

    family = families.for_config({"architectures": [name]}, "c")
    return getattr(transformers, name) if family.text_config else transformers.AutoModelForCausalLM


def _language_model(m):
    """The decoder stack of ``m`` (embeddings, layers, rotary): a vision-language wrapper's language model."""
    return getattr(m.model, "language_model", m.model)


def _reference(d: Path, arch, tokens=None):
    """The full transformers model (from_pretrained) on the tokens, with hooks: the position embeddings its layers
    get, each layer's output, each MoE block's input, its router's top-k and its experts module's inputs and
    output."""
    m = _model_class(arch.name).from_pretrained(d, dtype=torch.float32).eval()
    return m, hooked_forward(m, _language_model(m).layers, arch, _tokens() if tokens is None else tokens)


def hooked_forward(m, layers, arch, tokens) -> dict:
    """``m`` run on ``tokens``, hooked on its decoder ``layers``: the position embeddings each gets (None where the
    model has none: Kimi-Linear), layer 0's input, each layer's output, each MoE block's input, its router's top-k and
    its experts module's inputs and output."""
    seen: dict = {"layer": {}, "x": {}, "topk": {}, "experts": {}, "pos_embs": {}}

    def pre(L, args, kw):
        seen["pos_embs"][L] = kw.get("position_embeddings")
        if L == 0:
            seen["pos_emb"], seen["in"] = seen["pos_embs"][L], (args[0] if args else kw["hidden_states"]).detach()

    handles = []
    for L, lay in enumerate(layers):
        handles.append(lay.register_forward_pre_hook(lambda _m, a, kw, L=L: pre(L, a, kw), with_kwargs=True))
        handles.append(lay.register_forward_hook(lambda _m, _i, out, L=L: seen["layer"].__setitem__(
            L, (out[0] if isinstance(out, tuple) else out).detach())))
        block = getattr(lay, arch.moe_block)
        if hasattr(block, "experts"):
            handles.append(block.register_forward_pre_hook(lambda _m, args, L=L: seen["x"].__setitem__(
                L, args[0].detach())))
            handles.append(getattr(block, arch.router).register_forward_hook(
                lambda _m, _i, out, L=L: seen["topk"].__setitem__(L, out[-1].detach())))
            handles.append(block.experts.register_forward_hook(lambda _m, args, out, L=L: seen["experts"].__setitem__(
                L, ([a.detach() for a in args], out.detach()))))
    with torch.no_grad():
        m(input_ids=tokens)
    for h in handles:
        h.remove()
    return seen


def _same_position_embeddings(hfc, arch, hidden, seen, layer: int = 0) -> bool:
    """The chain's rotary call for ``layer`` (a fresh rotary module, positions 0..cols-1 of one row, the layer's own
    arguments, as ``capture.advance`` makes it) gives the position embeddings the full model's layer got (broadcast
    over its rows); none where the model has no rotary module (Kimi-Linear)."""
    if arch.rotary_class is None:
        return seen["pos_embs"][layer] is None
    pos = torch.arange(hidden.shape[1]).unsqueeze(0)
    with torch.no_grad():
        mine = layer_mod.position_embeddings(layer_mod.rotary(hfc, arch), hfc, arch, layer, hidden[:1], pos)
    theirs = seen["pos_embs"][layer]
    pairs = zip(mine, theirs) if isinstance(theirs, tuple) else [(mine, theirs)]
    return all(torch.equal(a.expand_as(b), b) for a, b in pairs)


def _expert_act(experts, x, e):
    """Expert e's down-projection input as transformers' experts module computes it, written from the module's own
    layout flags (``use_experts_implementation``: transposed, bias) and its ``_apply_gate``."""
    w = experts.gate_up_proj[e]
    y = x @ w if experts.is_transposed else torch.nn.functional.linear(x, w)
    if experts.has_bias:
        y = y + experts.gate_up_proj_bias[e]
    return experts._apply_gate(y)


def _expert_down(experts, a, e):
    w = experts.down_proj[e]
    y = a @ w if experts.is_transposed else torch.nn.functional.linear(a, w)
    return y + experts.down_proj_bias[e] if experts.has_bias else y


@pytest.mark.parametrize("case", list(FAMILIES))
def test_family_chain_reproduces_the_full_model(checkpoints, case):
    name, _, moe_layers = FAMILIES[case]
    d = checkpoints(case)
    model_type = _model_type(case)
    ckpt = layer_mod.read_checkpoint(d)
    arch = layer_mod.architecture(ckpt.config)
    assert arch.name == name == ckpt.config["architectures"][0]
    assert [L for L in range(3) if arch.is_moe(ckpt.config, L)] == moe_layers
    m, seen = _reference(d, arch)
    lm = _language_model(m)
    hfc = layer_mod.hf_config(ckpt.config)
    # the chain's attention and experts implementations are what from_pretrained picked on the CPU
    assert (hfc._attn_implementation, hfc._experts_implementation) == \
        (lm.config._attn_implementation, lm.config._experts_implementation)
    # every inverse frequency of the chain's rotary module (one per attention type where it keeps several) is the
    # full model's, as it built it (LFM2-MoE names its rotary module pos_emb); Kimi-Linear's layers take none
    _, rot_cls = arch.classes()
    rot = layer_mod.rotary(hfc, arch)
    if rot is None:
        assert not hasattr(lm, "rotary_emb")
    else:
        (theirs,) = [mod for mod in lm.modules() if isinstance(mod, rot_cls)]
        mine = dict(rot.named_buffers())
        assert mine and all(torch.equal(v, theirs.get_buffer(k.replace("inv_freq", "original_inv_freq")))
                            for k, v in mine.items() if k.endswith("inv_freq") and "original" not in k)

    hidden = capture.embed(ckpt, _tokens())
    assert torch.equal(hidden, seen["in"])  # the embeddings as the model's forward hands them to layer 0 (muP)
    assert all(_same_position_embeddings(hfc, arch, hidden, seen, L) for L in range(3))
    for L in range(3):
        tensors, shards = layer_mod.layer_tensors(ckpt, L)
        assert set(shards) == {ckpt.weight_map[n] for n in tensors}
        assert not {f"model.layers.{L}.{n}" for n in DERIVED_LEFT_OUT.get(case, {}).get(L, ())} & set(tensors)
        # the layer module holds exactly the full model's layer (transformers' own checkpoint conversion)
        mine = layer_mod.build_layer(hfc, arch, L, tensors).state_dict()
        theirs = lm.layers[L].state_dict()
        assert sorted(mine) == sorted(theirs), L
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), (L, k)

        out, s = capture.advance(L, hidden, tensors, ckpt.config)
        assert _close(out, seen["layer"][L], 1e-5), L
        assert (s is not None) == (L in moe_layers), L
        if s is not None:
            _, r = capture.advance(L, hidden, tensors, ckpt.config, routed_only=True)
            _check_hessians(lm.layers, arch, seen, L, s, r, model_type)
        hidden = out


def test_phimoe_longrope_both_regimes(checkpoints):
    """Phi-3.5-MoE's longrope: a row of at most original_max_position_embeddings (16) columns takes the short regime
    (short_mscale), a longer one the long regime (long_mscale), as the full model decides from the positions it
    gets; the chain's rotary call, positions 0..cols-1 per row, gives what the full model's layers get at 16 and 17
    columns, and the chain reproduces every layer's output in both (32 columns, with the Hessians:
    test_family_chain_reproduces_the_full_model[phimoe-longrope])."""
    d = checkpoints("phimoe-longrope")
    ckpt = layer_mod.read_checkpoint(d)
    arch = layer_mod.architecture(ckpt.config)
    hfc = layer_mod.hf_config(ckpt.config)
    assert "rope_scaling" in ckpt.config and hfc.rope_parameters["rope_type"] == "longrope"
    for cols, mscale in ((16, 1.1), (17, 1.3)):
        m, seen = _reference(d, arch, _tokens(cols))
        assert m.config.rope_parameters == hfc.rope_parameters
        cos = seen["pos_emb"][0]
        assert torch.allclose(cos[..., 0, :], torch.full_like(cos[..., 0, :], mscale)), cols  # cos(0) · mscale
        hidden = capture.embed(ckpt, _tokens(cols))
        assert _same_position_embeddings(hfc, arch, hidden, seen), cols
        for L in range(3):
            hidden, _ = capture.advance(L, hidden, layer_mod.layer_tensors(ckpt, L)[0], ckpt.config, capture=False)
            assert _close(hidden, seen["layer"][L], 1e-5), (cols, L)


def _check_hessians(layers, arch, seen, L, s, r, model_type):
    block = getattr(layers[L], arch.moe_block)
    experts = block.experts
    x = seen["x"][L].reshape(-1, HIDDEN)
    (ex_in, ex_idx, ex_w), ex_out = seen["experts"][L]
    # the MoE block's input is what its experts receive, and the router's top-k is what routes them
    assert torch.equal(ex_in, x) and torch.equal(ex_idx, seen["topk"][L].reshape(x.shape[0], -1))
    topk = ex_idx
    assert topk.shape == (ROWS * COLS, TOP_K)
    # group-limited: every token's experts within topk_group of the n_group groups
    if model_type in ("deepseek_v3", "deepseek_v2", "solar_open", "deepseek_v32", "kimi_linear", "glm4v_moe"):
        groups = topk // (N_EXPERTS // 4)
        assert all(len(set(g.tolist())) <= 2 for g in groups)

    # the input Hessian: XᵀX of the MoE block input on the full model; the mode changes only the down sums
    xd = x.double()
    assert s.input_count == ROWS * COLS and _close(s.input, xd.T @ xd), L
    assert torch.equal(r.input, s.input)

    # expert e's down-projection input a, as the full model's experts module computes it: its output is
    # Σ_k w_k · down_e(a) over the token's top-k
    with torch.no_grad():
        acts = [_expert_act(experts, ex_in, e) for e in range(N_EXPERTS)]
        rebuilt = torch.zeros_like(ex_out)
        for e in range(N_EXPERTS):
            tok, k = torch.where(topk == e)
            rebuilt.index_add_(0, tok, _expert_down(experts, acts[e][tok], e) * ex_w[tok, k, None])
    assert _close(rebuilt, ex_out, 1e-5), L
    if model_type == "gpt_oss":  # the clamp acts on these activations
        gate_up = ex_in @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]
        assert float(gate_up.detach().abs().max()) > experts.limit and experts.gate_up_proj_bias.detach().any()

    counts = torch.bincount(topk.reshape(-1), minlength=N_EXPERTS).tolist()
    assert s.mode == "all-experts" and r.mode == "routed-only"
    assert s.down.shape == (N_EXPERTS, INTER, INTER) and s.intermediate_size == INTER
    assert s.down_counts == [ROWS * COLS] * N_EXPERTS
    assert r.down_counts == counts and sum(counts) == ROWS * COLS * TOP_K
    for e in range(N_EXPERTS):
        a = acts[e].double()
        assert _close(s.down[e], a.T @ a), (L, e)
        ar = a[(topk == e).any(dim=-1)]
        assert ar.shape[0] == counts[e]
        if counts[e]:
            assert _close(r.down[e], ar.T @ ar), (L, e)
        else:
            assert not r.down[e].any()


def test_kimi_k2_model_type_is_deepseek_v3(checkpoints, tmp_path):
    """Kimi-K2 ships DeepseekV3ForCausalLM with model_type "kimi_k2" (unknown to transformers): the chain builds
    transformers' deepseek_v3 config from it and computes what it computes for the same checkpoint as deepseek_v3."""
    src = checkpoints("deepseek_v3")
    kimi = tmp_path / "kimi"
    shutil.copytree(src, kimi)
    cfg = json.loads((kimi / "config.json").read_text())
    cfg.update(model_type="kimi_k2", auto_map={"AutoConfig": "configuration_deepseek.DeepseekV3Config"})
    (kimi / "config.json").write_text(json.dumps(cfg))
    a, b = layer_mod.read_checkpoint(src), layer_mod.read_checkpoint(kimi)
    assert layer_mod.architecture(b.config).name == "DeepseekV3ForCausalLM"
    assert layer_mod.hf_config(b.config).model_type == "deepseek_v3"
    hidden = capture.embed(a, _tokens())
    assert torch.equal(capture.embed(b, _tokens()), hidden)
    for L in range(2):
        ta, _ = layer_mod.layer_tensors(a, L)
        tb, _ = layer_mod.layer_tensors(b, L)
        out_a, sa = capture.advance(L, hidden, ta, a.config)
        out_b, sb = capture.advance(L, hidden, tb, b.config)
        assert torch.equal(out_a, out_b)
        assert (sa is None) == (sb is None) == (L == 0)
        if sa is not None:
            assert torch.equal(sa.input, sb.input) and torch.equal(sa.down, sb.down)
        hidden = out_a


# config.json as a hub checkpoint may write it: the family's expert count under its own key, the rule's keys only
# where a case sets them (the rest at the config class's defaults)
RULE_CASES = [
    ("deepseek_v3", "DeepseekV3ForCausalLM", {"n_routed_experts": 4},
     [{}, {"first_k_dense_replace": 0}, {"first_k_dense_replace": 2}]),
    ("glm4_moe", "Glm4MoeForCausalLM", {"n_routed_experts": 4}, [{}, {"first_k_dense_replace": 2}]),
    ("qwen3_moe", "Qwen3MoeForCausalLM", {"num_experts": 4},
     [{}, {"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2}, {"decoder_sparse_step": 3},
      {"num_experts": None, "num_local_experts": 4, "mlp_only_layers": [1]}]),  # the spelling transformers writes
    ("qwen3_next", "Qwen3NextForCausalLM", {"num_experts": 4},
     [{}, {"mlp_only_layers": [1]}, {"decoder_sparse_step": 2}]),
    ("glm4_moe_lite", "Glm4MoeLiteForCausalLM", {"n_routed_experts": 4},
     [{}, {"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}, {"first_k_dense_replace": 3}]),
    ("dots1", "Dots1ForCausalLM", {"n_routed_experts": 4, "n_shared_experts": 1},
     [{}, {"first_k_dense_replace": 1}, {"first_k_dense_replace": 3}]),
    ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", {"moe_num_experts": 4},
     [{}, {"moe_layer_start_index": 0}, {"moe_layer_interval": 2},
      {"moe_layer_start_index": 1, "moe_layer_end_index": 2}, {"moe_layer_start_index": 2, "moe_layer_end_index": -1}]),
    ("mixtral", "MixtralForCausalLM", {"num_local_experts": 4}, [{}]),
    ("minimax_m2", "MiniMaxM2ForCausalLM", {"num_local_experts": 4}, [{}]),
    ("gpt_oss", "GptOssForCausalLM", {"num_local_experts": 4}, [{}]),
    ("qwen2_moe", "Qwen2MoeForCausalLM", {"num_experts": 4},
     [{}, {"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2}, {"decoder_sparse_step": 3}]),
    ("phimoe", "PhimoeForCausalLM", {"num_local_experts": 4}, [{}]),
    ("solar_open", "SolarOpenForCausalLM", {"n_routed_experts": 4}, [{}]),
    ("deepseek_v2", "DeepseekV2ForCausalLM", {"n_routed_experts": 4},
     [{}, {"first_k_dense_replace": 1}, {"first_k_dense_replace": 3}]),
    ("deepseek_v32", "DeepseekV32ForCausalLM", {"n_routed_experts": 4},
     [{}, {"first_k_dense_replace": 1}, {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}]),
    ("qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", {"num_experts": 4}, [{}]),
    ("minimax", "MiniMaxForCausalLM", {"num_local_experts": 4}, [{}]),
    ("afmoe", "AfmoeForCausalLM", {"num_experts": 4}, [{}, {"num_dense_layers": 0}, {"num_dense_layers": 2}]),
    ("laguna", "LagunaForCausalLM", {"num_experts": 4},
     [{}, {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}]),
    ("hy_v3", "HYV3ForCausalLM", {"num_experts": 4},
     [{}, {"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]},
      {"num_experts": None, "num_local_experts": 4}]),  # the spelling transformers' attribute_map accepts
    ("mimo_v2_flash", "MiMoV2FlashForCausalLM", {"n_routed_experts": 4},
     [{}, {"mlp_layer_types": ["dense", "dense", "sparse", "sparse"]}, {"mlp_layer_types": ["sparse"] * 4},
      {"first_k_dense_replace": 3}]),  # a key its config class does not read
    ("lfm2_moe", "Lfm2MoeForCausalLM", {"num_experts": 4, "layer_types": ["conv", "full_attention"] * 2},
     [{}, {"num_dense_layers": 0}, {"num_dense_layers": 3}]),
    ("kimi_linear", "KimiLinearForCausalLM", {"num_experts": 4},
     [{}, {"first_k_dense_replace": 0}, {"first_k_dense_replace": 2},
      {"mlp_layer_types": ["dense", "sparse", "dense", "sparse"]}]),
    # vision-language wrappers: the rule's keys in text_config
    ("qwen3_vl_moe", "Qwen3VLMoeForConditionalGeneration", {"num_experts": 4},
     [{}, {"mlp_only_layers": [0, 2]}, {"decoder_sparse_step": 2}, {"decoder_sparse_step": 3},
      {"num_experts": None, "num_local_experts": 4, "mlp_only_layers": [1]}]),
    ("glm4v_moe", "Glm4vMoeForConditionalGeneration", {"n_routed_experts": 4},
     [{}, {"first_k_dense_replace": 0}, {"first_k_dense_replace": 2}]),
]


@pytest.mark.parametrize("model_type, name, base, variants", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_moe_layer_rule_matches_transformers(model_type, name, base, variants):
    """Each family's is_moe, read from config.json's own keys (missing ones at the config class's defaults), says
    what transformers' decoder layer builds (on the meta device), from a hub-style config.json and from the one
    transformers writes."""
    from transformers import AutoConfig

    arch = layer_mod.architecture({"architectures": [name], "model_type": model_type})
    layer_cls, _ = arch.classes()
    small = dict(vocab_size=64, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
                 head_dim=32, intermediate_size=64, moe_intermediate_size=32, num_experts_per_tok=2)
    for over in variants:
        args = {k: v for k, v in {**small, **base, **over}.items() if v is not None}
        if arch.family.text_config:  # a vision-language wrapper: its language model's keys under text_config
            wrapper = AutoConfig.for_model(model_type, text_config=args)
            hfc, raw = wrapper.get_text_config(), {"architectures": [name], "model_type": model_type,
                                                    "text_config": args}
        else:
            wrapper = hfc = AutoConfig.for_model(model_type, **args)
            raw = {"architectures": [name], "model_type": model_type, **args}
        with torch.device("meta"):
            built = [hasattr(getattr(layer_cls(hfc, L), arch.moe_block), "experts") for L in range(4)]
        assert any(built), (model_type, over)
        assert [arch.is_moe(raw, L) for L in range(4)] == built, (model_type, over)
        written = {**wrapper.to_dict(), "architectures": [name]}
        assert [arch.is_moe(written, L) for L in range(4)] == built, (model_type, over, "written")


def test_every_chain_is_checked_against_the_full_model():
    """Each family that declares a calibration chain has a case here, in tests/test_hessian.py (GLM-4.x, GLM-5) or in
    tests/test_qwen3_5_vl.py (Qwen3.5-MoE's vision-language checkpoint)."""
    from fq.model import families

    declared = {f.architectures[0] for f in families.REGISTRY.values() if f.calibration is not None}
    assert declared == {name for name, _, _ in FAMILIES.values()} | {"Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM",
                                                                   "Qwen3_5MoeForConditionalGeneration"}


def test_model_type_must_be_the_architectures():
    # a remote-code config (model_type "minimax", transformers' MiniMax-01 config) beside MiniMaxM2ForCausalLM
    with pytest.raises(FqError, match=r"model_type 'minimax' is not one of MiniMaxM2ForCausalLM's \(minimax_m2\)"):
        layer_mod.architecture({"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax"})
    with pytest.raises(FqError, match=r"architecture 'LlamaForCausalLM' is not a model family fq reads"):
        layer_mod.architecture({"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    assert layer_mod.architecture({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2"}).name == \
        "DeepseekV3ForCausalLM"
