"""Source checkpoints from metadata alone: each naming family, GLM-5's shape, and the refusals."""
from __future__ import annotations

import json
import struct

import pytest

from fq.errors import FqError
from fq.model.source import INDEX_NAME, load_sizes, load_source, parse_source
from fq.model.source_synth import glm5_like, synthetic_checkpoint, write_sparse_shards, write_synthetic

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
    on_disk = write_sparse_shards(tmp_path, c, i)  # real headers over holes: sizes from the filesystem, no payload
    m2 = load_source(tmp_path)
    assert m2.shard_sizes == on_disk and set(on_disk) == set(m.shard_sizes)
    assert m2.revision == m.revision and m.revision.startswith("local:sha256:")
    assert load_source(tmp_path, revision="abc123").revision == "abc123"
    with pytest.raises(FqError, match="revision"):
        load_source(tmp_path, revision="a b")


def test_single_safetensors_file_header_only(tmp_path):
    c, i, s = synthetic_checkpoint("mixtral", n_layers=1, **{**SMALL, "n_experts": 2})
    (tmp_path / "config.json").write_text(json.dumps(c))
    write_sparse_shards(tmp_path, c, {"weight_map": {name: "model.safetensors" for name in i["weight_map"]}})
    m = load_source(tmp_path)  # the header is read (fq's reader), the payload never
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


# -- hostile and careless configs and shards (issue 42): refused by name, before anything is built per count ------

def _gpt_oss(n_experts: int = 8, n_layers: int = 2):
    """(config, index, sizes) of a tiny gpt-oss checkpoint: bf16 experts fused per layer (E first), 1 MB shards."""
    c = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 256,
         "intermediate_size": 128, "num_local_experts": n_experts, "num_experts_per_tok": 2,
         "num_hidden_layers": n_layers, "torch_dtype": "bfloat16"}
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    wm = {t: first for t in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight")}
    for layer in range(n_layers):
        for t in ("input_layernorm.weight", "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj",
                  "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj", "mlp.experts.down_proj_bias"):
            wm[f"model.layers.{layer}.{t}"] = second
    return c, {"weight_map": wm}, {first: 1_000_000, second: 4_000_000}


# Run under a 512 MiB address-space cap: a count that reached a list or dict per (layer, expert) would end in a
# MemoryError (it took 13-22 s to get there and grew without bound uncapped), not in the FqError expected.
_CAPPED = r"""
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))
from fq.errors import FqError
from fq.model.source import parse_source
for c, i, s in json.loads(sys.stdin.read()):
    try:
        parse_source(c, i, s, origin="d")
        print("accepted")
    except FqError as e:
        print(str(e))
"""


def test_counts_beyond_the_checkpoint_are_refused_before_memory_grows():
    import subprocess
    import sys

    cases = []
    for field in ("n_routed_experts", "num_hidden_layers"):
        c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
        cases.append(({**c, field: 10**9}, i, s))
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)  # an expert number 10^8 in the index itself
    i = json.loads(json.dumps(i))
    i["weight_map"]["model.layers.1.mlp.experts.99999999.gate_proj.weight"] = next(iter(s))
    cases.append(({**c, "n_routed_experts": 10**8}, i, s))
    c, i, s = _gpt_oss()  # fused experts: the index cannot count them; the shards' bytes bound them
    cases.append(({**c, "num_local_experts": 10**9}, i, s))
    cases.append(_gpt_oss())
    run = subprocess.run([sys.executable, "-c", _CAPPED], input=json.dumps(cases), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    experts, layers, far, fused, fine = run.stdout.splitlines()
    assert experts == ("d/config.json: field 'n_routed_experts': 1000000000 routed experts per MoE layer, but "
                       "d/model.safetensors.index.json names experts 0..7 at most (8); a config must not claim more "
                       "experts than its checkpoint holds")
    assert layers.startswith("d/config.json: field 'num_hidden_layers': 1000000000 decoder layers, but "
                             "d/model.safetensors.index.json names tensors of 2 (layer(s) 0-1 under model.layers.)")
    assert far.startswith("d/model.safetensors.index.json: 599999951 routed expert matrices missing from the index "
                          "(first: layer 0 expert 8 gate, layer 0 expert 8 up"), far
    assert fused.startswith("d/config.json: field 'num_local_experts': 1000000000 routed experts per MoE layer "
                            "(hidden_size=256, intermediate_size=128) need at least ") and \
        "bytes of fused expert tensors in model-00002-of-00002.safetensors, which is 4000000 bytes" in fused
    assert fine == "accepted"


@pytest.mark.parametrize("top_k,want", [
    (1000, "d/config.json: field 'num_experts_per_tok': top-1000 routing, but n_routed_experts=8: a token cannot be "
           "routed to more experts than a MoE layer has (expected an integer from 1 to 8)"),
    (0, "d/config.json: field 'num_experts_per_tok': expected an integer >= 1, got 0"),
    (-2, "expected an integer >= 1, got -2"),
    (2.5, "expected an integer >= 1, got 2.5"),
], ids=["beyond", "zero", "negative", "fraction"])
def test_top_k_must_be_between_one_and_the_routed_experts(top_k, want):
    c, i, s = synthetic_checkpoint("deepseek", n_layers=2, **SMALL)
    with pytest.raises(FqError) as e:
        parse_source({**c, "num_experts_per_tok": top_k}, i, s, origin="d")
    assert want in str(e.value)
    assert parse_source({**c, "num_experts_per_tok": 8}, i, s, origin="d").n_experts == 8  # every expert: fine
    assert parse_source({**c, "num_experts_per_tok": None}, i, s, origin="d").n_experts == 8  # unstated: the default
    c, i, s = _gpt_oss()  # gpt-oss states it twice (experts_per_token too); Ernie's spelling is moe_k
    with pytest.raises(FqError, match="field 'experts_per_token': top-9 routing, but num_local_experts=8"):
        parse_source({**c, "num_experts_per_tok": None, "experts_per_token": 9}, i, s, origin="d")


def _on_disk(tmp_path, family="deepseek", **over):
    c, i, s = synthetic_checkpoint(family, n_layers=2, **{**SMALL, **over})
    write_synthetic(tmp_path, c, i, s)
    write_sparse_shards(tmp_path, c, i)
    return c, i


def test_shard_headers_are_read_with_fqs_reader_at_plan_time(tmp_path):
    """A shard whose header lies fails load_source (fq plan, fq price, the workflow's DAG) by name, not the first
    job that opens it with safetensors ('header too large')."""
    c, i = _on_disk(tmp_path)
    shard = sorted(set(i["weight_map"].values()))[1]
    with open(tmp_path / shard, "r+b") as fh:
        fh.write(struct.pack("<Q", 2**40))
    with pytest.raises(FqError) as e:
        load_source(tmp_path)
    assert str(e.value).startswith(f"{tmp_path / shard}: header length 1099511627776 does not fit in the file")
    # planned from a sizes listing, a shard not on disk is not read (it is checked when it is staged)
    (tmp_path / shard).unlink()
    assert load_source(tmp_path, sizes=load_sizes(tmp_path / "sizes.json")).shards


def test_the_index_must_name_the_shard_each_tensor_is_in(tmp_path):
    c, i = _on_disk(tmp_path)
    shards = sorted(set(i["weight_map"].values()))
    moved = "model.layers.1.mlp.experts.3.up_proj.weight"
    there, wrong = i["weight_map"][moved], shards[0]
    bad = json.loads(json.dumps(i))
    bad["weight_map"][moved] = wrong
    (tmp_path / INDEX_NAME).write_text(json.dumps(bad))
    with pytest.raises(FqError) as e:
        load_source(tmp_path)
    assert str(e.value) == (f"{tmp_path / there}: holds tensor {moved!r}, which {tmp_path / INDEX_NAME} maps to "
                            f"{wrong}; the index must name the shard each tensor is in")
    bad = json.loads(json.dumps(i))
    bad["weight_map"]["model.layers.0.self_attn.extra.weight"] = shards[0]  # in no shard at all
    (tmp_path / INDEX_NAME).write_text(json.dumps(bad))
    with pytest.raises(FqError, match=r"index.json: weight_map\['model.layers.0.self_attn.extra.weight'\] names "
                                      f"{shards[0]}, but .*{shards[0]} holds no such tensor"):
        load_source(tmp_path)


def test_expert_shapes_and_fused_counts_are_checked_against_the_headers(tmp_path):
    c, i = _on_disk(tmp_path / "d")
    (tmp_path / "d" / "config.json").write_text(json.dumps({**c, "moe_intermediate_size": 256}))
    with pytest.raises(FqError, match=r"d/model-\d{5}-of-\d{5}.safetensors: tensor 'model.layers.0.mlp.experts.0"
                                      r".down_proj.weight' is \[256, 128\], but .*config.json makes a routed expert's "
                                      r"down projection \[256, 256\] \(out, in\) from hidden_size=256 and "
                                      r"moe_intermediate_size=256"):
        load_source(tmp_path / "d")
    c, i, s = _gpt_oss()
    d = write_synthetic(tmp_path / "oss", c, i, s)
    write_sparse_shards(d, c, i)
    assert load_source(d).n_experts == 8
    (d / "config.json").write_text(json.dumps({**c, "num_local_experts": 16}))  # fits the bytes, not the header
    with pytest.raises(FqError, match=r"config.json: field 'num_local_experts': 16 routed experts per MoE layer, but "
                                      r".*/oss/model-00002-of-00002.safetensors: tensor "
                                      r"'model.layers.0.mlp.experts.down_proj' "
                                      r"is \[8, 128, 256\], 8 experts \(its first dimension\)"):
        load_source(d)


def test_jobs_read_source_headers_with_fqs_reader_too(tmp_path):
    """A shard that changed after the plan (a hub shard is first seen when it is staged): the stage job and the
    encode job's reader refuse its header with fq's message, never safetensors' raw error."""
    import hashlib

    from fq.model.formats import ExpertSource, read_matrix
    from fq.workflow.staging import stage_shard

    c, i = _on_disk(tmp_path / "src")
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    shard = i["weight_map"][name]
    path = tmp_path / "src" / shard
    with open(path, "r+b") as fh:
        fh.write(struct.pack("<Q", 2**40))
    with pytest.raises(FqError, match=f"{shard}: header length 1099511627776 does not fit in the file"):
        read_matrix({}, ExpertSource(str(path), name, (128, 256)), "expert 3 up")
    size, digest = path.stat().st_size, hashlib.sha256(path.read_bytes()).hexdigest()
    shards = {shard: {"size": size, "sha256": digest}}
    (tmp_path / "campaign.json").write_text(json.dumps({"source": {"shards": shards}}))
    staged = tmp_path / "staging" / shard
    with pytest.raises(FqError, match=f"{staged}: header length 1099511627776 does not fit in the file"):
        stage_shard(str(tmp_path / "campaign.json"), "local", str(tmp_path / "src"), shard, 0, str(staged))
    assert not staged.exists()
    write_sparse_shards(tmp_path / "src", c, i)  # whole again; a tensor the header lacks is named, not a raw KeyError
    with pytest.raises(FqError, match=f"{shard}: no tensor 'model.layers.1.mlp.experts.99.up_proj.weight'"):
        read_matrix({}, ExpertSource(str(path), name.replace(".3.", ".99."), (128, 256)), "expert 99 up")
