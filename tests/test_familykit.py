"""familykit: tiny random MoE checkpoints of 16 families, and their published FP8 / MXFP4 / Kimi-K2 layouts.

The references are transformers' own: its config classes and models (reload + logits), its fine-grained FP8
dequantization (``Fp8Dequantize._dequantize_one``) and its gpt-oss MXFP4 unpacking (``convert_moe_packed_tensors``).
"""
from __future__ import annotations

import dataclasses
import filecmp
import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from tests.kits import familykit as fk

ARCHS = sorted(fk.ARCHS)
IDS = torch.tensor([[1, 5, 9, 100, 300, 7, 42, 511]])
E2M1_MAX_STEP = 1.0  # widest half-gap of e2m1 (between 4 and 6), in units of the group scale

_EXPERT = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.(?:mlp|block_sparse_moe|feed_forward|ffn)\.experts\."
                     r"(\d+)\.(\w+)\.weight$")
_BYTES = {"BF16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I64": 8}
_FP32_ROUTER = (".mlp.gate.weight", "e_score_correction_bias", ".mlp.router.gate.weight", ".mlp.expert_bias",
                ".feed_forward.expert_bias")
# what else transformers keeps out of bfloat16 for a family (its _keep_in_fp32_modules): Kimi-Linear's router and KDA
# dt_bias; DeepSeek-V4's norms, hyper-connection mixers, sinks and its hash routing table (int64)
_OWN_DTYPES = {"KimiLinearForCausalLM": (".block_sparse_moe.gate.weight", ".self_attn.dt_bias"),
               "DeepseekV4ForCausalLM": None}
_FUSED = re.compile(r"^model\.(?:language_model\.)?layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """arch -> directory of its seed-0 build (every family, built once)."""
    root = tmp_path_factory.mktemp("familykit")
    return {a: fk.build(a, root / a) for a in ARCHS}


def _files(d):
    return sorted(p.name for p in d.iterdir())


def _same_tree(a, b) -> bool:
    return _files(a) == _files(b) and all(filecmp.cmp(a / n, b / n, shallow=False) for n in _files(a))


def _header(d):
    """name -> (dtype, shape, shard) from the safetensors headers of a checkpoint directory."""
    out = {}
    for shard in sorted(set(fk.weight_map(d).values())):
        with safe_open(d / shard, "pt") as f:
            for k in f.keys():
                s = f.get_slice(k)
                out[k] = (s.get_dtype(), tuple(s.get_shape()), shard)
    return out


# --- recipes and builds -------------------------------------------------------------------------------------------

def test_every_requested_family_is_there():
    assert set(ARCHS) >= {
        "Glm4MoeForCausalLM", "GlmMoeDsaForCausalLM", "Glm4MoeLiteForCausalLM", "DeepseekV3ForCausalLM",
        "Qwen3MoeForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM", "MixtralForCausalLM",
        "MiniMaxM2ForCausalLM", "GptOssForCausalLM", "Dots1ForCausalLM", "Ernie4_5_MoeForCausalLM",
        "SolarOpenForCausalLM", "Qwen2MoeForCausalLM", "DeepseekV2ForCausalLM"}
    assert fk.ARCHS["Qwen3_5MoeForCausalLM"].model_type == "qwen3_5_moe_text"


@pytest.mark.parametrize("arch", ARCHS)
def test_recipe_sets_only_keys_the_class_knows(arch):
    import transformers

    r = fk.ARCHS[arch]
    cls = transformers.CONFIG_MAPPING[r.model_type]
    # fields, and both sides of attribute_map (Glm4Moe / DeepseekV3 keep num_mtp_layers as num_nextn_predict_layers)
    fields = {f.name for f in dataclasses.fields(cls)} | set(cls.attribute_map) | set(cls.attribute_map.values())
    # besides fields and aliases: what __post_init__ / convert_rope_params_to_dict consume (MiniMax-M2's legacy
    # rotary_dim is the published key, the class reads it)
    consumed = {"partial_rotary_factor"} | ({"rotary_dim"} if r.model_type == "minimax_m2" else set())
    if r.model_type == "kimi_linear":  # Moonshot's keys, which KimiLinearConfig reads through its kwargs and keeps
        consumed |= {"linear_attn_config", "first_k_dense_replace", "moe_layer_freq", "mla_use_nope",
                     "moe_router_activation_func", "num_nextn_predict_layers"}
    assert set(r.keys) <= fields | consumed, set(r.keys) - fields
    assert set(fk.config_of(arch)) <= set(cls().to_dict()) | consumed


@pytest.mark.parametrize("arch", ARCHS)
def test_build_is_tiny_moe_in_several_bf16_shards(arch, built):
    r, d = fk.ARCHS[arch], built[arch]
    full = json.loads((d / fk.CONFIG).read_text())
    assert full["architectures"] == [arch] and full["model_type"] == r.model_type and full["dtype"] == "bfloat16"
    cfg = fk.text_of(arch, full)  # a vision-language wrapper nests its language model's config
    assert (cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]) == (512, 256, 3)
    assert cfg[r.expert_count_key] == 8 and cfg[r.expert_inter_key] == 128 and full["tie_word_embeddings"] is False
    assert next(cfg[k] for k in ("num_experts_per_tok", "num_experts_per_token", "moe_k") if k in cfg) == 2
    assert cfg["num_attention_heads"] == 4 and cfg["num_key_value_heads"] == r.keys.get("num_key_value_heads", 4)
    assert full == fk.config_of(arch)
    index = json.loads((d / fk.INDEX).read_text())
    head = _header(d)
    assert 8 <= len(set(index["weight_map"].values())) <= 20
    assert {k: v[2] for k, v in head.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(math.prod(shape) * _BYTES[dt] for dt, shape, _ in head.values())
    # bfloat16, but for the routers transformers keeps in float32 (_keep_in_fp32_modules_strict)
    f32 = {n for n, (dt, _, _) in head.items() if dt != "BF16"}
    own = _OWN_DTYPES.get(arch, ())
    assert own is None or all(dt == "F32" and n.endswith(_FP32_ROUTER + own) for n, (dt, _, _) in head.items()
                              if n in f32)

    # routed experts exactly in the MoE layers, 8 of them, (out, in) = (128, 256) / (256, 128)
    experts = {}
    for name, (_, shape, _) in head.items():
        if m := _EXPERT.match(name):
            experts.setdefault(int(m[1]), {}).setdefault(m[3], set()).add((int(m[2]), shape))
        elif m := _FUSED.match(name):
            experts.setdefault(int(m[1]), {})[m[2]] = shape
    assert sorted(experts) == [l for l in range(3) if l not in r.dense_layers]
    for per in experts.values():
        if arch == "GptOssForCausalLM":  # transformers' fused layout: (E, in, out), gate/up interleaved
            assert per == {"gate_up_proj": (8, 256, 256), "down_proj": (8, 128, 256)}
            continue
        if arch == "Qwen3VLMoeForConditionalGeneration":  # as transformers 5.24 saves it: (E, out, in), gate then up
            assert per == {"gate_up_proj": (8, 256, 256), "down_proj": (8, 256, 128)}
            continue
        assert len(per) == 3
        for proj, got in per.items():
            down = proj in ("down_proj", "w2")
            assert got == {(e, (256, 128) if down else (128, 256)) for e in range(8)}, proj
    for l in r.dense_layers:  # LFM2-MoE's dense MLP is feed_forward.w1/w3/w2
        gate = next(n for n in (f"model.layers.{l}.mlp.gate_proj.weight", f"model.layers.{l}.feed_forward.w1.weight",
                                f"model.language_model.layers.{l}.mlp.gate_proj.weight") if n in head)
        assert head[gate][1] == (512, 256)


@pytest.mark.parametrize("arch", ARCHS)
def test_transformers_reloads_build_with_identical_logits(arch, built):
    import transformers

    with torch.no_grad():
        ref = fk.model_of(arch)(IDS).logits
        got = fk.model_class(arch).from_pretrained(built[arch])(IDS).logits
    assert torch.isfinite(ref).all() and ref.float().std() > 0.05
    assert torch.equal(ref, got)


def test_init_has_hf_scale():
    m = fk.model_of("DeepseekV3ForCausalLM")
    for name, p in m.named_parameters():
        if p.ndim == 2 and "embed" not in name:
            assert 0.015 < p.float().std() < 0.025, name


def test_build_is_deterministic_and_seeded(tmp_path, built):
    a = fk.build("GlmMoeDsaForCausalLM", tmp_path / "a")
    assert _same_tree(a, built["GlmMoeDsaForCausalLM"])
    b = fk.build("GlmMoeDsaForCausalLM", tmp_path / "b", seed=1)
    assert _files(a) == _files(b) and not _same_tree(a, b)


@pytest.mark.parametrize("arch", ["Qwen3MoeForCausalLM", "GptOssForCausalLM", "MiniMaxM2ForCausalLM",
                                  "Glm4MoeForCausalLM"])
def test_legacy_keys_config_reloads_the_same(arch, tmp_path, built):
    import transformers

    d = fk.build(arch, tmp_path / arch, legacy_keys=True, extra_config={"fk_marker": 1})
    cfg = json.loads((d / fk.CONFIG).read_text())
    assert cfg["torch_dtype"] == "bfloat16" and "dtype" not in cfg and "rope_parameters" not in cfg
    assert cfg["fk_marker"] == 1 and "rope_theta" in cfg
    if arch == "Qwen3MoeForCausalLM":
        assert cfg["num_experts"] == 8 and "num_local_experts" not in cfg
    if arch == "GptOssForCausalLM":
        assert cfg["rope_scaling"]["rope_type"] == "yarn"
    if arch == "MiniMaxM2ForCausalLM":
        assert cfg["rotary_dim"] == 32
    for n in _files(d):
        if n.endswith(".safetensors"):
            assert filecmp.cmp(d / n, built[arch] / n, shallow=False)
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(d)(IDS).logits
    assert torch.equal(got, fk.model_of(arch)(IDS).logits)


def test_keys_override_the_recipe(tmp_path):
    d = fk.build("Qwen3MoeForCausalLM", tmp_path / "q", keys={"mlp_only_layers": [0]})
    names = fk.weight_map(d)
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.0.mlp.gate.weight" not in names
    assert "model.layers.1.mlp.experts.7.up_proj.weight" in names
    assert json.loads((d / fk.CONFIG).read_text())["mlp_only_layers"] == [0]


# --- FP8 ----------------------------------------------------------------------------------------------------------

def _hf_dequant(q, s):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


def _deepseek_dequant(q, s, block):
    """DeepSeek-V3's weight_dequant (inference/kernel.py), block by block over the ceil grid: w = q * s[i, j]."""
    b0, b1 = block
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            out[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float() * s[i, j]
    return out


def _fp8_close(deq, w, s_full):
    """Within e4m3 rounding: half an ulp of 3 mantissa bits (2^-4 relative), or half the subnormal step."""
    err = (deq - w.float()).abs()
    return bool((err <= 2 ** -4 * w.float().abs() + 2 ** -10 * s_full + 1e-12).all())


@pytest.fixture(scope="module")
def fp8(built, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    return {a: fk.to_fp8(built[a], root / a) for a in ("DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM",
                                                        "Qwen3NextForCausalLM", "GlmMoeDsaForCausalLM")}


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3NextForCausalLM",
                                  "GlmMoeDsaForCausalLM"])
def test_to_fp8_layout(arch, built, fp8):
    src, dst = built[arch], fp8[arch]
    sh, dh = _header(src), _header(dst)
    index = json.loads((dst / fk.INDEX).read_text())
    assert {k: v[2] for k, v in dh.items()} == index["weight_map"]
    assert index["metadata"]["total_size"] == sum(
        math.prod(shape) * _BYTES[dt] for dt, shape, _ in dh.values())
    quantized = set()
    for name, (dt, shape, shard) in sh.items():
        in_layers = name.startswith("model.layers.")
        linear = in_layers and name.endswith(".weight") and len(shape) == 2 and "norm" not in name
        router = name.endswith((".mlp.gate.weight", ".block_sparse_moe.gate.weight", ".shared_expert_gate.weight"))
        if linear and not router:
            quantized.add(name)
            assert dh[name] == ("F8_E4M3", shape, shard)
            assert dh[name + "_scale_inv"] == ("F32", (-(-shape[0] // 128), -(-shape[1] // 128)), shard)
        else:
            assert dh[name] == (dt, shape, shard), name
    assert set(dh) == set(sh) | {n + "_scale_inv" for n in quantized}
    # the attention projections, dense MLP, shared and routed experts all went to fp8
    kinds = {re.sub(r"^model\.layers\.\d+\.|\.\d+\.", ".", n) for n in quantized}
    assert any("experts" in k and "shared" not in k for k in kinds) and any("attn" in k for k in kinds)
    if arch == "DeepseekV3ForCausalLM":
        assert "model.layers.0.mlp.gate_proj.weight" in quantized
        assert "model.layers.1.mlp.shared_experts.up_proj.weight" in quantized
        assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in quantized  # 96 rows: one partial block
    cfg, scfg = json.loads((dst / fk.CONFIG).read_text()), json.loads((src / fk.CONFIG).read_text())
    assert cfg.pop("quantization_config") == {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                              "weight_block_size": [128, 128]}
    assert cfg == scfg and cfg["dtype"] == "bfloat16"
    assert filecmp.cmp(src / "generation_config.json", dst / "generation_config.json", shallow=False)


def test_to_fp8_matches_transformers_dequantization(built, fp8):
    src, dst = fk.load_tensors(built["DeepseekV3ForCausalLM"]), fk.load_tensors(fp8["DeepseekV3ForCausalLM"])
    n = 0
    assert set(dst) == set(src) | {n + "_scale_inv" for n, t in dst.items() if t.dtype == torch.float8_e4m3fn}
    for name, q in dst.items():
        if name.endswith("_scale_inv"):
            continue
        if q.dtype != torch.float8_e4m3fn:
            assert torch.equal(q, src[name]), name
            continue
        s, w = dst[name + "_scale_inv"], src[name]
        deq = _hf_dequant(q, s)
        assert torch.equal(deq, fk.fp8_dequantize(q, s)), name
        s_full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        assert _fp8_close(deq, w, s_full), name
        assert (deq - w.float()).norm() <= 2 ** -4 * w.float().norm()
        # DeepSeek's scale: amax of the block / 448 (here every block is the whole matrix or a 128 band)
        assert torch.allclose(s.max(), w.float().abs().max() / 448, rtol=1e-6)
        n += 1
    assert n > 30


def test_to_fp8_ceil_grid_and_zero_block(built, tmp_path):
    # a block that divides nothing: (96, 80) on 256/128/512-wide matrices
    dst = fk.to_fp8(built["Glm4MoeForCausalLM"], tmp_path / "b", block=(96, 80))
    cfg = json.loads((dst / fk.CONFIG).read_text())
    assert cfg["quantization_config"]["weight_block_size"] == [96, 80]
    src, t = fk.load_tensors(built["Glm4MoeForCausalLM"]), fk.load_tensors(dst)
    for name in ("model.layers.1.mlp.experts.3.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                 "model.layers.2.self_attn.q_proj.weight"):
        q, s, w = t[name], t[name + "_scale_inv"], src[name]
        assert s.shape == (math.ceil(w.shape[0] / 96), math.ceil(w.shape[1] / 80))
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                blk = w[i * 96:(i + 1) * 96, j * 80:(j + 1) * 80].float()
                assert s[i, j] == blk.abs().max() / 448
        deq = _deepseek_dequant(q, s, (96, 80))
        assert torch.equal(deq, fk.fp8_dequantize(q, s, (96, 80)))
        s_full = s.repeat_interleave(96, 0).repeat_interleave(80, 1)[: w.shape[0], : w.shape[1]]
        assert _fp8_close(deq, w, s_full), name
    # zero blocks are guarded (scale 1, codes 0), a partial edge block has its own amax
    w = torch.randn(200, 300) * 0.02
    w[:128, 128:256] = 0
    q, s = fk.fp8_quantize(w.bfloat16())
    assert s.shape == (2, 3) and s[0, 1] == 1 and (q[:128, 128:256].float() == 0).all()
    assert s[1, 2] == w.bfloat16()[128:, 256:].float().abs().max() / 448
    assert _fp8_close(_deepseek_dequant(q, s, (128, 128)), w.bfloat16(),
                      s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :300])


def test_to_fp8_is_deterministic(built, fp8, tmp_path):
    assert _same_tree(fk.to_fp8(built["MiniMaxM2ForCausalLM"], tmp_path / "again"), fp8["MiniMaxM2ForCausalLM"])


# --- MXFP4 (gpt-oss) ----------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def mxfp4(built, tmp_path_factory):
    return fk.to_mxfp4_gptoss(built["GptOssForCausalLM"], tmp_path_factory.mktemp("mxfp4") / "g")


def test_to_mxfp4_layout(built, mxfp4):
    sh, dh = _header(built["GptOssForCausalLM"]), _header(mxfp4)
    index = json.loads((mxfp4 / fk.INDEX).read_text())
    assert {k: v[2] for k, v in dh.items()} == index["weight_map"]
    for name, (dt, shape, shard) in sh.items():
        if _FUSED.match(name):
            e, n_in, n_out = shape
            assert dh[name + "_blocks"] == ("U8", (e, n_out, n_in // 32, 16), shard)
            assert dh[name + "_scales"] == ("U8", (e, n_out, n_in // 32), shard)
            assert name not in dh
        else:
            assert dh[name] == (dt, shape, shard), name
    assert dh["model.layers.0.mlp.experts.gate_up_proj_blocks"][1] == (8, 256, 8, 16)  # (E, 2I, hidden/32, 16)
    assert dh["model.layers.0.mlp.experts.down_proj_blocks"][1] == (8, 256, 4, 16)  # (E, hidden, I/32, 16)
    assert dh["model.layers.0.mlp.experts.gate_up_proj_bias"][:2] == ("BF16", (8, 256))
    cfg = json.loads((mxfp4 / fk.CONFIG).read_text())
    assert cfg["quantization_config"] == {
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
                                   "lm_head"], "quant_method": "mxfp4"}


def test_to_mxfp4_matches_transformers_unpacking(built, mxfp4):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    src, dst = fk.load_tensors(built["GptOssForCausalLM"]), fk.load_tensors(mxfp4)
    for name, w in src.items():
        if not _FUSED.match(name):
            assert torch.equal(dst[name], w), name
            continue
        blocks, scales = dst[name + "_blocks"], dst[name + "_scales"]
        deq = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert deq.shape == w.shape  # transformers' orientation (E, in, out)
        group_scale = torch.exp2(scales.float() - 127).repeat_interleave(32, -1).transpose(1, 2)
        assert ((deq - w.float()).abs() <= E2M1_MAX_STEP * group_scale).all(), name
        assert (deq - w.float()).norm() < 0.2 * w.float().norm()
        # each group's scale is the least power of two putting its amax within 6
        amax = w.float().transpose(1, 2).reshape(*scales.shape, 32).abs().amax(-1)
        step = torch.exp2(scales.float() - 127)
        assert (amax <= 6 * step).all() and (amax > 3 * step).all()


def test_to_mxfp4_loads_in_transformers(mxfp4):
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    m = transformers.AutoModelForCausalLM.from_pretrained(mxfp4, quantization_config=transformers.Mxfp4Config(
        dequantize=True))
    t = fk.load_tensors(mxfp4)
    got = m.model.layers[1].mlp.experts.gate_up_proj.detach()
    want = convert_moe_packed_tensors(t["model.layers.1.mlp.experts.gate_up_proj_blocks"],
                                      t["model.layers.1.mlp.experts.gate_up_proj_scales"], dtype=got.dtype)
    assert torch.equal(got, want)
    with torch.no_grad():
        assert torch.isfinite(m(IDS).logits).all()


def test_mxfp4_codes_exact():
    # values e2m1 holds exactly, at one scale per 32: quantize is lossless, nibbles low-first
    from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

    codes = torch.arange(64) % 16
    w = torch.tensor(FP4_VALUES)[codes].reshape(1, 2, 32) * torch.tensor([[[0.25], [8.0]]])
    w[..., 7] = 6.0 * torch.tensor([0.25, 8.0])  # each group's amax is 6 * its scale
    blocks, scales = fk.mxfp4_quantize(w)
    assert scales.tolist() == [[[125], [130]]]
    assert blocks[0, 0, 0, 0] == (codes[0] | codes[1] << 4)
    assert torch.equal(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32), w.transpose(1, 2))


def test_to_mxfp4_is_deterministic(built, mxfp4, tmp_path):
    assert _same_tree(fk.to_mxfp4_gptoss(built["GptOssForCausalLM"], tmp_path / "again"), mxfp4)


# --- Kimi-K2 ------------------------------------------------------------------------------------------------------

def test_as_kimi_k2(built, fp8, tmp_path):
    src = built["DeepseekV3ForCausalLM"]
    k = fk.as_kimi_k2(src, tmp_path / "k2")
    cfg = json.loads((k / fk.CONFIG).read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["auto_map"]["AutoConfig"] == "configuration_deepseek.DeepseekV3Config"
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_deepseek.DeepseekV3ForCausalLM"
    scfg = json.loads((src / fk.CONFIG).read_text())
    assert {x: v for x, v in cfg.items() if x not in ("model_type", "auto_map")} == {
        x: v for x, v in scfg.items() if x != "model_type"}
    for n in _files(src):
        if n != fk.CONFIG:
            assert filecmp.cmp(src / n, k / n, shallow=False), n
    # with to_fp8: the published Kimi-K2 layout
    kf = fk.as_kimi_k2(fp8["DeepseekV3ForCausalLM"], tmp_path / "k2fp8")
    cfg = json.loads((kf / fk.CONFIG).read_text())
    assert cfg["model_type"] == "kimi_k2" and cfg["quantization_config"]["quant_method"] == "fp8"
    assert _header(kf)["model.layers.1.mlp.experts.0.up_proj.weight"][0] == "F8_E4M3"
    with pytest.raises(ValueError):
        fk.as_kimi_k2(built["Glm4MoeForCausalLM"], tmp_path / "no")
