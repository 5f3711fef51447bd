"""Source checkpoints from metadata alone: each naming family, GLM-5's shape, and the refusals."""
from __future__ import annotations

import json
import struct

import pytest

from fq.errors import FqError
from fq.model.source import INDEX_NAME, load_sizes, load_source, parse_source
from fq.model.source_synth import glm5_like, synthetic_checkpoint, write_synthetic

SMALL = dict(hidden=256, inter=128, n_experts=8, vocab=1024, shard_bytes=2_000_000)


@pytest.fixture(scope="module")
def glm5():
    c, i, s = glm5_like()
    return parse_source(c, i, s, origin="glm5")


def test_glm5_shape(glm5):
    m = glm5
    assert m.family == "glm_moe_dsa" and m.model_type == "glm_moe_dsa"
    assert m.moe_layers == tuple(range(3, 78)) and m.dense_layers == (0, 1, 2) and m.mtp_layers == ()
    assert m.n_experts == 256
    assert m.expert_shape("gate") == m.expert_shape("up") == (2048, 6144)
    assert m.expert_shape("down") == (6144, 2048)
    assert len(m.expert_names) == 75 * 256 * 3
    # the first shard holds embeddings, lm_head and the dense layers only
    first = m.shards[0]
    assert first in m.skeleton_only_shards
    assert m.shard_expert_bytes(first) == 0
    assert "lm_head.weight" in m.skeleton_tensors and "model.layers.3.mlp.shared_experts.gate_proj.weight" in m.skeleton_tensors
    assert "model.layers.3.mlp.gate.weight" in m.skeleton_tensors
    assert not any(".mlp.experts." in t for t in m.skeleton_tensors)
    # shards straddle layers: some shard holds experts of two consecutive layers
    assert set(m.layer_shards(3)) & set(m.layer_shards(4))
    assert m.expert_bytes == 75 * 256 * 3 * 2048 * 6144 * 2
    assert m.total_bytes == sum(m.shard_sizes.values())
    assert 0 < m.skeleton_bytes < m.total_bytes / 10
    assert m.expert_tensor(10, 7, "down") == "model.layers.10.mlp.experts.7.down_proj.weight"


def test_glm5_mtp_layer_is_moe():
    c, i, s = glm5_like(mtp=True)
    m = parse_source(c, i, s, origin="glm5-mtp")
    assert m.moe_layers == tuple(range(3, 79)) and m.mtp_layers == (78,)
    assert "model.layers.78.eh_proj.weight" in m.skeleton_tensors


def test_qwen3_moe_family():
    c, i, s = synthetic_checkpoint("qwen3_moe", n_layers=4, **SMALL)
    m = parse_source(c, i, s, origin="q")
    assert m.family == "qwen3_moe" and m.moe_layers == (0, 1, 2, 3) and m.n_experts == 8
    assert m.expert_shape("down") == (256, 128)
    c["mlp_only_layers"] = [1]
    with pytest.raises(FqError, match="index has routed experts in layer\\(s\\) 1, which the config makes dense"):
        parse_source(c, i, s, origin="q")


def test_mixtral_family():
    c, i, s = synthetic_checkpoint("mixtral", n_layers=3, **SMALL)
    m = parse_source(c, i, s, origin="mx")
    assert m.family == "mixtral" and m.moe_layers == (0, 1, 2)
    assert m.expert_tensor(1, 2, "gate") == "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    assert m.expert_tensor(1, 2, "up") == "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    assert m.expert_tensor(1, 2, "down") == "model.layers.1.block_sparse_moe.experts.2.w2.weight"
    assert m.expert_shape("gate") == (128, 256)
    assert "model.layers.0.block_sparse_moe.gate.weight" in m.skeleton_tensors


def test_deepseek_first_dense_layers():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=5, first_dense=2, **SMALL)
    m = parse_source(c, i, s, origin="d")
    assert m.moe_layers == (2, 3, 4) and m.dense_layers == (0, 1)
    c["first_k_dense_replace"] = 1
    with pytest.raises(FqError, match="config makes layer\\(s\\) 1 MoE but the index has no routed experts there"):
        parse_source(c, i, s, origin="d")


@pytest.mark.parametrize("field,value", [("moe_intermediate_size", 200), ("hidden_size", 330)])
def test_dims_not_multiple_of_16_refused_naming_field_and_tensor(field, value):
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    c[field] = value
    s = {k: v * 4 for k, v in s.items()}  # sizes must not be what fails
    with pytest.raises(FqError) as e:
        parse_source(c, i, s, origin="d")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("d/config.json: ")
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in msg
    assert f"{field}={value}: {value} is not a multiple of 16" in msg and "128" in msg


def test_dims_multiple_of_16_not_128_are_stored_zero_padded():
    """gpt-oss's 2880 (here 2880 and 320): accepted; the experts are stored at their dims padded to 128, as exllamav3
    pads them, and priced there; a 128-aligned source is its own stored shape."""
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    c["hidden_size"], c["moe_intermediate_size"] = 2880, 320
    s = {k: v * 400 for k, v in s.items()}
    m = parse_source(c, i, s, origin="d")
    assert m.expert_shape("gate") == (320, 2880) and m.stored_shape("gate") == (384, 2944)
    assert m.expert_shape("down") == (2880, 320) and m.stored_shape("down") == (2944, 384) and m.padded
    from fq.planning.plan import encoded_expert_bytes
    assert encoded_expert_bytes(m, 2) == 3 * (384 * 2944 * 2 // 8 + 2 * (384 + 2944) + 4)
    aligned = parse_source(*synthetic_checkpoint("deepseek", n_layers=2, **SMALL), origin="a")
    assert not aligned.padded and aligned.stored_shape("down") == aligned.expert_shape("down") == (256, 128)


def test_missing_expert_tensor_refused():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    del i["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight"]
    with pytest.raises(FqError, match="1 routed expert matrices missing.*layer 1 expert 5 up"):
        parse_source(c, i, s, origin="d")


def test_expert_index_beyond_config_refused():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    c["n_routed_experts"] = 6
    with pytest.raises(FqError, match="expert index [67], but the config has 6 experts"):
        parse_source(c, i, s, origin="d")


def _fp8(c, i, block=(128, 128)):
    """The DeepSeek-V3 layout's metadata: every expert matrix beside its weight_scale_inv."""
    i2 = json.loads(json.dumps(i))
    for name, shard in list(i2["weight_map"].items()):
        if ".mlp.experts." in name:
            i2["weight_map"][name[: -len("weight")] + "weight_scale_inv"] = shard
    q = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block)}
    return {**c, "quantization_config": q}, i2


def test_fp8_block_sources_are_read_with_their_scales():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    c8, i8 = _fp8(c, i)
    m = parse_source(c8, i8, s, origin="d")
    assert m.source_format.kind == "fp8" and m.source_format.block == (128, 128) and m.dtype_bytes == 1
    src = m.expert_source(1, 3, "down", staged=lambda shard: f"/stage/{shard}")
    assert src.tensor == "model.layers.1.mlp.experts.3.down_proj.weight"
    assert src.scale == "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv" and src.block == (128, 128)
    assert src.shard.startswith("/stage/") and src.scale_shard.startswith("/stage/")
    assert not any(t.endswith("weight_scale_inv") and ".experts." in t for t in m.skeleton_tensors)
    # fp8 weights and float32 scales: (256*128 + 4 * 2*1) bytes per matrix
    assert m.expert_matrix_bytes("gate") == 256 * 128 + 4 * (128 // 128) * (256 // 128)
    assert m.expert_bytes == 3 * m.expert_matrix_bytes("gate") * 8 * 2


def test_quantized_and_unsupported_expert_tensors_refused():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    with pytest.raises(FqError, match="quantization_config.quant_method 'awq' is not a source format fq reads"):
        parse_source({**c, "quantization_config": {"quant_method": "awq"}}, i, s, origin="d")
    with pytest.raises(FqError, match="weight_block_size: expected \\[rows, cols\\].*got None"):
        parse_source({**c, "quantization_config": {"quant_method": "fp8"}}, i, s, origin="d")
    c8, i8 = _fp8(c, i)
    with pytest.raises(FqError, match="fmt 'e5m2': fq reads fp8 e4m3 weights only"):
        parse_source({**c8, "quantization_config": {**c8["quantization_config"], "fmt": "e5m2"}}, i8, s, origin="d")
    with pytest.raises(FqError, match="the FP8 block 96x96 .*does not divide it"):
        parse_source(*_fp8(c, i, block=(96, 96)), s, origin="d")
    del i8["weight_map"]["model.layers.1.mlp.experts.5.up_proj.weight_scale_inv"]
    with pytest.raises(FqError, match="experts.5.up_proj.weight' has no weight_scale_inv .*quantization_config is fp8"):
        parse_source(c8, i8, s, origin="d")
    # a scale without an fp8 config, a bias, a fused tensor: named, never silently skeleton
    for extra, want in (("model.layers.0.mlp.experts.0.gate_proj.weight_scale_inv", "no FP8 quantization_config"),
                        ("model.layers.0.mlp.experts.0.gate_proj.bias", "not 'bias'"),
                        ("model.layers.0.mlp.experts.gate_up_proj", "is not one expert's gate_proj/up_proj/down_proj")):
        i2 = json.loads(json.dumps(i))
        i2["weight_map"][extra] = next(iter(s))
        with pytest.raises(FqError, match=want):
            parse_source(c, i2, s, origin="d")


def test_unregistered_architecture_refused_by_name():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    with pytest.raises(FqError, match="architecture 'Llama4ForCausalLM' is not a model family fq reads; supported: "
                                      ".*DeepseekV3ForCausalLM.*Glm4MoeForCausalLM"):
        parse_source({**c, "architectures": ["Llama4ForCausalLM"]}, i, s, origin="d")
    with pytest.raises(FqError, match="model_type 'glm4_moe' is not one of DeepseekV3ForCausalLM's"):
        parse_source({**c, "model_type": "glm4_moe"}, i, s, origin="d")
    kimi = parse_source({**c, "model_type": "kimi_k2"}, i, s, origin="d")
    assert kimi.family == "deepseek_v3" and kimi.model_type == "kimi_k2"


def test_config_field_errors_are_precise():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    with pytest.raises(FqError, match="config.json: field 'n_routed_experts': expected an integer >= 1, got '8'"):
        parse_source({**c, "n_routed_experts": "8"}, i, s, origin="d")
    with pytest.raises(FqError, match="config.json: torch_dtype: expected one of"):
        parse_source({**c, "torch_dtype": "float8"}, i, s, origin="d")
    c2 = dict(c)
    del c2["n_routed_experts"]
    with pytest.raises(FqError, match="field 'n_routed_experts' or 'num_local_experts' missing"):
        parse_source(c2, i, s, origin="d")
    with pytest.raises(FqError, match="n_routed_experts=8, num_local_experts=4: these fields name the same value"):
        parse_source({**c, "num_local_experts": 4}, i, s, origin="d")
    q = synthetic_checkpoint("qwen3_moe", n_layers=2, **SMALL)
    c3 = {k: v for k, v in q[0].items() if k != "num_experts"}
    assert parse_source({**c3, "num_local_experts": 8}, q[1], q[2], origin="q").n_experts == 8  # transformers 5.x


def test_shard_sizes_checked():
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    shard = sorted(s)[-1]
    with pytest.raises(FqError, match=f"no size for shard {shard}"):
        parse_source(c, i, {k: v for k, v in s.items() if k != shard}, origin="d")
    with pytest.raises(FqError, match=f"shard {shard} is 10 bytes, less than the .* bytes of routed expert tensors"):
        parse_source(c, i, {**s, shard: 10}, origin="d")
    bad = json.loads(json.dumps(i))
    bad["weight_map"]["lm_head.weight"] = "../evil.safetensors"
    with pytest.raises(FqError, match="plain shard file name"):
        parse_source(c, bad, s, origin="d")


def test_load_from_directory_with_sparse_shards(tmp_path):
    c, i, s = synthetic_checkpoint("qwen3_moe", n_layers=2, **SMALL)
    write_synthetic(tmp_path, c, i, s)
    with pytest.raises(FqError, match="not on disk; pass its size in a listing"):
        load_source(tmp_path)
    m = load_source(tmp_path, sizes=load_sizes(tmp_path / "sizes.json"))
    for name, size in s.items():  # sparse files: sizes from the filesystem, no payload written
        with open(tmp_path / name, "wb") as fh:
            fh.truncate(size)
    m2 = load_source(tmp_path)
    assert m2.shard_sizes == m.shard_sizes
    assert m2.revision == m.revision and m.revision.startswith("local:sha256:")
    assert load_source(tmp_path, revision="abc123").revision == "abc123"
    with pytest.raises(FqError, match="revision"):
        load_source(tmp_path, revision="a b")


def test_single_safetensors_file_header_only(tmp_path):
    c, i, s = synthetic_checkpoint("mixtral", n_layers=1, **{**SMALL, "n_experts": 2})
    header = {name: {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]} for name in i["weight_map"]}
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header).encode()
    (tmp_path / "config.json").write_text(json.dumps(c))
    with open(tmp_path / "model.safetensors", "wb") as fh:
        fh.write(struct.pack("<Q", len(raw)) + raw)
        fh.truncate(sum(s.values()))  # payload never read
    m = load_source(tmp_path)
    assert m.shards == ("model.safetensors",) and m.moe_layers == (0,)


def test_sizes_listing_formats(tmp_path):
    p = tmp_path / "s.json"
    p.write_text(json.dumps({"a": 1, "b": 2}))
    assert load_sizes(p) == {"a": 1, "b": 2}
    p.write_text(json.dumps([{"path": "a", "size": 1}, {"path": "b", "size": 2, "lfs": {}}]))
    assert load_sizes(p) == {"a": 1, "b": 2}
    p.write_text(json.dumps({"files": {"a": {"size": 1, "sha256": "x"}}}))
    assert load_sizes(p) == {"a": 1}
    p.write_text(json.dumps({"a": "1"}))
    with pytest.raises(FqError, match="size of 'a': expected a non-negative integer"):
        load_sizes(p)


def test_hub_repo_offline_is_a_clear_error(monkeypatch, tmp_path):
    from huggingface_hub import constants

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(FqError, match="zai-org/GLM-5: not a local directory, and the Hugging Face hub is not available offline"):
        load_source("zai-org/GLM-5")
    with pytest.raises(FqError, match="not a directory"):
        load_source("no/such/dir/here")


def test_no_index_no_single_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FqError, match=f"neither {INDEX_NAME}"):
        load_source(tmp_path)
