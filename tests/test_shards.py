"""Expert-contiguous safetensors shards: layout, determinism, pinned key sets, the strict reader."""
import hashlib
import json
import struct

import pytest
import torch
from safetensors import safe_open

from fq.errors import FqError
from fq.model.experts import MIXTRAL, STANDARD, ExpertLayout, expert_keys
from fq.model.shards import RawTensor, read_header, read_into_tensors, read_whole, tensors_in_range, write_shard
from fq.provenance.fragments import describe, fragment_filename, skeleton_keys, write_fragment, write_skeleton
from tests.kits.provkit import DIMS, random_set

P = "model.layers.7.mlp.experts"


def _experts(ids, K=2, codebook="mul1", seed=0, layout=STANDARD):
    gen = torch.Generator().manual_seed(seed)
    dims = dict(zip(layout.projections, DIMS.values()))
    return {e: {proj: random_set(o, i, K, codebook, gen) for proj, (o, i) in dims.items()} for e in ids}


def _write(tmp_path, ids=(4, 5, 6), role="base", K=2, codebook="mul1", node="k2", layout=STANDARD, seed=0):
    path = tmp_path / fragment_filename(node, 7, 1)
    experts = _experts(ids, K, codebook, seed, layout)
    info = write_fragment(path, layout=layout, node=node, role=role, layer=7, block=1, K=K, codebook=codebook,
                          experts=experts)
    return path, info, experts


def test_safe_open_reads_fragment_unchanged(tmp_path):
    path, info, experts = _write(tmp_path)
    with safe_open(path, "pt") as f:
        assert f.metadata()["node"] == "k2" and f.metadata()["K"] == "2"
        for e, projs in experts.items():
            for proj, tset in projs.items():
                for s, t in tset.items():
                    assert torch.equal(f.get_tensor(f"{P}.{e}.{proj}.{s}"), t)


def test_every_expert_is_one_contiguous_range_with_its_sha256(tmp_path):
    path, info, _ = _write(tmp_path)
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    assert (8 + n) % 8 == 0, "data must start 8-byte aligned"
    ends = [e.offset + e.length for e in info.experts]
    assert [e.offset for e in info.experts][1:] == ends[:-1] and ends[-1] == len(data)
    for e in info.experts:
        assert hashlib.sha256(data[e.offset:e.offset + e.length]).hexdigest() == e.sha256
    assert info.sha256 == hashlib.sha256(data).hexdigest()
    # header lists tensors in file order: per expert, gate/up/down, trellis|suh|svh|marker
    names = list(json.loads(data[8:8 + n]))[1:]
    assert names == [k for e in (4, 5, 6) for k in expert_keys(STANDARD, 7, e, "mul1")]


def test_one_expert_read_from_its_range_alone(tmp_path):
    path, info, experts = _write(tmp_path)
    e = info.experts[1]
    with open(path, "rb") as fh:
        header = read_header(fh, str(path))
        fh.seek(e.offset)
        data = fh.read(e.length)
    assert hashlib.sha256(data).hexdigest() == e.sha256
    names = expert_keys(STANDARD, 7, 5, "mul1")
    got = tensors_in_range(header, names, e.offset, data)
    assert torch.equal(got[f"{P}.5.down_proj.trellis"], experts[5]["down_proj"]["trellis"])
    assert got[f"{P}.5.up_proj.mul1"].shape == () and int(got[f"{P}.5.up_proj.mul1"]) == -2082680531


def test_same_tensors_same_bytes(tmp_path):
    a, _, _ = _write(tmp_path / "a")
    b, _, _ = _write(tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()


def test_pinned_key_set_base_fragment(tmp_path):
    path, _, _ = _write(tmp_path, ids=(4,), role="base", K=2, codebook="mul1")
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == {
            f"{P}.4.gate_proj.trellis", f"{P}.4.gate_proj.suh", f"{P}.4.gate_proj.svh", f"{P}.4.gate_proj.mul1",
            f"{P}.4.up_proj.trellis", f"{P}.4.up_proj.suh", f"{P}.4.up_proj.svh", f"{P}.4.up_proj.mul1",
            f"{P}.4.down_proj.trellis", f"{P}.4.down_proj.suh", f"{P}.4.down_proj.svh", f"{P}.4.down_proj.mul1",
        }


def test_pinned_key_set_stage_fragment_keeps_hadamard_signs(tmp_path):
    path, _, _ = _write(tmp_path, ids=(5,), role="stage", K=1, codebook="mcg", node="r1")
    with safe_open(path, "pt") as f:
        assert set(f.keys()) == {
            f"{P}.5.gate_proj.trellis", f"{P}.5.gate_proj.suh", f"{P}.5.gate_proj.svh", f"{P}.5.gate_proj.mcg",
            f"{P}.5.up_proj.trellis", f"{P}.5.up_proj.suh", f"{P}.5.up_proj.svh", f"{P}.5.up_proj.mcg",
            f"{P}.5.down_proj.trellis", f"{P}.5.down_proj.suh", f"{P}.5.down_proj.svh", f"{P}.5.down_proj.mcg",
        }
    # 3INST: no marker at all
    path, _, _ = _write(tmp_path / "x", ids=(5,), role="stage", K=2, codebook="3inst", node="r2")
    with safe_open(path, "pt") as f:
        assert {k.rsplit(".", 1)[1] for k in f.keys()} == {"trellis", "suh", "svh"}


def test_pinned_key_set_skeleton(tmp_path):
    source_keys = [
        "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight",
        "model.layers.7.self_attn.q_proj.weight", "model.layers.7.mlp.gate.weight",
        "model.layers.7.mlp.shared_experts.gate_proj.weight",
        "model.layers.7.mlp.experts.0.gate_proj.weight", "model.layers.7.mlp.experts.0.up_proj.weight",
        "model.layers.7.mlp.experts.0.down_proj.weight", "model.layers.7.mlp.experts.31.down_proj.weight",
    ]
    want = ["lm_head.weight", "model.embed_tokens.weight", "model.layers.7.mlp.gate.weight",
            "model.layers.7.mlp.shared_experts.gate_proj.weight", "model.layers.7.self_attn.q_proj.weight",
            "model.norm.weight"]
    assert skeleton_keys(source_keys, STANDARD) == want
    path = tmp_path / "model-00001-of-00002.safetensors"
    tensors = [(k, torch.zeros(2, 2, dtype=torch.bfloat16)) for k in want]
    write_skeleton(path, tensors=tensors, source_shard=path.name)
    with safe_open(path, "pt") as f:
        assert list(f.keys()) == want
        assert f.metadata() == {"format": "fq-fragment/1", "kind": "skeleton", "source_shard": path.name}


def test_mixtral_layout_uses_the_checkpoint_prefix(tmp_path):
    path, _, _ = _write(tmp_path, ids=(0,), layout=MIXTRAL)
    with safe_open(path, "pt") as f:
        assert "model.layers.7.block_sparse_moe.experts.0.w3.trellis" in f.keys()
    assert MIXTRAL.parse("model.layers.7.block_sparse_moe.experts.3.w2.weight") == (7, 3, "w2", "weight")
    assert MIXTRAL.is_routed_weight("model.layers.7.block_sparse_moe.experts.3.w2.weight")
    assert not MIXTRAL.is_routed_weight("model.layers.7.block_sparse_moe.gate.weight")


@pytest.mark.parametrize("bad", ["model.layers.{layer}.mlp.experts", "x.{layer}.{expert}.{oops}", "a b.{layer}.{expert}"])
def test_layout_prefix_refused(bad):
    with pytest.raises(FqError, match="prefix"):
        ExpertLayout(bad)


def test_writer_refuses_stage_without_hadamard_signs(tmp_path):
    experts = _experts((5,), K=1, codebook="mcg")
    del experts[5]["up_proj"]["suh"], experts[5]["up_proj"]["svh"]
    with pytest.raises(FqError, match=r"expert 5 up_proj: missing suh, svh \(without its Hadamard sign vectors"):
        write_fragment(tmp_path / "r1.safetensors", layout=STANDARD, node="r1", role="stage", layer=7, block=1,
                       K=1, codebook="mcg", experts=experts)
    assert not list(tmp_path.iterdir()), "nothing half-written"


def test_writer_refuses_wrong_K_and_marker(tmp_path):
    experts = _experts((5,), K=2, codebook="mul1")
    with pytest.raises(FqError, match="K=2 mul1, fragment declares K=3 mul1"):
        write_fragment(tmp_path / "f.safetensors", layout=STANDARD, node="k3", role="base", layer=7, block=1,
                       K=3, codebook="mul1", experts=experts)
    experts[5]["gate_proj"]["mul1"] = torch.tensor(7, dtype=torch.int32)
    with pytest.raises(FqError, match="marker value 0x7 is not the mul1 constant"):
        write_fragment(tmp_path / "f.safetensors", layout=STANDARD, node="k2", role="base", layer=7, block=1,
                       K=2, codebook="mul1", experts=experts)


def _raw_header(tmp_path, header: dict, data: bytes, pad=True):
    body = json.dumps(header).encode()
    if pad:
        body += b" " * (-(8 + len(body)) % 8)
    p = tmp_path / "lie.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + data)
    return p


def _read(p):
    with open(p, "rb") as fh:
        return read_header(fh, p.name)


def test_reader_refuses_overlap(tmp_path):
    p = _raw_header(tmp_path, {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                               "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    with pytest.raises(FqError, match="tensor 'b' overlaps 'a'"):
        _read(p)


def test_reader_refuses_offsets_past_the_end(tmp_path):
    p = _raw_header(tmp_path, {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    with pytest.raises(FqError, match="truncated: header says data ends at byte"):
        _read(p)


def test_reader_refuses_gap_and_size_lies(tmp_path):
    p = _raw_header(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8))
    with pytest.raises(FqError, match="gap before tensor 'a'"):
        _read(p)
    p = _raw_header(tmp_path, {"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(FqError, match=r"span 8 bytes, F32 \[3\] needs 12"):
        _read(p)
    p = _raw_header(tmp_path, {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(8))
    with pytest.raises(FqError, match="4 trailing bytes"):
        _read(p)


def test_reader_refuses_duplicate_keys_and_bad_metadata(tmp_path):
    body = b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    p = tmp_path / "dup.safetensors"
    p.write_bytes(struct.pack("<Q", len(body)) + body + bytes(4))
    with pytest.raises(FqError, match="duplicate JSON key 'a'"):
        _read(p)
    p = _raw_header(tmp_path, {"__metadata__": {"K": 2}, "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                    bytes(4))
    with pytest.raises(FqError, match="__metadata__ must map strings to strings"):
        _read(p)


def test_reader_refuses_absurd_header_length(tmp_path):
    p = tmp_path / "x.safetensors"
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(FqError, match="header length .* does not fit"):
        _read(p)
    p.write_bytes(b"abc")
    with pytest.raises(FqError, match="truncated"):
        _read(p)


def test_describe_refuses_non_contiguous_expert(tmp_path):
    """A file whose tensors interleave experts (as a dtype-sorting writer produces) is not an fq fragment."""
    experts = _experts((0, 1))
    raws = []
    for proj in STANDARD.projections:
        for e in (0, 1):
            for s in ("trellis", "suh", "svh", "mul1"):
                raws.append(RawTensor.of(STANDARD.key(7, e, proj, s), experts[e][proj][s]))
    meta = {"format": "fq-fragment/1", "kind": "expert", "node": "k2", "role": "base", "layer": "7", "block": "0",
            "K": "2", "codebook": "mul1", "layout": json.dumps(STANDARD.to_json(), separators=(",", ":"))}
    p = tmp_path / "k2-layer007-block000.safetensors"
    write_shard(p, raws, meta)
    with open(p, "rb") as fh, pytest.raises(FqError, match="not contiguous"):
        describe(fh, p.name)


def test_write_shard_refuses_non_string_metadata(tmp_path):
    with pytest.raises(FqError, match="keys and values must be strings"):
        write_shard(tmp_path / "x.safetensors", [RawTensor.of("a", torch.zeros(1))], {"K": 2})


def test_layout_for_source_families():
    from fq.model import families
    assert families.by_name("mixtral").layout is MIXTRAL and families.by_name("deepseek_v3").layout is STANDARD
    assert families.by_name("minimax_m2").layout is MIXTRAL
    with pytest.raises(FqError, match="model family 'llama' is not registered"):
        families.by_name("llama")


def test_read_into_tensors_equals_the_whole_file_read_and_its_digest(tmp_path):
    """The one-pass reader (hidden-state files: 12.6 GB at GLM-5's width) gives the tensors, dtypes and sha256 of
    the two-pass one, an unaligned tensor (after a 3-byte one) and an empty one included; write_shard's returned
    digest is the file's."""
    path = tmp_path / "m.safetensors"
    raws = [RawTensor.of("a", torch.arange(3, dtype=torch.uint8)), RawTensor.of("b", torch.randn(5, 7)),
            RawTensor.of("c", torch.zeros(0)), RawTensor.of("d", torch.randn(2, 3).to(torch.bfloat16))]
    digest = write_shard(path, raws, {"k": "v"})
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    header, got, sha = read_into_tensors(path, "the test file")
    h2, data = read_whole(path, "the test file")
    want = tensors_in_range(h2, [e.name for e in h2.entries], h2.data_start, data[h2.data_start:])
    assert sha == digest and header.raw == h2.raw and set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    with open(path, "ab") as fh:
        fh.write(b"x")  # bytes beyond what the header describes
    with pytest.raises(FqError, match="m.safetensors"):
        read_into_tensors(path, "the test file")
