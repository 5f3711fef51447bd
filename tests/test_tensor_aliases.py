"""MiniMax-M2's router score bias in a published base (issue 23). exllamav3 1.6.5's MiniMax-M2 class looks the bias up
only at ``block_sparse_moe.gate.e_score_correction_bias`` (its BlockSparseMLP's ``key_e_score_bias``); MiniMax-M2
stores it at ``block_sparse_moe.e_score_correction_bias``. Rule fq-exl3-tensor-aliases/1 derives each layer's bias,
byte for byte, under exllamav3's name (``tensor_aliases.safetensors``), the skeleton keeps the published one (which
transformers and fq's runtime read); every consumer recomputes the file, a base that needs it and does not declare
it is refused, and the file never holds a name the base's other shards hold (exllamav3's loader keeps, of a key in
two files, whichever its directory glob lists last).

The checkpoint is the kit's MiniMax-M2 (transformers' own classes; its router biases seeded noise), published as a
one-base tree by basekit (fq's writers and signers, no Snakemake).
"""
from __future__ import annotations

import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tests.kits import basekit
from tests.kits import familykit as fk
from tests.kits import provkit
from fq.core import canonical
from fq.errors import FqError
from fq.provenance.exl3config import (QUANTIZATION_CONFIG, RULE_TENSOR_ALIASES, SOURCE_CONFIG, TENSOR_ALIASES,
                                      needed_tensor_files, specs, write_derived)
from fq.provenance.manifest import check_base_files, read_base_manifest, write_base_manifest
from fq.provenance.verify import verify_path

ARCH = "MiniMaxM2ForCausalLM"
IDS = torch.tensor([[1, 5, 9, 100, 300, 7, 42, 511]])


def _alias(layer: int) -> str:
    return f"model.layers.{layer}.block_sparse_moe.gate.e_score_correction_bias"


@pytest.fixture(scope="module")
def minimax(tmp_path_factory):
    root = tmp_path_factory.mktemp("minimax")
    src = fk.build(ARCH, root / "src")
    return src, basekit.publish(root, src)


def _copy(b: basekit.Base, dest) -> basekit.Base:
    shutil.copytree(b.root, dest / "published")
    root = dest / "published"
    return basekit.Base(root, b.pub, root / b.plan.relative_to(b.root), root / "base/k2", b.derived, b.sets,
                        b.layout, b.priv, b.campaign)


def test_the_router_bias_is_derived_under_the_name_exllamav3_reads(minimax):
    from fq.model.source import load_source
    from fq.planning.plan import make_plan
    from fq.planning.recipe import parse_recipe

    src, b = minimax
    assert [d["name"] for d in b.derived] == ["config.json", TENSOR_ALIASES, QUANTIZATION_CONFIG]
    got = load_file(str(b.base_dir / TENSOR_ALIASES))
    model = fk.model_of(ARCH)  # transformers' module: the bias its router adds (mlp.e_score_correction_bias)
    want = {_alias(L): model.model.layers[L].mlp.e_score_correction_bias for L in range(fk.LAYERS)}
    assert list(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert all(want[k].abs().sum() > 0 for k in want)  # seeded noise: a runtime that drops it routes otherwise
    with safe_open(str(b.base_dir / TENSOR_ALIASES), "pt") as f:
        assert f.metadata() == {"format": RULE_TENSOR_ALIASES}
    # the skeleton keeps the published name; no tensor of the base is in two files
    owner: dict = {}
    for p in sorted(b.base_dir.glob("*.safetensors")):
        with safe_open(str(p), "pt") as f:
            for k in f.keys():
                assert k not in owner, (k, owner.get(k), p.name)
                owner[k] = p.name
    assert owner["model.layers.1.block_sparse_moe.e_score_correction_bias"] != TENSOR_ALIASES
    storage = canonical.loads((b.base_dir / QUANTIZATION_CONFIG).read_bytes())["tensor_storage"]
    assert set(storage["model.layers.1.block_sparse_moe.gate"]["stored_tensors"]) == {
        "model.layers.1.block_sparse_moe.gate.weight", _alias(1)}
    # deterministic; finalize again leaves the same bytes
    before = (b.base_dir / TENSOR_ALIASES).read_bytes()
    assert write_derived(b.base_dir, bits=2, codebook="mul1") == b.derived
    assert (b.base_dir / TENSOR_ALIASES).read_bytes() == before
    # the family is loadable now: planned without allow_unloadable
    recipe = parse_recipe(fk.ONE_BASE_RECIPE, "recipe")
    assert make_plan(recipe, load_source(src)).source["exl3_architecture"] == "MiniMaxM2ForCausalLM"
    report = verify_path(b.root, b.pub, now=provkit.NOW)
    assert report.ok, report.problems


def test_fq_runtime_reads_the_published_bias_and_gives_transformers_logits(minimax):
    """fq's runtime loads the skeleton's bias (transformers' name), not the derived copy, and builds the product as
    transformers does from the same weights."""
    import transformers

    from fq.runtime.load import load_product

    src, b = minimax
    mine = load_product(b.plan, b.pub, state=None, now=provkit.NOW).model
    _, tensors = basekit.reference_tensors(b, src)
    ref = transformers.MiniMaxM2ForCausalLM.from_pretrained(None, config=fk.hf_config(ARCH), state_dict=tensors,
                                                            dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(mine(IDS).logits, ref(IDS).logits)


def test_an_edited_alias_file_is_refused_by_every_consumer(minimax, tmp_path):
    from fq.provenance.manifest import verify_base
    from fq.runtime.load import load_product

    b = _copy(minimax[1], tmp_path)
    p = b.base_dir / TENSOR_ALIASES
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x40  # the last layer's bias, within the listed size
    p.write_bytes(bytes(data))
    want = f"{TENSOR_ALIASES}: not the bytes rule {RULE_TENSOR_ALIASES} derives"
    problems = verify_path(b.root, b.pub, now=provkit.NOW).problems
    assert any(want in m for m in problems), problems
    assert not any(QUANTIZATION_CONFIG in m for m in problems)  # derived from it: not reported again
    with pytest.raises(FqError, match=want):  # fq combine --base runs it (a bare base has no residual to combine)
        verify_base(b.base_dir, b.pub)
    with pytest.raises(FqError, match=want):
        load_product(b.plan, b.pub, state=None, now=provkit.NOW)


def test_a_base_that_needs_the_alias_file_must_declare_it(minimax, tmp_path):
    """An insider's manifest that leaves it out (and a base without it): exllamav3 would route without the bias."""
    b = _copy(minimax[1], tmp_path)
    (b.base_dir / TENSOR_ALIASES).unlink()
    without = specs(2, "mul1")
    from fq.provenance.exl3config import RULES

    qc = RULES[without[1]["rule"]]
    listed = sorted(p.name for p in b.base_dir.iterdir() if p.is_file() and not p.name.startswith("fq-manifest"))
    (b.base_dir / QUANTIZATION_CONFIG).write_bytes(qc.derive(b.base_dir, qc.inputs(listed), without[1]["params"]))
    write_base_manifest(b.base_dir, node="k2", campaign=b.campaign, key=b.priv, derived=without)
    manifest = read_base_manifest(b.base_dir, b.pub)
    problems = check_base_files(b.base_dir, manifest, b.pub)
    want = (f"the skeleton keeps tensors its family's exllamav3 class reads under another name but the manifest "
            f"declares no {TENSOR_ALIASES} (rule {RULE_TENSOR_ALIASES})")
    assert len(problems) == 1 and want in problems[0], problems


def test_the_alias_file_never_shadows_a_tensor_of_the_base(minimax, tmp_path):
    """A skeleton that also states the bias under exllamav3's name: the same bytes need no derived copy; other
    bytes are refused (exllamav3 would read one bias, transformers the other)."""
    src, b = minimax
    d = tmp_path / "base"
    d.mkdir()
    for p in b.base_dir.iterdir():
        if p.name.endswith(".safetensors") and p.name != TENSOR_ALIASES or p.name == SOURCE_CONFIG:
            shutil.copyfile(p, d / p.name)
    stated = load_file(str(b.base_dir / TENSOR_ALIASES))
    save_file(stated, str(d / "extra.safetensors"))
    listed = sorted(p.name for p in d.iterdir())
    assert needed_tensor_files(d, listed) == []  # every layer's bias is stated under exllamav3's name already
    stated[_alias(2)] = stated[_alias(2)] + 1
    save_file(stated, str(d / "extra.safetensors"))
    with pytest.raises(FqError, match=rf"extra.safetensors: {_alias(2)} is not "
                                      r"model.layers.2.block_sparse_moe.e_score_correction_bias .*exllamav3 would read "
                                      r"the first, transformers the second"):
        needed_tensor_files(d, listed)
    del stated[_alias(2)]
    save_file(stated, str(d / "extra.safetensors"))
    assert needed_tensor_files(d, listed) == [TENSOR_ALIASES]  # layer 2's alone is derived
    from safetensors.torch import load

    from fq.provenance.exl3config import derive_tensor_aliases, rule_inputs

    assert list(load(derive_tensor_aliases(d, rule_inputs(RULE_TENSOR_ALIASES, listed)))) == [_alias(2)]
