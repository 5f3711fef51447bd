"""DeepSeek-V4 as DeepSeek publishes it (deepseek-ai/DeepSeek-V4-Flash / -Pro), written by familykit from the kit's
bf16 model (``to_deepseek_v4_release``): DeepSeek's own tensor names, every routed expert FP4 (int8, two e2m1 values a
byte, a ue8m0 ``.scale`` per 32 inputs), the other linears FP8 e4m3 beside a ue8m0 ``.scale`` per 128x128 block, in
several shards. fq reads each expert matrix and each FP8 linear as the reference dequantization does, bit for bit and
within the formats' rounding of the bf16 weights; plans it (exllamav3 1.6.5's class loads the base); encodes a block
whose attestation names each weight's scales beside it; publishes a base that keeps the FP8 linears verbatim, which
``fq verify``'s checks accept; builds that base in fq's CPU runtime as transformers' own load of the release
(``fq eval``'s KL of a K2-encoded base, ``fq usage``'s counts, the hash layer's included); and refuses the layout
transformers saves, a calibrated campaign and broken scales, by file, tensor and field."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.kits import familykit as fk
from fq.errors import FqError
from fq.model import families, formats
from fq.model.source import PROJECTIONS, load_source

ARCH = "DeepseekV4ForCausalLM"
RECIPE = fk.ONE_BASE_RECIPE


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """(the kit's bf16 checkpoint as transformers saves it, the same model in DeepSeek's release layout)."""
    root = tmp_path_factory.mktemp("dsv4")
    saved = fk.build(ARCH, root / "saved", extra_config=fk.PUBLISHED_KEYS[ARCH])
    return saved, fk.to_deepseek_v4_release(saved, root / "release")


def _tensor(d: Path, name: str) -> torch.Tensor:
    with safe_open(str(d / fk.weight_map(d)[name]), "pt") as f:
        return f.get_tensor(name)


def _reference(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """transformers' dequantization of DeepSeek-V4's tensors (``Fp8Dequantize``: packed FP4 or FP8, ue8m0 grid)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)._dequantize_one(q, s, output_dtype=torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype == torch.float32 and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _within_rounding(got: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, rel: float, floor: float) -> bool:
    """|got - w| at most half a step of the format at w: ``rel`` of |w|, or ``floor`` of the block's scale below
    the format's smallest normal (e2m1: 1/4 and 1/4; e4m3: 2^-4 and 2^-10)."""
    return bool(((got - w).abs() <= torch.maximum(w.abs() * rel, scale * floor) * (1 + 1e-6)).all())


def _grid(s: torch.Tensor, shape, block) -> torch.Tensor:
    return s.float().repeat_interleave(block[0], 0)[: shape[0]].repeat_interleave(block[1], 1)[:, : shape[1]]


def test_the_kit_writes_the_release_names_transformers_loads(kit, tmp_path):
    """The release's names (``v4_release_name``: no ``model.`` prefix, ``embed``, ``hc_head_*``, ``attn.kv_norm``)
    are the ones transformers' DeepSeek-V4 conversion mapping loads, every parameter filled with its own tensor."""
    import transformers

    saved, release = kit
    names = set(fk.weight_map(release))
    assert {"embed.weight", "head.weight", "norm.weight", "hc_head_fn", "layers.0.attn.kv_norm.weight"} <= names
    assert not any(n.startswith("model.") for n in names)
    bf16 = fk.to_deepseek_v4_release(saved, tmp_path / "bf16", quantize=False)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32,
                                                                    output_loading_info=True)
    assert not any(info.values()), info
    want = transformers.AutoModelForCausalLM.from_pretrained(saved, dtype=torch.float32).state_dict()
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())
    src = load_source(bf16)  # bf16 under the release's names is read too
    assert src.source_format == formats.SourceFormat("dense") and src.exl3_problems == ()
    name = src.expert_tensor(2, 5, "down")
    assert src.expert_source(2, 5, "down").block is None and name == "layers.2.ffn.experts.5.w2.weight"


def test_the_release_is_written_deterministically(kit, tmp_path):
    """The same bf16 checkpoint gives byte-identical release shards and index (so CI's sources do not drift)."""
    saved, release = kit
    again = fk.to_deepseek_v4_release(saved, tmp_path / "again")
    files = sorted(p.name for p in release.iterdir())
    assert files == sorted(p.name for p in again.iterdir())
    assert all((release / f).read_bytes() == (again / f).read_bytes() for f in files)


def test_experts_and_linears_are_read_as_the_reference_dequantizes_them(kit):
    """The release's format (fp8 linears, fp4 experts), its byte counts and skeleton; each expert matrix the encode
    job reads and each FP8 linear ``dense_state`` gives are transformers' dequantization, bit for bit, and within half
    a step of the format (e2m1, e4m3) of the bf16 weights they were written from."""
    from fq.workflow.encode import read_source

    saved, release = kit
    src = load_source(release)
    assert src.family == "deepseek_v4" and src.exl3_problems == () and len(src.shards) >= 8
    assert src.source_format == formats.SourceFormat("fp8", (128, 128), "fp4")
    assert src.summary()["source_format"] == {"kind": "fp8", "block": [128, 128], "experts": "fp4"}
    assert src.moe_layers == (0, 1, 2) and src.n_experts == fk.EXPERTS and src.dtype_bytes == 0.5
    o, i = src.expert_shape("gate")
    assert src.expert_matrix_bytes("gate") == o * i // 2 + o * i // 32  # e2m1 nibbles + a ue8m0 byte per 32
    skeleton = set(src.skeleton_tensors)
    assert not any(".ffn.experts." in n for n in skeleton)
    fp8 = sorted(n for n in skeleton if _tensor(release, n).dtype == torch.float8_e4m3fn)
    assert {"layers.1.attn.wq_a.weight", "layers.1.attn.wo_a.weight", "layers.1.ffn.shared_experts.w2.weight",
            "layers.1.attn.indexer.wq_b.weight"} <= set(fp8)
    assert all(n[: -len("weight")] + "scale" in skeleton for n in fp8)

    layer = 1
    refs = {str(e): {p: src.expert_source(layer, e, p, lambda s: str(release / s)).to_json() for p in PROJECTIONS}
            for e in (0, 7)}
    assert refs["0"]["gate"]["block"] == [1, 32]
    got = read_source(refs)
    for e in (0, 7):
        for p in PROJECTIONS:
            name = src.expert_tensor(layer, e, p)
            q, s = _tensor(release, name), _tensor(release, name[: -len("weight")] + "scale")
            assert q.dtype == torch.int8 and s.dtype == torch.float8_e8m0fnu
            assert _same_bits(got[e][p], _reference(q, s)), name
            w = _tensor(saved, "model." + name).float()
            assert _within_rounding(got[e][p], w, _grid(s, w.shape, (1, 32)), 1 / 4, 1 / 4), name

    tensors = {n: _tensor(release, n) for n in fp8 + [n[: -len("weight")] + "scale" for n in fp8]}
    dense = formats.dense_state(tensors, "release")
    assert sorted(dense) == fp8
    for n in fp8:
        s = tensors[n[: -len("weight")] + "scale"]
        assert _same_bits(dense[n], _reference(tensors[n], s)), n
        w = _tensor(saved, "model." + n).float()  # a layer's linear: the release drops transformers' prefix
        assert _within_rounding(dense[n], w, _grid(s, w.shape, (128, 128)), 2 ** -4, 2 ** -10), n


def test_the_release_is_planned_and_a_calibrated_campaign_refused(kit, tmp_path):
    """exllamav3 1.6.5's DeepseekV4ForCausalLM loads a base of the release (its Linear dequantizes the FP8 ``.scale``
    linears the skeleton keeps): ``fq plan`` plans it; DeepSeek-V4 has no calibration chain, so a calibrated plan is
    refused when the config is read."""
    from fq.planning.plan import make_plan
    from fq.planning.recipe import parse_recipe

    _, release = kit
    plan = make_plan(parse_recipe(RECIPE, "recipe"), load_source(release))
    assert plan.source["exl3_architecture"] == ARCH and plan.source["source_format"]["experts"] == "fp4"
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    fq = [sys.executable, "-m", "fq", "plan", str(recipe), "--model", str(release)]
    p = subprocess.run(fq, capture_output=True, text=True)
    assert p.returncode == 0 and "plan one on deepseek_v4" in p.stdout, p.stderr
    p = subprocess.run(fq + ["--calibration", "4x64"], capture_output=True, text=True)
    assert p.returncode != 0 and f"calibration: {ARCH} (DeepSeek-V4) has no calibration chain" in p.stderr, p.stderr


def test_one_block_is_encoded_and_attests_each_weight_beside_its_scales(kit, tmp_path):
    """The encode job reads expert 0's FP4 matrices with their ue8m0 scales (the source reader's float32) and its
    signed attestation names both, per matrix: the int8 weight (out, in/2) and its F8_E8M0 scales (out, in/32), each
    with the byte range the shard's header gives it."""
    from tests.test_families import _encode_one_expert

    from fq.codec import reconstruct
    from fq.model.shards import read_header
    from fq.provenance.attest import keys
    from fq.provenance.attest.fragment import read_attestation
    from fq.provenance.fragments import fragment_filename
    from fq.workflow.encode import read_source

    _, release = kit
    src = load_source(release)
    layout, layer, work = src.family_entry.layout, 1, tmp_path / "encode"
    tensors, _ = _encode_one_expert(release, layer, work)
    want = read_source({"0": {p: src.expert_source(layer, 0, p, lambda s: str(release / s)).to_json()
                              for p in PROJECTIONS}})
    for p, lp in zip(PROJECTIONS, layout.projections):
        w_hat = reconstruct({x: tensors[layout.key(layer, 0, lp, x)] for x in ("trellis", "suh", "svh", "mul1")},
                            shape=src.expert_shape(p))
        w = want[0][p]
        assert float(((w_hat - w) ** 2).sum() / (w ** 2).sum()) < 0.05, p  # K3: about 0.017
    att = read_attestation(work, fragment_filename("a", layer, 0), keys.load_public(work.parent / "signer.pub"))
    attested = {t["tensor"]: t for t in att.predicate["source"]["tensors"]}
    for p in PROJECTIONS:
        o, i = src.expert_shape(p)
        weight = src.expert_tensor(layer, 0, p)
        for name, dtype, shape in ((weight, "I8", [o, i // 2]), (weight[: -len("weight")] + "scale", "F8_E8M0",
                                                                    [o, i // 32])):
            shard = src.weight_map[name]
            with open(release / shard, "rb") as fh:
                e = read_header(fh, shard).entry(name)
            assert attested.pop(name) == {"tensor": name, "shard": shard, "dtype": dtype, "shape": shape,
                                          "range": [e.start, e.end]}
    assert not attested


def test_a_published_base_keeps_the_fp8_linears_and_verifies(kit, tmp_path):
    """A base of the release as finalize lays it out: the skeleton holds the FP8 linears and their ue8m0 scales
    byte for byte (exllamav3 1.6.5 dequantizes them on load), no routed expert's weight or scale; its config.json is
    the source's with EXL3's quantization_config (the other keys as exllamav3's converter keeps them: expert_dtype
    too); quantization_config.json lists the scales' dtype; fq verify's checks accept it, the head
    (``head.weight``) and every layer of each kind (attention type and routing) included."""
    from tests.kits import basekit
    from tests.kits import provkit
    from fq.provenance.verify import verify_path

    _, release = kit
    base = basekit.publish(tmp_path / "tree", release)
    report = verify_path(base.root, base.pub, now=provkit.NOW)
    assert report.ok, report.problems
    skeleton = {}
    for p in sorted(base.base_dir.glob("model-*.safetensors")):
        with safe_open(str(p), "pt") as f:
            skeleton.update({n: f.get_tensor(n) for n in f.keys()})
    assert not any(".ffn.experts." in n for n in skeleton) and "head.weight" in skeleton
    for name in ("layers.2.attn.wo_a.weight", "layers.2.attn.wo_a.scale", "layers.0.ffn.shared_experts.w1.scale"):
        assert skeleton[name].dtype == _tensor(release, name).dtype
        assert torch.equal(skeleton[name].view(torch.uint8), _tensor(release, name).view(torch.uint8)), name
    cfg = json.loads((base.base_dir / "config.json").read_text())
    assert cfg["quantization_config"]["quant_method"] == "exl3" and cfg["expert_dtype"] == "fp4"
    storage = json.loads((base.base_dir / "quantization_config.json").read_text())["tensor_storage"]
    assert storage["layers.2.attn.wo_a"]["stored_tensors"]["layers.2.attn.wo_a.scale"]["dtype"] == \
        "torch.float8_e8m0fnu"
    assert storage["layers.2.ffn.experts.3.w2"]["quant_format"] == "exl3"


def test_the_layout_transformers_saves_is_refused_with_the_reason(kit):
    """transformers 5.24 saves DeepSeek-V4 under names neither the release nor exllamav3 uses: refused by name when
    the source is read. The schedule exllamav3 reads (compress_ratios, num_hash_layers) is checked against
    transformers' (layer_types, mlp_layer_types), and a dim that is not a multiple of the FP8 block against the grid
    exllamav3 would derive."""
    saved, release = kit
    with pytest.raises(FqError, match=r"tensor 'model\.embed_tokens\.weight': DeepseekV4ForCausalLM \(DeepSeek-V4\) "
                                      r"checkpoints named so are not read: transformers 5\.24 saves DeepSeek-V4 under"):
        load_source(saved)
    family = families.for_config({"architectures": [ARCH]}, "c")
    cfg = json.loads((saved / "config.json").read_text())
    assert family.exl3_problems(cfg, [0, 1, 2], 3) == []
    written = {k: v for k, v in cfg.items() if k not in fk.PUBLISHED_KEYS[ARCH]}
    assert [p.split(" ")[0] for p in family.exl3_problems(written, [0, 1, 2], 3)] == ["layer_types", "mlp_layer_types"]
    published = json.loads((release / "config.json").read_text())
    assert family.exl3_problems(published, [0, 1, 2], 3) == []
    (problem,) = family.exl3_problems({**published, "head_dim": 192}, [0, 1, 2], 3)
    assert problem.startswith("head_dim=192 is not a multiple of the FP8 block [128, 128]: exllamav3 would")


def _bad_source(path: Path, release: Path, src, name: str, **over) -> formats.ExpertSource:
    """An ExpertSource of ``name`` (a routed expert's weight) in a shard of its own at ``path``, its weight or
    scales replaced by ``over`` (``weight=``, ``scale=``)."""
    scale = name[: -len("weight")] + "scale"
    tensors = {name: over.get("weight", _tensor(release, name)), scale: over.get("scale", _tensor(release, scale))}
    save_file(tensors, str(path))
    layer, expert, proj = next(k for k, v in src.expert_names.items() if v == name)
    return formats.ExpertSource(str(path), name, src.expert_shape(proj), str(path), scale, formats.FP4_BLOCK)


def test_bad_release_tensors_and_configs_name_file_tensor_and_field(kit, tmp_path):
    from fq.workflow.encode import read_source

    _, release = kit
    name = "layers.1.ffn.experts.2.w3.weight"
    s, q = _tensor(release, name[: -len("weight")] + "scale"), _tensor(release, name)
    nan = s.view(torch.uint8).clone()
    nan[3, 1] = 0xFF
    cases = {
        r"has non-finite scales": {"scale": nan.view(torch.float8_e8m0fnu)},
        r"is torch\.float8_e8m0fnu \[128, 7\], expected float8_e8m0fnu \(ue8m0\) \[128, 8\] \(one scale per 1x32 "
        r"block of layers\.1\.ffn\.experts\.2\.w3\.weight\)": {"scale": s[:, :7].contiguous()},
        r"is torch\.float32 \[128, 8\], expected float8_e8m0fnu": {"scale": s.float()},
        r"is torch\.float8_e4m3fn, expected int8 \(packed FP4: the config's expert_dtype is fp4\)":
            {"weight": torch.zeros(128, 128, dtype=torch.float8_e4m3fn)},
        r"is \[128, 256\], the config makes it \[128, 256\] \(out, in\), stored \[128, 128\] \(two e2m1 values a "
        r"byte\)": {"weight": torch.zeros(128, 256, dtype=torch.int8)},
    }
    src = load_source(release)
    for i, (want, over) in enumerate(cases.items()):
        ref = _bad_source(tmp_path / f"bad{i}.safetensors", release, src, name, **over)
        with pytest.raises(FqError, match=want):
            read_source({"2": {"up": ref.to_json()}})
    assert torch.equal(formats.dequantize_fp4(q, s), _reference(q, s))
    cfg = json.loads((release / "config.json").read_text())
    configs = {
        r"c: expert_dtype 'fp6': fq reads DeepSeek's routed experts as fp4": {**cfg, "expert_dtype": "fp6"},
        r"c: expert_dtype='fp4', quantization_config\.expert_dtype='fp8': both name the routed experts' dtype":
            {**cfg, "quantization_config": {**cfg["quantization_config"], "expert_dtype": "fp8"}},
        r"c: expert_dtype 'fp4' without a quantization_config": {k: v for k, v in cfg.items()
                                                                 if k != "quantization_config"},
    }
    for want, c in configs.items():
        with pytest.raises(FqError, match=want):
            formats.source_format(c, "c")
    # DeepSeek-V4.1 states it in quantization_config (transformers moves V4's there too): the same format
    moved = {**{k: v for k, v in cfg.items() if k != "expert_dtype"},
             "quantization_config": {**cfg["quantization_config"], "expert_dtype": "fp4"}}
    assert formats.source_format(moved, "c") == formats.source_format(cfg, "c")
    # a stored expert matrix of the wrong shape is refused when the source is read, not in an encode job
    bad = shutil.copytree(release, tmp_path / "unpacked")
    shard = fk.weight_map(bad)[name]
    with safe_open(str(bad / shard), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors[name] = torch.zeros(128, 256, dtype=torch.int8)
    save_file(tensors, str(bad / shard), metadata={"format": "pt"})
    with pytest.raises(FqError, match=rf"{shard}: tensor '{name}' is \[128, 256\], but .*config\.json makes a routed "
                                      r"expert's up projection \[128, 256\] \(out, in\), stored \[128, 128\] \(FP4"):
        load_source(bad)


# a row of 160 distinct ids of the kit's 512, longer than its sliding window (16) and the compression windows of its
# compressed-sparse (4) and heavily-compressed (128) layers, so the forward runs every attention path and the hash
# layer's tid2eid table
V4_IDS = torch.arange(3, 3 + 7 * 160, 7).remainder(fk.VOCAB).unsqueeze(0)


def _transformers_own(config: dict, tensors: dict):
    """transformers' DeepseekV4ForCausalLM loading ``tensors`` under the release's names itself (its conversion
    mapping), not through fq's runtime."""
    import transformers

    cfg = {k: v for k, v in config.items() if k not in ("quantization_config", "model_type")}
    hf = transformers.AutoConfig.for_model("deepseek_v4", **cfg)
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(None, config=hf, state_dict=dict(tensors),
                                                                      dtype=torch.float32, output_loading_info=True)
    assert not any(info.values()), info
    return model.eval()


def test_fq_runtime_builds_a_published_base_as_transformers_loads_the_release(kit, tmp_path):
    """fq's runtime (load_product -> build_model) builds a published base of the release: the family's names
    handed to transformers as it saves them (``Family.transformers_name``), every tensor read back under them, and
    the model is transformers' own load of the release's names with the same expert weights (the base's
    reconstructions; the FP8 skeleton dequantized): equal parameters, equal logits."""
    from tests.kits import basekit
    from tests.kits import provkit
    from fq.runtime.load import load_product

    _, release = kit
    base = basekit.publish(tmp_path / "tree", release)
    loaded = load_product(base.plan, base.pub, state=None, now=provkit.NOW)
    config, ref_tensors = basekit.reference_tensors(base, release)
    ref = _transformers_own(config, ref_tensors)
    mine, theirs = loaded.model.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[n], theirs[n]) for n in theirs)
    assert mine["model.layers.0.mlp.gate.tid2eid"].dtype == torch.int64  # the hash layer's table, as published
    with torch.no_grad():
        a, b = loaded.model(input_ids=V4_IDS).logits, ref(input_ids=V4_IDS).logits
    assert torch.isfinite(a).all() and torch.allclose(a, b, rtol=0, atol=1e-6)


def test_the_family_names_every_release_tensor_as_transformers_saves_it(kit):
    """``Family.transformers_name`` is transformers' saved name of each release tensor (the kit wrote the release
    from transformers' save: ``familykit.v4_release_name``, inverted), the MTP blocks none (transformers builds
    none); a name two tensors would share is refused by build_model."""
    from fq.model.checkpoint_model import _as_transformers_names

    saved, release = kit
    family = families.for_config({"architectures": [ARCH]}, "c")
    names = set(fk.weight_map(release))
    scales = {n for n in names if n.endswith(".scale")}
    want = {fk.v4_release_name(n): n for n in fk.weight_map(saved)}
    assert {n: family.transformers_name(n) for n in names - scales} == {n: want[n] for n in names - scales}
    assert family.transformers_name("mtp.0.ffn.experts.1.w2.weight") is None
    config = json.loads((release / "config.json").read_text())
    with pytest.raises(FqError, match=r"tensors layers\.0\.attn\.kv_norm\.weight and layers\.0\.attn\.norm\.weight "
                                      r"are both transformers' model\.layers\.0\.attn\.norm\.weight"):
        _as_transformers_names(config, {"layers.0.attn.kv_norm.weight": torch.ones(1),
                                        "layers.0.attn.norm.weight": torch.ones(1)})


# opt-in: 36 matrices encoded at K2 (10-25 s on two cores, over the suite's budget); CI checks the encode (one block
# within K3 error of the release) and the runtime (transformers' own load, the same expert weights) apart
@pytest.mark.skipif(os.environ.get("FQ_ALL_FAMILIES") != "1", reason="opt-in (10-25 s): FQ_ALL_FAMILIES=1")
def test_the_reference_forward_of_an_encoded_base_is_the_release_within_k2(tmp_path):
    """``fq eval``'s measure (fq.runtime.quality: KL of next-token distributions, top-1 agreement) of a base whose
    experts are the codec's K2 encodings, against the release dequantized (``checkpoint_state`` -> ``build_model``,
    fq eval's reference): finite, and of K2's error, far below a base of random sets' (the kit's random-init model
    gives near-flat distributions, so top-1 agreement says little here). The kit at 4 experts a layer: half the
    matrices to encode."""
    from tests.kits import basekit
    from tests.kits import provkit
    from fq.runtime import quality
    from fq.runtime.load import load_checkpoint, load_product

    saved = fk.build(ARCH, tmp_path / "saved", extra_config=fk.PUBLISHED_KEYS[ARCH], keys={"n_routed_experts": 4})
    release = fk.to_deepseek_v4_release(saved, tmp_path / "release")
    ref = quality.Reference(load_checkpoint(release), torch.cat([V4_IDS, V4_IDS.flip(1)]))
    kl = {}
    for encode in (True, False):
        base = basekit.publish(tmp_path / f"tree-{encode}", release, encode=encode)
        kl[encode] = quality.compare(load_product(base.plan, base.pub, state=None, now=provkit.NOW).model, ref).kl
    assert math.isfinite(kl[True]) and 0 < kl[True] < 0.02 and kl[True] < kl[False] / 3, kl


def test_fq_usage_counts_every_layer_of_the_release_the_hash_layer_by_its_table(kit, tmp_path):
    """``fq usage`` on the release: every decoder layer's router is found under transformers' module names
    (``model.layers.``, not the release's ``layers.``), the hash-routed layer 0 (``DeepseekV4HashRouter``) included,
    whose counts are its published ``tid2eid`` table read at the text's tokens."""
    from tests.kits import runtimekit as rk
    from tokenizers import Tokenizer

    from fq.model.usage import measure_usage

    _, release = kit
    d = Path(shutil.copytree(release, tmp_path / "release"))
    (d / "tokenizer.json").write_text(rk.tokenizer_json())
    text = rk.texts()[1][:2000]
    doc = measure_usage(d, text, seq_len=64, hash_weights=False)
    ids = torch.tensor(Tokenizer.from_file(str(d / "tokenizer.json")).encode(text, add_special_tokens=False).ids)
    table = _tensor(release, "layers.0.ffn.gate.tid2eid")
    assert sorted(doc["layers"]) == ["0", "1", "2"]
    assert doc["layers"]["0"] == torch.bincount(table[ids].reshape(-1), minlength=fk.EXPERTS).tolist()
    assert all(sum(c) == 2 * len(ids) for c in doc["layers"].values())
