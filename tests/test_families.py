"""The model-family registry (fq.model.families) against checkpoints transformers itself built and saved
(tests/kits/familykit.py): every registered family is read as published -- its config keys, its MoE layers, its routed
expert matrices equal to the saved tensors -- and FP8 block-scaled sources are read as transformers' own reference
dequantization defines them, bit for bit; the CPU runtime builds each family from those tensors with transformers'
logits; bad input is refused naming the file, the tensor and what was expected."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.kits import familykit as fk
from fq.errors import FqError
from fq.model import families, formats
from fq.model.families.base import FusedExperts
from fq.model.source import PROJECTIONS, load_source
from fq.planning.plan import make_plan
from fq.planning.recipe import parse_recipe

# the families fq reads as the kit builds them (transformers' save_pretrained); DeepSeek-V4 is read as DeepSeek
# publishes it, which tests/test_deepseek_v4.py writes (familykit.to_deepseek_v4_release)
REGISTERED = sorted(a for a in fk.ARCHS if a in {x for f in families.REGISTRY.values()
                                                 if not f.unread and not f.unread_layouts for x in f.architectures})
FP8_ARCHS = ["DeepseekV3ForCausalLM", "MiniMaxM2ForCausalLM", "Qwen3MoeForCausalLM", "Glm4MoeForCausalLM",
             "MiMoV2FlashForCausalLM"]
# exllamav3 1.6.5 has no class for these, or misreads the kit's configs or fq's bases of them (docs/families.md says why)
UNLOADABLE = {"DeepseekV2ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3_5MoeForCausalLM", "PhimoeForCausalLM",
              "MiniMaxForCausalLM", "MiMoV2FlashForCausalLM"}
IDS = torch.tensor([[1, 5, 9, 100, 300, 7, 42, 511]])
RECIPE = fk.ONE_BASE_RECIPE


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    cache: dict = {}

    def get(arch: str, variant: str = "bf16") -> Path:
        if (arch, variant) not in cache:
            src = cache.get((arch, "bf16")) or fk.build(arch, root / arch,
                                                        extra_config=fk.PUBLISHED_KEYS.get(arch))
            cache[(arch, "bf16")] = src
            if variant == "fp8":
                cache[(arch, variant)] = fk.to_fp8(src, root / f"{arch}-fp8")
            elif variant == "mxfp4":
                cache[(arch, variant)] = fk.to_mxfp4_gptoss(src, root / f"{arch}-mxfp4")
            elif variant == "kimi":
                cache[(arch, variant)] = fk.as_kimi_k2(get(arch, "fp8"), root / f"{arch}-kimi")
        return cache[(arch, variant)]
    return get


@pytest.fixture(scope="module")
def encoded(built, tmp_path_factory):
    """Expert 0 of each family's first MoE layer encoded once by the encode job as base "a" (``_encode_one_expert``:
    K3 mul1, a block of one expert, in a campaign of its own): (the fragment's path, its tensors, the job's metrics).
    The per-family test and Laguna's stored-scale test read the same encode (each paid it before)."""
    from fq.provenance.fragments import fragment_filename

    root = tmp_path_factory.mktemp("encoded")
    cache: dict = {}

    def get(arch: str):
        if arch not in cache:
            d = built(arch)
            layer = load_source(d).moe_layers[0]
            tensors, summary = _encode_one_expert(d, layer, root / arch / "a")
            cache[arch] = (root / arch / "a" / fragment_filename("a", layer, 0), tensors, summary)
        return cache[arch]
    return get


def _saved(d: Path, name: str) -> torch.Tensor:
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]
    with safe_open(str(d / shard), "pt") as f:
        return f.get_tensor(name)


@pytest.mark.parametrize("arch", REGISTERED)
def test_each_family_is_read_as_transformers_saved_it(built, arch):
    d = built(arch)
    src = load_source(d)
    family = families.by_name(src.family)
    r = fk.ARCHS[arch]
    assert arch in family.architectures and src.n_experts == fk.EXPERTS
    assert src.hidden_size == fk.HIDDEN and src.moe_intermediate_size == fk.EXPERT_INTER
    assert src.moe_layers == tuple(l for l in range(fk.LAYERS) if l not in r.dense_layers)
    assert src.dense_layers == r.dense_layers and src.source_format.kind == "dense"
    assert len(src.shards) >= 8  # several shards, as save_pretrained wrote them
    layer = src.moe_layers[0]
    assert family.router_name(layer) in src.skeleton_tensors
    from fq.workflow.encode import read_source

    refs = {str(e): {p: src.expert_source(layer, e, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}
            for e in (0, 7)}
    got = read_source(refs)
    for e in (0, 7):
        for p in PROJECTIONS:
            want = _saved(d, src.expert_tensor(layer, e, p))
            if want.dim() == 3:  # fused: gpt-oss's (E, in, out), gate and up interleaved; Qwen3-VL-MoE's as saved
                spec = family.fused_experts
                order = src.fused_order or spec.order
                want = formats._fused_part(want[e].T if order == "in_out" else want[e], p, spec.split)
            assert got[e][p].dtype == torch.float32 and torch.equal(got[e][p], want.float())
            assert tuple(want.shape) == src.expert_shape(p)
    recipe = parse_recipe(RECIPE, "recipe")
    if src.exl3_problems:
        with pytest.raises(FqError, match=f"exllamav3 1.6.5 would not load a {arch} .*allow_unloadable"):
            make_plan(recipe, src)
        assert make_plan(recipe, src, allow_unloadable=True).source["exl3_architecture"] is None
    else:
        assert make_plan(recipe, src).source["exl3_architecture"] == family.exl3
    assert bool(src.exl3_problems) == (arch in UNLOADABLE), src.exl3_problems
    # whole-model accounting (fq plan / fq price): the non-expert linears transformers' layer has on the meta device
    # are the checkpoint's own 2-D weights, with their shapes (FP8 / fused families are checked where they differ)
    from fq.planning.model_bits import linear_shapes

    index = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shapes = linear_shapes(src)
    assert shapes and all(cls in ("attention", "shared", "dense", "head", "other") for cls, _ in shapes.values())
    for prefix, (cls, shape) in shapes.items():
        name = f"{prefix}.weight"
        if name in index:
            assert tuple(_saved(d, name).shape) == shape, name
    assert {c for c, _ in shapes.values()} >= {"attention", "head"}, arch
    saved = {n[: -len(".weight")] for n in index if n.endswith("_proj.weight") and ".experts." not in n
             and re.search(r"\.layers\.\d+\.", n) and "visual" not in n}
    assert saved and saved <= set(shapes), sorted(saved - set(shapes))
    from fq.planning.price import default_cost_table_path, load_cost_table, price_recipe

    whole = parse_recipe(dict(RECIPE, nodes=[dict(RECIPE["nodes"][0], skeleton={"attention": 4, "head": 6})]), "r")
    price = price_recipe(whole, src, load_cost_table(default_cost_table_path()), allow_unloadable=True)
    (k3,) = price.products
    assert {ln.name for ln in price.linears} == {"attention-K4-mul1", "head-K6-mul1"}
    assert all(ln.gpu_seconds > 0 and ln.output_bytes < ln.replaced_bytes for ln in price.linears)
    assert 3 < k3.model_bpw < 16 and k3.bpw == 3


def test_registry_is_consistent():
    for f in families.REGISTRY.values():
        assert families.for_config({"architectures": [f.architectures[0]]}, "c") is f
        assert families.for_config({"model_type": f.model_types[0]}, "c") is f
    assert families.transformers_model_type({"model_type": "kimi_k2"}) == "deepseek_v3"
    with pytest.raises(FqError, match="architecture 'Llama4ForCausalLM' is not a model family fq reads"):
        families.for_config({"architectures": ["Llama4ForCausalLM"]}, "c")


def test_kimi_linear_schedule_is_checked_as_exllamav3_reads_it(built):
    """exllamav3's KimiLinearConfig reads the attention schedule from linear_attn_config only and the MoE layers from
    first_k_dense_replace (default 0) and moe_layer_freq; transformers from layer_types / mlp_layer_types. The kit's
    config (Moonshot's keys) loads; one without them, or one exllamav3 would run otherwise, is an exllamav3 problem."""
    src = load_source(built("KimiLinearForCausalLM"))
    family, cfg = families.by_name(src.family), dict(src.config)
    assert src.exl3_problems == () and cfg["first_k_dense_replace"] == 1 and src.moe_layers == (1, 2)
    cases = {"linear_attn_config lacks kda_layers": {"linear_attn_config": None},
             "exllamav3 makes layers [0, 1, 2] MoE": {"first_k_dense_replace": None},
             "exllamav3 makes layers [2] MoE": {"moe_layer_freq": 2},
             "is not linear_attn_config's schedule": {"layer_types": ["full_attention"] * 3},
             "gate_lower_bound=-5.0": {"linear_attn_config": {**cfg["linear_attn_config"], "gate_lower_bound": -5.0}},
             "num_expert_group=2": {"num_expert_group": 2}}
    for want, over in cases.items():
        c = {k: v for k, v in {**cfg, **over}.items() if v is not None}
        problems = family.exl3_problems(c, src.moe_layers, 3)
        assert any(want in p for p in problems), (want, problems)


def test_laguna_bases_store_the_routed_up_proj_as_exllamav3_reads_it(built, encoded, tmp_path):
    """exllamav3 1.6.5's LagunaForCausalLM builds every MoE layer with interm_div 128: it reads each routed expert's
    EXL3 up_proj as W_up / 128 (its converter encodes the weight after Linear's weight_scale 1/128; load_exl3 applies
    no scale) and scales the routed weights by 128. Laguna's layout stores the routed up_proj times 2^-7: the encode
    job's up_proj is the encoder's encoding of W_up with svh / 128 (trellis and suh the same bytes; gate and down as
    encoded), reconstructing to exactly W_hat / 128; its metrics are the source's units; a stage encodes the residual
    against its parent times 128 and is stored the same way; a re-encode is byte-identical. A base storing W_up (as
    fq's bases did: a layout without the scale) is what exllamav3 reads 128 times too large, the reference with every
    routed up projection times 128 (on the H100 such a base gave KL 0.084, top-1 0%): fq verify refuses it."""
    from tests.kits import basekit
    from tests.kits import provkit
    from tests.kits.exl3kit import logit_agreement
    from fq.codec import encode, encode_residual, reconstruct
    from fq.model.checkpoint_model import build_model, checkpoint_state
    from fq.model.experts import STANDARD
    from fq.provenance.fragments import fragment_filename
    from fq.provenance.verify import verify_path
    from fq.workflow.encode import matrix_seed, read_source

    d = built("LagunaForCausalLM")
    src = load_source(d)
    layout = src.family_entry.layout
    assert src.exl3_problems == () and layout.scales_json() == {"up_proj": -7}
    assert make_plan(parse_recipe(RECIPE, "recipe"), src).source["exl3_architecture"] == "LagunaForCausalLM"
    layer = src.moe_layers[0]
    W = read_source({"0": {p: src.expert_source(layer, 0, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}})[0]
    name = fragment_filename("a", layer, 0)
    first, base, metrics = encoded("LagunaForCausalLM")
    _encode_one_expert(d, layer, tmp_path / "again" / "a")  # another campaign key: the same fragment bytes
    assert first.read_bytes() == (tmp_path / "again" / "a" / name).read_bytes()
    # the stage in the base's campaign (its key): the directory beside the base's
    stage, _ = _encode_one_expert(d, layer, first.parent.parent / "s", node="s", K=2, ancestors=(first,))

    def stored(tensors, lp):
        return {x: tensors[layout.key(layer, 0, lp, x)] for x in ("trellis", "suh", "svh", "mul1")}

    for p, lp in zip(PROJECTIONS, layout.projections):
        n = layout.scale_log2(lp)
        assert n == (-7 if p == "up" else 0)
        plain = encode(W[p], 3, "mul1", matrix_seed(0, "a", layer, 0, p))
        parent = layout.source(lp, stored(base, lp))  # what a stage and every consumer take: the source's units
        residual = encode_residual(W[p], [parent], 2, "mul1", matrix_seed(0, "s", layer, 0, p))
        for got, want in ((stored(base, lp), plain.tensors), (stored(stage, lp), residual.tensors)):
            assert all(torch.equal(got[x], want[x]) for x in ("trellis", "suh", "mul1")), p
            assert torch.equal(got["svh"].float(), want["svh"].float() * 2.0 ** n), p  # exact: a power of two
            assert torch.equal(reconstruct(got), reconstruct(want) * 2.0 ** n), p
        m = metrics["experts"]["0"][p]
        assert (m["sum_sq_w"], m["sum_sq_err"]) == (plain.sum_sq_w, plain.sum_sq_err), p  # the source's units
        chain = reconstruct(parent) + reconstruct(layout.source(lp, stored(stage, lp)))
        assert float(((chain - W[p]) ** 2).sum()) < 0.5 * plain.sum_sq_err, p  # the stage corrects its parent

    wrong = basekit.publish(tmp_path / "unscaled", d, layout=STANDARD)  # W_up stored as the source has it
    report = verify_path(wrong.root, wrong.pub, now=provkit.NOW)
    assert not report.ok and any("the family's layout (as its EXL3 runtime reads them) {'up_proj': -7}" in x
                                 for x in report.problems), report.problems
    config, tensors = checkpoint_state(d)
    ups = [n for n in tensors if ".mlp.experts." in n and n.endswith(".up_proj.weight")]
    assert len(ups) == len(src.moe_layers) * src.n_experts
    ids = torch.randint(0, fk.VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = build_model(config, tensors)(input_ids=ids).logits.float()
        misread = build_model(config, {n: t * 128 if n in ups else t for n, t in tensors.items()})(
            input_ids=ids).logits.float()
    kl = logit_agreement(ref, misread)["kl_ref_exl3"]  # the device test's measure of the same disagreement
    assert kl > 1e-2, kl


def test_every_config_value_exllamav3_asserts_is_checked_at_plan_time(built, tmp_path):
    """Every exllamav3 class the registry names has its assert_cfg facts in fq/data (tools/exl3_config_asserts.py
    extracts them from the wheel); a Qwen3-MoE with norm_topk_prob false (transformers builds and saves it; exllamav3
    1.6.5 refuses it: "Key norm_topk_prob expected to have value True but was False") is an exllamav3 problem at plan
    time, and the stated default is not."""
    from fq.model.families.base import exl3_config_asserts

    asserts = exl3_config_asserts()
    for f in families.REGISTRY.values():
        assert f.exl3 is None or f.exl3 in asserts, f.name
    assert {"key": "norm_topk_prob", "value": True, "optional": True} in asserts["Qwen3MoeForCausalLM"]
    d = built("Qwen3MoeForCausalLM")
    src = shutil.copytree(d, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    assert load_source(src).exl3_problems == ()
    (src / "config.json").write_text(json.dumps({**cfg, "norm_topk_prob": False}))
    assert load_source(src).exl3_problems == (
        "norm_topk_prob=False (exllamav3's Qwen3MoeForCausalLM asserts True)",)
    with pytest.raises(FqError, match="norm_topk_prob=False"):
        make_plan(parse_recipe(RECIPE, "recipe"), load_source(src))


def test_every_key_exllamav3_reads_with_no_default_is_checked_at_plan_time():
    """exllamav3 1.6.5 refuses a config.json without a key its class reads with no default ("Missing any of the
    following keys: ['indexer_types']": the GLM-5-size rehearsal's first load on the GPU). fq/data records those keys
    per class (tools/exl3_config_asserts.py); a missing one is a plan-time problem unless the base states it:
    GLM-5's indexer_types is derived as transformers' GlmMoeDsaConfig computes it, for each of its rules."""
    from fq.model.families.base import exl3_config_required
    from fq.provenance.exl3config import derive_config
    from transformers import GlmMoeDsaConfig

    required = exl3_config_required()
    for f in families.REGISTRY.values():
        assert f.exl3 is None or f.exl3 in required, f.name
    assert ["indexer_types"] in required["GlmMoeDsaForCausalLM"]
    glm5 = families.REGISTRY["glm_moe_dsa"]
    base = {k: v for k, v in GlmMoeDsaConfig(num_hidden_layers=6).to_dict().items() if k != "indexer_types"}
    base["architectures"] = ["GlmMoeDsaForCausalLM"]
    for over in ({}, {"index_topk_freq": 2}, {"index_topk_freq": 3, "index_skip_topk_offset": 1},
                 {"index_topk_pattern": "FSSFSS"}):
        cfg = {**base, **over}
        want = GlmMoeDsaConfig(**cfg).indexer_types
        assert glm5.exl3_needs.derived_keys(cfg) == {"indexer_types": want}, over
        assert json.loads(derive_config(json.dumps(cfg).encode(), 2, "mul1"))["indexer_types"] == want
        assert not [p for p in glm5.exl3_problems(cfg, [3, 4, 5], 6) if "indexer_types" in p]
    assert glm5.exl3_needs.derived_keys({**base, "indexer_types": ["full"] * 6}) == {}  # stated: kept as stated
    cfg = {k: v for k, v in base.items() if k != "index_n_heads"}
    assert "index_n_heads is not stated (exllamav3's GlmMoeDsaForCausalLM reads it with no default)" in \
        glm5.exl3_problems(cfg, [3, 4, 5], 6)


def test_a_yarn_factor_exllamav3_would_read_otherwise_is_an_exllamav3_problem(built, tmp_path):
    """exllamav3 1.6.5 takes a YaRN factor of max_position_embeddings / original_max_position_embeddings where the
    latter is stated; transformers takes ``factor``. gpt-oss as transformers saves it (factor 32, 131072 / 4096) is
    read alike; the same rope with max_position_embeddings 4096 (a small model's) is not: a problem at plan time."""
    d = built("GptOssForCausalLM")
    src = shutil.copytree(d, tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    rope = cfg["rope_parameters"]
    assert rope["rope_type"] == "yarn" and cfg["max_position_embeddings"] / rope["original_max_position_embeddings"] \
        == rope["factor"] == 32
    assert load_source(src).exl3_problems == ()
    (src / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096}))
    (problem,) = load_source(src).exl3_problems
    assert problem.startswith("rope YaRN factor=32.0, but max_position_embeddings / original_max_position_embeddings = "
                              "4096/4096 = 1: exllamav3 1.6.5 takes that ratio")
    with pytest.raises(FqError, match="rope YaRN factor=32.0"):
        make_plan(parse_recipe(RECIPE, "recipe"), load_source(src))


def test_gpt_oss_mxfp4_is_read_per_expert_as_the_reference_dequantizes_it(built):
    """openai/gpt-oss's published layout: fused MXFP4 blocks and scales, each expert's slice read alone and
    dequantized bit for bit as transformers' convert_moe_packed_tensors (float32) does; the fused biases stay
    skeleton; fq's CPU runtime builds the model on the same weights transformers' MXFP4 dequantization gives."""
    import transformers
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from fq.runtime.load import build_model, checkpoint_state
    from fq.workflow.encode import read_source

    d = built("GptOssForCausalLM", "mxfp4")
    src = load_source(d)
    assert src.source_format.kind == "mxfp4" and src.n_experts == fk.EXPERTS and src.moe_layers == (0, 1, 2)
    assert "model.layers.1.mlp.experts.gate_up_proj_bias" in src.skeleton_tensors
    assert not any(t.endswith(("_blocks", "_scales")) for t in src.skeleton_tensors)
    assert src.expert_matrix_bytes("gate") == 128 * 256 // 2 + 128 * 256 // 32  # e2m1 nibbles + e8m0 bytes
    layer = 1
    refs = {str(e): {p: src.expert_source(layer, e, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}
            for e in (3, 6)}
    got = read_source(refs)
    pre = f"model.layers.{layer}.mlp.experts."
    ref = {n: convert_moe_packed_tensors(_saved(d, pre + n + "_blocks"), _saved(d, pre + n + "_scales"),
                                         dtype=torch.float32) for n in ("gate_up_proj", "down_proj")}
    for e in (3, 6):
        assert torch.equal(got[e]["gate"], ref["gate_up_proj"][e][:, 0::2].T)
        assert torch.equal(got[e]["up"], ref["gate_up_proj"][e][:, 1::2].T)
        assert torch.equal(got[e]["down"], ref["down_proj"][e].T)
    config, tensors = checkpoint_state(d)
    assert torch.equal(tensors[pre + "gate_up_proj"], ref["gate_up_proj"])
    reference = dict(tensors)
    model = transformers.GptOssForCausalLM.from_pretrained(None, config=fk.hf_config("GptOssForCausalLM"),
                                                           state_dict=reference, dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(build_model(config, tensors)(IDS).logits, model(IDS).logits)


def test_qwen3_vl_moe_experts_are_read_in_both_orders_as_transformers_holds_them(built, tmp_path):
    """Qwen3-VL-MoE's fused experts as Qwen publishes them, (E, hidden, 2I) with gate then up and (E, I, hidden), and as
    transformers 5.24 saves them, its module's (E, 2I, hidden) and (E, hidden, I) (the kit: hidden = 2I, a square
    gate_up that only down's shape tells apart): fq reads every expert of both as transformers' own parameter; fq's
    runtime fuses them back as transformers saves them; fq's reference forward and the calibration chain build the same
    model and layers from both."""
    import transformers

    from fq.hessian import layer as layer_mod
    from fq.runtime.load import checkpoint_state
    from fq.workflow.encode import read_source

    arch = "Qwen3VLMoeForConditionalGeneration"
    saved = built(arch)
    published = fk.to_published_qwen3_vl(saved, tmp_path / "published")
    experts = transformers.Qwen3VLMoeForConditionalGeneration.from_pretrained(saved, dtype=torch.float32) \
        .model.language_model.layers[2].mlp.experts
    I = fk.EXPERT_INTER
    for d, order in ((saved, "out_in"), (published, "in_out")):
        src = load_source(d)
        assert src.fused_order == order and src.exl3_problems == ()
        got = read_source({str(e): {p: src.expert_source(2, e, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}
                           for e in range(fk.EXPERTS)})
        for e in range(fk.EXPERTS):
            gu = experts.gate_up_proj[e]
            want = {"gate": gu[:I], "up": gu[I:], "down": experts.down_proj[e]}
            assert all(torch.equal(got[e][p], want[p]) for p in PROJECTIONS), (order, e)
    layout = src.family_entry.layout
    per = {layout.key(2, e, lp, "weight"): got[e][p] for e in range(fk.EXPERTS)
           for p, lp in zip(PROJECTIONS, layout.projections)}
    fused = formats.fuse_experts(per, layout, src.family_entry.fused_experts, "t")
    _, tensors = checkpoint_state(saved)
    for name in ("gate_up_proj", "down_proj"):
        key = f"model.language_model.layers.2.mlp.experts.{name}"
        assert torch.equal(fused[key], tensors[key]), name
    # config.json as transformers 5.24 writes it names the vision config qwen3_vl_moe_vision, which exllamav3
    # 1.6.5's vision reader refuses (the releases say qwen3_vl_moe: fk.PUBLISHED_KEYS)
    cfg = json.loads((saved / "config.json").read_text())
    cfg["vision_config"]["model_type"] = fk.config_of(arch)["vision_config"]["model_type"]
    assert src.family_entry.exl3_problems(src.family_entry.text_view(cfg, "c"), [0, 1, 2], 3) == [
        "vision_config model_type 'qwen3_vl_moe_vision' (exllamav3 1.6.5 accepts qwen3_vl, qwen3_vl_moe, qwen3_5, "
        "qwen3_5_moe, qwen3_5_vision, qwen3_5_moe_vision, qwen4_exp, qwen4_exp_vision)"]
    # fq's reference forward (fq eval, fq usage) builds both as transformers builds the one it saved
    from fq.model.checkpoint_model import load_checkpoint

    with torch.no_grad():
        assert torch.equal(load_checkpoint(published)(IDS).logits, load_checkpoint(saved)(IDS).logits)
    a, b = layer_mod.read_checkpoint(saved), layer_mod.read_checkpoint(published)
    hfc = layer_mod.hf_config(a.config)
    arch_ = layer_mod.architecture(a.config)
    for L in range(fk.LAYERS):
        mine = layer_mod.build_layer(hfc, arch_, L, layer_mod.layer_tensors(b, L)[0]).state_dict()
        theirs = layer_mod.build_layer(hfc, arch_, L, layer_mod.layer_tensors(a, L)[0]).state_dict()
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs), L


def test_fused_experts_round_trip():
    from fq.model.experts import STANDARD

    g = torch.Generator().manual_seed(0)
    gu, dn = torch.randn(4, 256, 256, generator=g), torch.randn(4, 128, 256, generator=g)
    pre = "model.layers.2.mlp.experts."
    per = {}
    for e in range(4):
        per[f"{pre}{e}.gate_proj.weight"] = gu[e][:, 0::2].T
        per[f"{pre}{e}.up_proj.weight"] = gu[e][:, 1::2].T
        per[f"{pre}{e}.down_proj.weight"] = dn[e].T
    out = formats.fuse_experts({**per, "x": torch.ones(1)}, STANDARD, FusedExperts(), "t")
    assert set(out) == {"x", pre + "gate_up_proj", pre + "down_proj"}
    assert torch.equal(out[pre + "gate_up_proj"], gu) and torch.equal(out[pre + "down_proj"], dn)
    del per[f"{pre}2.up_proj.weight"]
    with pytest.raises(FqError, match="layer 2: every expert 0..3 needs its gate_proj, up_proj and down_proj"):
        formats.fuse_experts(per, STANDARD, FusedExperts(), "t")


@pytest.mark.parametrize("arch", FP8_ARCHS)
def test_fp8_sources_are_dequantized_as_the_reference_does(built, arch):
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from fq.workflow.encode import read_source

    d = built(arch, "fp8")
    src = load_source(d)
    assert src.source_format == formats.SourceFormat("fp8", (128, 128)) and src.dtype_bytes == 1
    layer = src.moe_layers[-1]
    refs = {str(e): {p: src.expert_source(layer, e, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}
            for e in (2, 5)}
    got = read_source(refs)
    reference = Fp8Dequantize(None)
    for e in (2, 5):
        for p in PROJECTIONS:
            name = src.expert_tensor(layer, e, p)
            q, s = _saved(d, name), _saved(d, formats.scale_name(name))
            assert q.dtype == torch.float8_e4m3fn
            want = reference._dequantize_one(q, s, output_dtype=torch.float32)
            assert torch.equal(got[e][p], want), f"{name}: not the reference's bits"
    # the skeleton keeps the FP8 attention weights and their scales verbatim
    fp8_skeleton = [t for t in src.skeleton_tensors if t.endswith(".weight_scale_inv")]
    assert fp8_skeleton and all(t[: -len("_scale_inv")] in src.skeleton_tensors for t in fp8_skeleton)


@pytest.mark.parametrize("arch", ["DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "MiniMaxM2ForCausalLM"])
def test_runtime_builds_the_fp8_model_on_the_reference_weights(built, arch):
    """fq's CPU runtime (checkpoint_state -> build_model) on an FP8 checkpoint: every tensor is transformers' reference
    dequantization of the published one, and the logits are those of transformers' model built from them."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from fq.runtime.load import build_model, checkpoint_state

    d = built(arch, "fp8")
    config, tensors = checkpoint_state(d)
    raw = fk.load_tensors(d)
    reference = {}
    for name, t in raw.items():
        if name.endswith("weight_scale_inv"):
            continue
        s = raw.get(name + "_scale_inv")
        reference[name] = Fp8Dequantize(None)._dequantize_one(t, s, output_dtype=torch.float32) if s is not None \
            else t.float()
    assert sorted(tensors) == sorted(reference) and all(torch.equal(tensors[n], reference[n]) for n in reference)
    mine = build_model(config, tensors)
    import transformers

    ref = getattr(transformers, arch).from_pretrained(None, config=fk.hf_config(arch), state_dict=reference,
                                                      dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = mine(IDS).logits, ref(IDS).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_partial_fp8_blocks_are_read_as_exllamav3_reads_them():
    """A weight whose rows are not a multiple of 128 (DeepSeek-V3's kv_a_proj_with_mqa, 576 rows) has the ceil grid."""
    w = torch.randn(200, 256)
    q, s = fk.fp8_quantize(w, (128, 128))
    assert tuple(s.shape) == (2, 2)
    assert torch.equal(formats.dequantize_fp8(q, s), fk.fp8_dequantize(q, s, (128, 128)))
    with pytest.raises(FqError, match=r"weight \(200, 256\) has a \(3, 2\) scale grid, expected \(2, 2\)"):
        formats.dequantize_fp8(q, torch.ones(3, 2))


def test_kimi_k2_is_deepseek_v3(built):
    from fq.runtime.load import build_model, checkpoint_state

    d = built("DeepseekV3ForCausalLM", "kimi")
    src = load_source(d)
    assert src.family == "deepseek_v3" and src.model_type == "kimi_k2" and src.source_format.kind == "fp8"
    config, tensors = checkpoint_state(d)
    assert config["model_type"] == "kimi_k2"
    with torch.no_grad():
        a = build_model(config, tensors)(IDS).logits
    b_cfg, b_tensors = checkpoint_state(built("DeepseekV3ForCausalLM", "fp8"))
    with torch.no_grad():
        b = build_model(b_cfg, b_tensors)(IDS).logits
    assert torch.equal(a, b)


def test_bad_fp8_sources_name_file_tensor_and_expectation(built, tmp_path):
    from safetensors.torch import load_file, save_file

    from fq.workflow.encode import read_source

    good = built("Qwen3MoeForCausalLM", "fp8")
    src = load_source(good)
    layer = src.moe_layers[0]
    name = src.expert_tensor(layer, 1, "up")
    scale = formats.scale_name(name)
    shard = src.weight_map[scale]
    bad = tmp_path / "bad"
    bad.mkdir()
    for p in good.iterdir():
        (bad / p.name).write_bytes(p.read_bytes())
    t = load_file(str(bad / shard))
    t[scale] = t[scale][:-1].contiguous()  # a truncated scale grid
    save_file(t, str(bad / shard), metadata={"format": "pt"})
    ref = {"1": {"up": src.expert_source(layer, 1, "up", lambda s: str(bad / s)).to_json()}}
    with pytest.raises(FqError, match=rf"{shard}: tensor '{scale}' is torch.float32 \[0, 2\], expected float32, "
                                      rf"bfloat16 or float8_e8m0fnu \(ue8m0\) \[1, 2\] \(one scale per 128x128 block "
                                      rf"of {name}\)"):
        read_source(ref)
    # a matrix whose stored shape disagrees with the config
    gate = src.expert_tensor(layer, 1, "gate")
    t = load_file(str(bad / src.weight_map[gate]))
    t[gate] = t[gate][:, :128].contiguous()
    save_file(t, str(bad / src.weight_map[gate]), metadata={"format": "pt"})
    ref = {"1": {"gate": src.expert_source(layer, 1, "gate", lambda s: str(bad / s)).to_json()}}
    with pytest.raises(FqError, match=rf"tensor '{gate}' is \[128, 128\], the config makes it \[128, 256\] "
                                      r"\(out, in\)"):
        read_source(ref)


def test_refused_when_the_config_is_read_not_mid_campaign(built, tmp_path):
    """A family no EXL3 runtime loads, and a calibrated campaign of a family without a calibration chain: refused by
    fq plan, fq price and Snakemake's dry run, before any job. fq plan and fq price accept a calibrated campaign of
    a family with a chain (Qwen3.5-MoE's text model, one of the last to get one; DeepSeek-V3.2 and MiniMax-Text-01
    have no familykit recipe)."""
    import subprocess
    import sys

    from tests.kits import crashkit as k

    cal = built("Qwen3_5MoeForCausalLM")
    src = built("Qwen2MoeForCausalLM")  # no exllamav3 class
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps(RECIPE))
    fq = [sys.executable, "-m", "fq"]
    for cmd in ("plan", "price"):
        p = subprocess.run(fq + [cmd, str(recipe), "--model", str(cal), "--calibration", "4x64", "--allow-unloadable"],
                           capture_output=True, text=True)
        assert p.returncode == 0 and "calibration" in p.stdout, (cmd, p.stderr)
    # the registered families fq reads without a chain that the kit builds (none, when every family has one)
    for f in [f for f in families.REGISTRY.values()
              if f.calibration is None and not f.unread and not f.unread_layouts and f.architectures[0] in fk.ARCHS]:
        uncal = built(f.architectures[0])
        want_cal = f"calibration: {f.architectures[0]} ({f.title}) has no calibration chain"
        for cmd in ("plan", "price"):
            p = subprocess.run(fq + [cmd, str(recipe), "--model", str(uncal), "--calibration", "4x64",
                                     "--allow-unloadable"], capture_output=True, text=True)
            assert p.returncode != 0 and want_cal in p.stderr, (f.name, cmd, p.stderr)
        d = tmp_path / f"run-{f.name}"
        k.write_config(d, uncal, calibration={"tokens": None, "text": None, "rows": 2, "columns": 32})
        (d / "recipe.json").write_text(json.dumps(RECIPE))
        p = subprocess.run(k.smk_cmd(d, "-n"), capture_output=True, text=True, env=k.env())
        assert p.returncode != 0 and want_cal in p.stdout + p.stderr, p.stderr[-2000:]
    p = subprocess.run(fq + ["price", str(recipe), "--model", str(src)], capture_output=True, text=True)
    assert p.returncode != 0 and "exllamav3 1.6.5 has no class for Qwen2MoeForCausalLM" in p.stderr, p.stderr
    assert "--allow-unloadable" in p.stderr
    p = subprocess.run(fq + ["plan", str(recipe), "--model", str(src), "--allow-unloadable"], capture_output=True,
                       text=True)
    assert p.returncode == 0, p.stderr  # (the plan without the flag: test_each_family_is_read_as_transformers_saved_it)
    d = tmp_path / "run"
    k.write_config(d, src, allow_unloadable=False)
    (d / "recipe.json").write_text(json.dumps(RECIPE))
    p = subprocess.run(k.smk_cmd(d, "-n"), capture_output=True, text=True, env=k.env())
    assert p.returncode != 0 and "set allow_unloadable: true" in (p.stdout + p.stderr).replace("Set", "set")


def test_the_support_table_in_the_docs_is_the_registrys():
    from fq.model.families.table import support_table

    doc = Path(__file__).resolve().parents[1] / "docs" / "families.md"
    measured = json.loads((doc.parent / "data" / "families_exl3.json").read_text())
    text = doc.read_text()
    start = text.index("-->\n", text.index("<!-- support table")) + 4
    end = text.index("<!-- end of the generated table -->")
    assert text[start:end] == support_table(measured), \
        "docs/families.md is stale: python -m fq.model.families.table docs/data/families_exl3.json"


def test_usage_reads_a_kimi_k2_fp8_checkpoint(built, tmp_path):
    """fq usage routes text through the source as fq's runtime builds it: Kimi-K2's FP8 layout (which transformers'
    from_pretrained would need accelerate and Moonshot's remote code for) included."""
    import shutil

    from tests.kits import runtimekit
    from fq.model.usage import measure_usage

    d = tmp_path / "kimi"
    shutil.copytree(built("DeepseekV3ForCausalLM", "kimi"), d)
    (d / "tokenizer.json").write_text(runtimekit.tokenizer_json())
    doc = measure_usage(d, runtimekit.texts()[1][:4000], seq_len=64, batch=4, hash_weights=False)
    counts = {int(L): c for L, c in doc["layers"].items()} if isinstance(doc["layers"], dict) else None
    assert counts is not None and sorted(counts) == [1, 2], doc["layers"]
    assert all(len(c) == fk.EXPERTS and sum(c) > 0 for c in counts.values())


def test_the_calibration_chain_reads_fp8_sources_dequantized(built):
    """A calibrated FP8 campaign's chain runs the layer on the weights the encoder reads: every FP8 tensor of the
    layer (attention and experts) comes to transformers' decoder layer as transformers' reference dequantization."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    from fq.hessian import capture, layer as layer_mod

    d = built("DeepseekV3ForCausalLM", "fp8")
    ckpt = layer_mod.read_checkpoint(d)
    tensors, _ = layer_mod.layer_tensors(ckpt, 1)
    raw = fk.load_tensors(d)
    assert not any(n.endswith("weight_scale_inv") for n in tensors)
    fp8 = [n for n in tensors if n + "_scale_inv" in raw]
    assert any(".self_attn." in n for n in fp8) and any(".mlp.experts." in n for n in fp8)
    for n, t in tensors.items():
        want = (Fp8Dequantize(None)._dequantize_one(raw[n], raw[n + "_scale_inv"], output_dtype=torch.float32)
                if n in fp8 else raw[n].float())
        assert torch.equal(t, want), n
    hidden = torch.randn(2, 16, fk.HIDDEN, generator=torch.Generator().manual_seed(0))
    out, sums = capture.advance(1, hidden, tensors, ckpt.config)
    assert torch.isfinite(out).all() and sums.input_count == 2 * 16
    assert torch.isfinite(sums.input).all() and torch.isfinite(sums.down).all()


def _encode_one_expert(src_dir: Path, layer: int, work: Path, *, node: str = "a", K: int = 3,
                       ancestors: tuple[Path, ...] = ()):
    """Expert 0 of ``layer`` encoded by the encode job (``encode_blocks``; K3 mul1, the CPU's cheapest K, a block of
    one expert), its sources the source reader's (FP8, MXFP4, fused slices): (the fragment's tensors, the job's
    metrics). ``ancestors``: the fragments of a stage's chain (base first), each of the same block and campaign key
    (``work``'s parent), which makes the block a stage's residual over them."""
    import sys

    from safetensors.torch import load_file

    from fq.provenance.fragments import fragment_filename
    from fq.workflow.encode import BlockJob, encode_blocks

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import encode_job as bench  # its campaign.json, as init writes it

    s = load_source(src_dir)
    work.mkdir(parents=True)
    campaign_json, key_path = work.parent / "campaign.json", work.parent / "signer.key"  # a stage: its base's
    if not campaign_json.exists():
        campaign_json, key_path = bench.make_campaign(work.parent, "cpu", 1, *(src_dir / sh for sh in s.shards))
    frag = work / fragment_filename(node, layer, 0)
    sources = {0: {p: s.expert_source(layer, 0, p, lambda n: str(src_dir / n)).to_json() for p in PROJECTIONS}}
    chain = [{"node": Path(a).parent.name, "codebook": "mul1", "digest": "3" * 64, "path": str(a)} for a in ancestors]
    job = BlockJob(node=node, role="stage" if ancestors else "base", K=K, codebook="mul1", node_digest="3" * 64,
                   layer=layer, block=0, experts=[0], sources=sources, ancestors=chain, out_fragment=str(frag),
                   out_metrics=str(work / "metrics.json"))
    (summary,) = encode_blocks([job], campaign_json=str(campaign_json), key_path=str(key_path),
                               device="cpu", devices_list=[], lock_dir=str(work / "locks"), seed=0,
                               layout=s.family_entry.layout, threads=1)
    return load_file(str(frag)), summary


@pytest.mark.parametrize("arch", REGISTERED)
def test_each_family_is_encoded_published_verified_and_run(built, encoded, arch, tmp_path):
    """Per family, what a campaign does to it, without Snakemake: one block of its first MoE layer encoded by the
    encode job (expert 0, its three matrices named by the family's layout, each reconstructing the matrix the source
    reader gives); a base laid out as finalize publishes it (tests/kits/basekit.py: the source's skeleton shards
    verbatim, source_config.json and the side files, the derived files, manifest, plan, publication); ``fq verify``'s
    checks accept it; and fq's CPU runtime builds the published product with the logits of transformers' own model on
    the same weights (the source with every routed expert the base's reconstruction)."""
    from tests.kits import basekit
    from tests.kits import provkit
    from fq.codec import reconstruct
    from fq.provenance.verify import verify_path
    from fq.runtime.load import as_transformers_loads, build_model, load_product
    from fq.workflow.encode import read_source

    d = built(arch)
    src = load_source(d)
    layout = src.family_entry.layout
    layer = src.moe_layers[0]
    _, tensors, summary = encoded(arch)
    want = read_source({"0": {p: src.expert_source(layer, 0, p, lambda s: str(d / s)).to_json() for p in PROJECTIONS}})
    assert sorted(tensors) == sorted(layout.key(layer, 0, lp, x) for lp in layout.projections
                                     for x in ("trellis", "suh", "svh", "mul1"))
    for p, lp in zip(PROJECTIONS, layout.projections):
        w = want[0][p]
        stored = {x: tensors[layout.key(layer, 0, lp, x)] for x in ("trellis", "suh", "svh", "mul1")}
        w_hat = reconstruct(layout.source(lp, stored), shape=src.expert_shape(p))  # Laguna's up_proj: times 2^7
        assert float(((w_hat - w) ** 2).sum() / (w ** 2).sum()) < 0.05, (p, summary)  # K3: about 0.017

    base = basekit.publish(tmp_path / "tree", d)
    report = verify_path(base.root, base.pub, now=provkit.NOW)
    assert report.ok, report.problems
    loaded = load_product(base.plan, base.pub, state=None, now=provkit.NOW)
    config, ref_tensors = basekit.reference_tensors(base, d)
    ref = build_model(config, as_transformers_loads(ref_tensors, config, layout, "reference"))
    with torch.no_grad():
        a, b = loaded.model(input_ids=IDS).logits, ref(input_ids=IDS).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)
