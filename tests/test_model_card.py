"""The model card (README.md) of a published base: the Hub's format, derived from the base's configs and signed params,
recomputed by every consumer (issue 44). The real demo campaign's card is checked in tests/test_workflow.py."""
from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.kits import provkit
from fq.errors import FqError
from fq.provenance.manifest import verify_base
from fq.provenance.model_card import CARD_RULE, README, RULE, card_params, render, write_card
from fq.provenance.verify import verify_path
from tests.test_exl3_config import NOW, insider_resign_base


def front_matter(card: bytes) -> tuple[dict, str]:
    text = card.decode()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return provkit.build_campaign(tmp_path_factory.mktemp("card"), card=True)


@pytest.fixture
def c(pristine, tmp_path):
    return provkit.private_copy(pristine, tmp_path / "c")


def test_the_card_is_in_the_hub_format_and_states_the_base(pristine):
    base = pristine.root / "base/k2"
    card = (base / README).read_bytes()
    meta, body = front_matter(card)
    assert meta == {"base_model": "fq-test/tiny-moe", "base_model_relation": "quantized", "library_name": "exllamav3",
                    "pipeline_tag": "text-generation", "quantized_by": "fq", "tags": ["exl3", "quantized", "moe", "fq"]}
    qc = json.loads((base / "quantization_config.json").read_text())
    stored = sum(t["n_bytes"] for e in qc["tensor_storage"].values() for t in e["stored_tensors"].values())
    assert f"| stored tensor bytes | {stored:,} (" in body and f"| bits per weight | {qc['bits']:g} (" in body
    assert "| routed experts | K2 |" in body and "| attention | not EXL3" in body
    assert "`Qwen3MoeForCausalLM`" in body and "| layers | 4; MoE layers: 2, 8 routed experts each |" in body
    assert "did not run `fq eval`" in body and pristine.campaign["signer"] in body
    assert "fq verify base/k2/fq-manifest.intoto.jsonl --key signer.pub" in body
    # declared derived in the signed manifest, with its own params
    m = verify_base(base, pristine.pub).manifest
    (decl,) = [d for d in m.derived if d["name"] == README]
    assert decl["rule"] == RULE and decl["params"] == provkit.card_params_of(pristine.campaign)
    assert [f["name"] for f in decl["from"]] == ["source_config.json", "quantization_config.json"]
    assert verify_path(pristine.root, pristine.pub, now=NOW).ok


def test_a_budgeted_base_lists_its_allocation_per_layer():
    source = dict(provkit.SOURCE_CONFIG)
    block = {"bits": 2.9035, "expert_bits": {"1": {"gate": 2, "up": 2, "down": 3}, "3": {"gate": 3, "up": 3, "down": 4}},
             "linear_bits": {"attention": 3, "dense": {"0": 4, "2": 3}, "head": {"head": 5}}, "head_bits": 5,
             "codebook": "mul1", "calibration": {"rows": 16, "cols": 128}, "out_scales": "always",
             "tensor_storage": {"lm_head": {"stored_tensors": {"lm_head.weight": {"shape": [64, 128], "n_bytes": 16384,
                                                                                  "dtype": "torch.bfloat16"}}}}}
    params = card_params(base_model="org/src", revision="r", node="b3", campaign="demo", signer="a" * 64, budget=3.0,
                         quantized_by="someone", eval={"text": "heldout.txt", "sha256": "b" * 64, "tokens": 4096,
                                                       "seq_len": 256}, model_signing="c" * 64)
    card = render(source, block, params)
    meta, body = front_matter(card)
    assert meta["quantized_by"] == "someone" and meta["base_model"] == "org/src"
    assert "A budgeted base: 3 bits per weight" in body and "16 rows x 128 tokens" in body
    assert "| routed experts | per layer (below) |" in body and "| head (lm_head) | K5 |" in body
    assert "| layer | routed experts | dense |" in body
    for row in ("| 0 | - | K4 |", "| 1 (MoE) | gate K2 / up K2 / down K3 | - |", "| 2 | - | K3 |",
                "| 3 (MoE) | gate K3 / up K3 / down K4 | - |"):
        assert row in body
    assert "first 4096 tokens in windows of 256, 4,080 next-token positions" in body and "b" * 64 in body
    assert "model_signing verify key base/b3 --signature base/b3/model.sig" in body
    assert render(source, block, params) == card  # deterministic


def test_the_card_is_reproducible_anywhere_and_rewritten_only_when_it_differs(pristine, tmp_path):
    base = pristine.root / "base/k2"
    other = tmp_path / "elsewhere"
    other.mkdir()
    for n in ("source_config.json", "quantization_config.json"):
        shutil.copyfile(base / n, other / n)
    params = provkit.card_params_of(pristine.campaign)
    assert write_card(other, params) == {"name": README, "rule": RULE, "params": params}
    assert (other / README).read_bytes() == (base / README).read_bytes()
    mtime = (other / README).stat().st_mtime_ns
    write_card(other, params)
    assert (other / README).stat().st_mtime_ns == mtime


def test_an_edited_card_is_refused_signed_or_not(c):
    """An edit left unsigned and one the campaign's own key re-signed are refused alike, with one line naming the file
    and the first line that differs (as config.json's edits are: tests/test_exl3_config.py)."""
    base = c.root / "base/k2"
    card = base / README
    card.write_bytes(card.read_bytes().replace(b'quantized_by: "fq"', b'quantized_by: "TheBloke"'))
    want = (f"{base}/{README}: line 6 is 'quantized_by: \"TheBloke\"', the rule derives 'quantized_by: \"fq\"' "
            f"(rule {RULE}; a derived file must be its rule's output byte for byte)")
    assert verify_path(c.root, c.pub, now=NOW).problems == [want]
    insider_resign_base(c)  # the edit listed and signed by the campaign's own key: still not the rule's output
    assert verify_path(c.root, c.pub, now=NOW).problems == [want]
    with pytest.raises(FqError, match="the rule derives 'quantized_by"):
        verify_base(base, c.pub)


def test_card_params_are_checked_by_name(c):
    with pytest.raises(FqError, match=r"quantized_by 'a\\nb': expected a one-line string"):
        provkit.card_params_of(c.campaign, quantized_by="a\nb")
    with pytest.raises(FqError, match="eval .*expected {text, sha256, tokens, seq_len}"):
        provkit.card_params_of(c.campaign, eval={"text": "t", "tokens": 4096})
    with pytest.raises(FqError, match="params .*expected exactly base_model"):
        CARD_RULE.derive(c.root / "base/k2", [], {"node": "k2"})
    # a manifest declaring a card with params the rule refuses is refused where it is read
    insider_resign_base(c, lambda pred: [d["params"].update(signer="x") for d in pred["derived"] if d["name"] == README])
    with pytest.raises(FqError, match=r"fq-manifest.intoto.jsonl: predicate\.derived\[2\]"):
        verify_base(c.root / "base/k2", c.pub)
