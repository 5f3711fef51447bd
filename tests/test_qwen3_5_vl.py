"""Qwen3.5-MoE as Qwen publishes it (issue 23): the vision-language checkpoint ``Qwen3_5MoeForConditionalGeneration``,
its language model's layers under ``model.language_model.layers.*``, a vision tower under ``model.visual.*``, the
language model's config nested under ``text_config``, and its routed experts fused per layer
(``mlp.experts.gate_up_proj`` (E, 2I, hidden), gate then up, and ``mlp.experts.down_proj`` (E, hidden, I)) -- or one
matrix per expert, as transformers 5.24 saves it. fq reads both layouts (every expert equal to transformers' own
parameters), keeps everything else verbatim as skeleton, plans a base exllamav3 1.6.5's class of that name loads, and
its CPU runtime runs the published product text-only in transformers' VL class with transformers' logits.

The checkpoints are the kit's (transformers' own config classes and model); the published trees basekit's (fq's
writers and signers, no Snakemake).
"""
from __future__ import annotations

import json

import pytest
import torch

from tests.kits import basekit
from tests.kits import familykit as fk
from tests.kits import provkit
from fq.errors import FqError
from fq.model import families
from fq.model.experts import LANGUAGE_MODEL
from fq.model.source import PROJECTIONS, load_source, parse_source

ARCH = "Qwen3_5MoeForConditionalGeneration"
IDS = torch.tensor([[1, 5, 9, 100, 300, 7, 42, 511]])
I = fk.EXPERT_INTER


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    root = tmp_path_factory.mktemp("vl")
    saved = fk.build(ARCH, root / "saved", extra_config=fk.PUBLISHED_KEYS[ARCH])  # one matrix per expert
    published = fk.to_fused_qwen3_5(saved, root / "published-src")  # fused per layer, as Qwen publishes it
    return {"saved": saved, "published": published, "root": root}


@pytest.fixture(scope="module")
def base(vl):
    return basekit.publish(vl["root"] / "tree", vl["published"])


@pytest.mark.parametrize("layout", ["saved", "published"])
def test_each_expert_is_read_as_transformers_holds_it(vl, layout):
    from fq.workflow.encode import read_source

    src = load_source(vl[layout])
    assert src.family == "qwen3_5_moe_vl" and src.model_type == "qwen3_5_moe"
    assert (src.n_experts, src.hidden_size, src.moe_intermediate_size) == (fk.EXPERTS, fk.HIDDEN, I)
    assert src.moe_layers == (0, 1, 2) and src.num_hidden_layers == fk.LAYERS and src.exl3_problems == ()
    assert src.expert_tensor(1, 3, "up") == ("model.language_model.layers.1.mlp.experts.gate_up_proj"
                                             if layout == "published" else
                                             "model.language_model.layers.1.mlp.experts.3.up_proj.weight")
    skeleton = set(src.skeleton_tensors)
    assert "model.visual.patch_embed.proj.weight" in skeleton and "lm_head.weight" in skeleton
    assert "model.language_model.layers.1.mlp.gate.weight" in skeleton
    assert not any(".mlp.experts." in t for t in skeleton)
    model = fk.model_of(ARCH)  # transformers' own fused parameters
    experts = model.model.language_model.layers[1].mlp.experts
    refs = {str(e): {p: src.expert_source(1, e, p, lambda s: str(vl[layout] / s)).to_json() for p in PROJECTIONS}
            for e in (0, 6)}
    got = read_source(refs)
    for e in (0, 6):
        want = {"gate": experts.gate_up_proj[e][:I], "up": experts.gate_up_proj[e][I:], "down": experts.down_proj[e]}
        for p in PROJECTIONS:
            assert got[e][p].dtype == torch.float32 and torch.equal(got[e][p], want[p].float()), (e, p)


def test_the_config_is_read_from_text_config_and_the_base_loads_as_published(vl, base):
    from fq.planning.plan import make_plan
    from fq.planning.recipe import parse_recipe

    src = load_source(vl["published"])
    recipe = parse_recipe(fk.ONE_BASE_RECIPE, "recipe")
    assert make_plan(recipe, src).source["exl3_architecture"] == ARCH  # no allow_unloadable
    # its language model's decoder layers are Qwen3.5-MoE's: the text family's chain
    assert families.check_calibration(src.family_entry, "config") is families.by_name("qwen3_5_moe").calibration
    # the base's config.json is the wrapper's, as exllamav3's Qwen3_5VLMoeConfig reads it (text_config->num_experts)
    cfg = json.loads((base.base_dir / "config.json").read_text())
    source = json.loads((vl["published"] / "config.json").read_text())
    assert cfg["architectures"] == [ARCH] and cfg["text_config"] == source["text_config"]
    assert cfg["vision_config"] == source["vision_config"] and cfg["quantization_config"]["quant_method"] == "exl3"
    assert (base.base_dir / "preprocessor_config.json").read_bytes() == \
        (vl["published"] / "preprocessor_config.json").read_bytes()  # exllamav3's VL class opens it
    assert [d["name"] for d in base.derived] == ["config.json", "quantization_config.json"]
    from fq.provenance.verify import verify_path

    report = verify_path(base.root, base.pub, now=provkit.NOW)
    assert report.ok, report.problems


def test_the_runtime_runs_the_published_product_text_only_as_transformers_does(vl, base):
    """fq's CPU runtime builds transformers' Qwen3_5MoeForConditionalGeneration from the verified base (skeleton,
    vision tower included, and the reconstructed experts, which transformers' conversion fuses) and runs input_ids
    alone, with the logits of transformers' model on the same weights."""
    import transformers

    from fq.runtime.load import load_product

    loaded = load_product(base.plan, base.pub, state=None, now=provkit.NOW)
    assert type(loaded.model).__name__ == ARCH
    _, tensors = basekit.reference_tensors(base, vl["published"])
    ref = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(
        None, config=fk.hf_config(ARCH), state_dict=tensors, dtype=torch.float32).eval()
    with torch.no_grad():
        a, b = loaded.model(input_ids=IDS).logits, ref(input_ids=IDS).logits
    assert torch.isfinite(a).all() and torch.equal(a, b)


def test_fq_reads_the_published_checkpoint_as_transformers_does(vl):
    """The source as fq eval's reference and fq usage build it (fq.model.checkpoint_model): both layouts give
    transformers' logits."""
    from fq.model.checkpoint_model import load_checkpoint

    with torch.no_grad():
        want = fk.model_of(ARCH).float()(IDS).logits
        for layout in ("saved", "published"):
            assert torch.equal(load_checkpoint(vl[layout])(IDS).logits, want), layout


def test_usage_counts_the_language_models_routers(vl, tmp_path):
    import shutil

    from tests.kits import runtimekit
    from fq.model.usage import measure_usage

    d = tmp_path / "vl"
    shutil.copytree(vl["published"], d)
    (d / "tokenizer.json").write_text(runtimekit.tokenizer_json())
    doc = measure_usage(d, runtimekit.texts()[1][:400], seq_len=64, batch=8, hash_weights=False)
    assert sorted(int(L) for L in doc["layers"]) == [0, 1, 2]
    assert all(len(c) == fk.EXPERTS and sum(c) > 0 for c in doc["layers"].values())


def test_tp_export_names_the_language_models_routers(base, tmp_path):
    from safetensors import safe_open

    from fq.tp.export import tp_export

    out = tp_export(base.plan, base.pub, tmp_path / "ep2", tp=1, ep=2, sign_key=base.priv, now=provkit.NOW)
    with safe_open(str(out.path / "replicated.safetensors"), "pt") as f:
        assert sorted(f.keys()) == [f"model.language_model.layers.{L}.mlp.gate.weight" for L in range(fk.LAYERS)]


def test_the_layout_names_every_expert_and_layer_tensor():
    assert LANGUAGE_MODEL.layers == "model.language_model.layers."
    assert LANGUAGE_MODEL.layer_prefix(4) == "model.language_model.layers.4"
    assert LANGUAGE_MODEL.experts_prefix(4) == "model.language_model.layers.4.mlp.experts."
    assert LANGUAGE_MODEL.parse("model.language_model.layers.4.mlp.experts.17.up_proj.trellis") == (4, 17, "up_proj",
                                                                                                    "trellis")
    assert LANGUAGE_MODEL.parse("model.layers.4.mlp.experts.17.up_proj.weight") is None
    family = families.by_name("qwen3_5_moe_vl")
    assert family.router_name(2) == "model.language_model.layers.2.mlp.gate.weight"
    from fq.tp.moe import router_name

    assert router_name(LANGUAGE_MODEL, 2) == family.router_name(2)


def test_bad_vision_language_checkpoints_are_refused_by_name(vl):
    cfg = json.loads((vl["published"] / "config.json").read_text())
    index = json.loads((vl["published"] / fk.INDEX).read_text())
    sizes = {s: 1 << 30 for s in set(index["weight_map"].values())}
    flat = {k: v for k, v in cfg.items() if k != "text_config"}
    with pytest.raises(FqError, match=r"field 'text_config': expected the language model's config \(an object\) in a "
                                      r"Qwen3_5MoeForConditionalGeneration config, got None"):
        parse_source(flat, index, sizes, origin="o")
    wm = dict(index["weight_map"])
    del wm["model.language_model.layers.2.mlp.experts.down_proj"]
    with pytest.raises(FqError, match="layer 2's routed experts lack down_proj"):
        parse_source(cfg, {"weight_map": wm}, sizes, origin="o")
    wm = dict(index["weight_map"], **{"model.language_model.layers.2.mlp.experts.0.up_proj.weight": "x.safetensors"})
    with pytest.raises(FqError, match=r"tensor 'model.language_model.layers.2.mlp.experts.0.up_proj.weight' is under "
                                      r"the routed experts but is not one of down_proj, gate_up_proj"):
        parse_source(cfg, {"weight_map": wm}, {**sizes, "x.safetensors": 1}, origin="o")
    no_vision = dict(cfg, vision_config={k: v for k, v in cfg["vision_config"].items()
                                         if k != "deepstack_visual_indexes"})
    problems = parse_source(no_vision, index, sizes, origin="o").exl3_problems
    assert problems == ("vision_config lacks deepstack_visual_indexes (exllamav3 1.6.5 reads them without a default)",)


@pytest.mark.parametrize("layout", ["saved", "published"])
def test_the_calibration_chain_runs_the_language_models_layers(vl, layout):
    """The chain on the VL checkpoint, fused as published or per expert as saved: it embeds with
    ``model.language_model.embed_tokens``, reads its layer count and MoE rule from ``text_config``, builds each
    ``Qwen3_5MoeDecoderLayer`` holding exactly the full model's language-model layer (the published fused experts
    loaded as they are), reproduces each layer's output of transformers' VL model run on the tokens alone, and
    captures the input and down-projection Hessians its experts module sees (tests/test_hessian_families.py's
    checks)."""
    import transformers

    from fq.hessian import capture, layer as layer_mod
    from tests.test_hessian_families import (COLS, _check_hessians, _close, _same_position_embeddings, _tokens,
                                             hooked_forward)

    ckpt = layer_mod.read_checkpoint(vl[layout])
    arch = layer_mod.architecture(ckpt.config)
    assert arch.embed == "model.language_model.embed_tokens.weight" and arch.n_layers(ckpt.config) == fk.LAYERS
    assert "num_hidden_layers" not in ckpt.config and [L for L in range(fk.LAYERS) if arch.is_moe(ckpt.config, L)] \
        == [0, 1, 2]
    m = transformers.Qwen3_5MoeForConditionalGeneration.from_pretrained(vl[layout], dtype=torch.float32).eval()
    lm = m.model.language_model
    tokens = _tokens(COLS)
    seen = hooked_forward(m, lm.layers, arch, tokens)
    hfc = layer_mod.hf_config(ckpt.config)
    assert type(hfc).__name__ == "Qwen3_5MoeTextConfig"
    hidden = capture.embed(ckpt, tokens)
    assert torch.equal(hidden, lm.embed_tokens(tokens).detach())
    assert _same_position_embeddings(hfc, arch, hidden, seen)  # the text positions on all three axes
    for L in range(fk.LAYERS):
        tensors, _ = layer_mod.layer_tensors(ckpt, L)
        mine = layer_mod.build_layer(hfc, arch, L, tensors).state_dict()
        theirs = lm.layers[L].state_dict()
        assert sorted(mine) == sorted(theirs) and all(torch.equal(mine[k], theirs[k]) for k in theirs), L
        out, s = capture.advance(L, hidden, tensors, ckpt.config)
        assert _close(out, seen["layer"][L], 1e-5), L
        _, r = capture.advance(L, hidden, tensors, ckpt.config, routed_only=True)
        _check_hessians(lm.layers, arch, seen, L, s, r, "qwen3_5_moe")
        hidden = out
