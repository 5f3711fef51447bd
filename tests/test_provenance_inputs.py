"""Operator and file input to the provenance tools: names, selections, state files, keys, CLI usage."""
import os

import pytest

from tests.kits import provkit
from fq.cli import main
from fq.core.safepath import check_name, open_regular
from fq.errors import FqError
from fq.provenance.assembly import PlanState
from fq.provenance.combine import combine
from fq.provenance.selection import parse_selection


@pytest.mark.parametrize("name,msg", [
    ("../x.safetensors", "contains '..'"), ("a/../../b", "contains '..'"), ("/etc/passwd", "absolute path"),
    ("C:/x", "absolute path"), ("a//b", "invalid component ''"), ("a/./b", "invalid component '.'"),
    (".hidden", "invalid component '.hidden'"), ("a\\b", "invalid component"), ("", "non-empty"),
    ("a/b\n", "invalid component"),
])
def test_check_name_refuses(name, msg):
    with pytest.raises(FqError, match=msg):
        check_name(name, "name")


def test_open_regular_accepts_real_files_only(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "f").write_bytes(b"x")
    with open_regular(tmp_path, "d/f") as fh:
        assert fh.read() == b"x"
    with pytest.raises(FqError, match="d is a directory, expected a regular file"):
        open_regular(tmp_path, "d")
    with pytest.raises(FqError, match="missing"):
        open_regular(tmp_path, "d/g")
    os.symlink(tmp_path / "d" / "f", tmp_path / "link")
    with pytest.raises(FqError, match="link is a symlink"):
        open_regular(tmp_path, "link")


@pytest.mark.parametrize("text", ["", "1-", "a", "3-1", "1,,2", "3:", ":1", "3:1;3:2", "1 ,2", "01"])
def test_selection_refusals(text):
    with pytest.raises(FqError, match="--experts"):
        parse_selection(text)


def test_selection_forms():
    assert parse_selection("all").chosen(9, 99)
    s = parse_selection("0-2,7")
    assert [e for e in range(9) if s.chosen(4, e)] == [0, 1, 2, 7]
    s = parse_selection("3:1-2;5:0")
    assert s.chosen(3, 2) and s.chosen(5, 0) and not s.chosen(5, 1) and not s.chosen(4, 1)
    assert s.describe() == "3:1,2;5:0"


def test_selection_must_exist_in_the_product(tmp_path, campaign_copy):
    c = campaign_copy
    for sel, msg in (("8", r"experts \[8\] are not in layer 1"), ("2:0", "layer 2 is not in product"),
                     ("3:6-9", r"experts \[8, 9\] of layer 3 are not in product")):
        with pytest.raises(FqError, match=msg):
            combine(c.plans["k2r1r2"], c.pub, tmp_path / "o.safetensors", experts=sel, now=provkit.NOW)


def test_malformed_state_file_is_refused(tmp_path, campaign_copy):
    c = campaign_copy
    st = tmp_path / "state.json"
    st.write_text('{"x/k2r1": {"version": "2", "sha256": "ab"}}')
    with pytest.raises(FqError, match="plan state must map"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "o.safetensors", now=provkit.NOW, state=PlanState(st))
    st.write_text('{"a": 1, "a": 2}')
    with pytest.raises(FqError, match="duplicate JSON key 'a'"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "o.safetensors", now=provkit.NOW, state=PlanState(st))


def test_bare_base_product_has_nothing_to_combine(tmp_path, campaign_copy):
    c = campaign_copy
    provkit.PRODUCTS["k2only"] = ["k2"]
    try:
        plan = c.replan("k2only", 1)
    finally:
        del provkit.PRODUCTS["k2only"]
    with pytest.raises(FqError, match="is a bare base; it has no residual to combine"):
        combine(plan, c.pub, tmp_path / "o.safetensors", now=provkit.NOW)


def test_cli_usage_errors_are_one_line(tmp_path, capsys, campaign_copy):
    c = campaign_copy
    cases = [
        (["verify", str(tmp_path / "nope"), "--key", str(c.pub_path)], "does not exist"),
        (["verify", str(c.root), "--key", str(tmp_path / "nope.pub")], "cannot read public key"),
        (["verify", str(c.root), "--key", str(c.key_path)], "not a PEM public key"),
        (["combine", "--key", str(c.pub_path), "--plan", str(c.root / "base/k2/config.json"), "--out",
          str(tmp_path / "o"), "--no-state"], "expected exactly one envelope line|invalid JSON|DSSE envelope"),
        (["combine", "--key", str(c.pub_path), "--plan", str(c.plans["k2r1"]), "--out", str(tmp_path / "o"),
          "--no-state", "--base", str(tmp_path)], "fq-manifest.intoto.jsonl: missing"),
    ]
    for argv, msg in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        import re
        assert re.search(msg, err), err


def test_attest_refuses_a_parent_from_another_block(tmp_path, campaign_copy):
    from fq.provenance.attest.fragment import attest_fragment
    c = campaign_copy
    p = c.root / c.frag("r1", 1, 0)
    for parent, msg in (({"name": "k2-layer001-block001.safetensors", "sha256": "0" * 64}, "of the same block"),
                        (None, "a stage fragment needs parent digest")):
        with pytest.raises(FqError, match=msg):
            attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                            quant_args={}, node_digest=provkit.NODES["r1"]["digest"], parent=parent)


def test_node_digest_and_recipe_digest_inputs(tmp_path, campaign_copy):
    from fq.provenance.assembly import build_assembly
    from fq.provenance.attest.fragment import attest_fragment
    c = campaign_copy
    p = c.root / c.frag("k2", 1, 0)
    for bad in ("", "AB" * 32, "0" * 63, None):
        with pytest.raises(FqError, match="node_digest .* is not a sha256 hex digest"):
            attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                            quant_args={}, node_digest=bad)
    with pytest.raises(TypeError, match="node_digest"):  # required: a fragment always names its definition
        attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(), quant_args={})
    chain = [provkit.NODES["k2"], provkit.NODES["r1"]]
    kw = dict(product="k2r1", fragments=[c.frag("k2", 1, 0)], base_dir="base/k2", campaign=c.campaign, version=9,
              expires=provkit.EXPIRES, public_key=c.pub)
    old_chain = [{k: v for k, v in n.items() if k != "digest"} for n in chain]
    with pytest.raises(FqError, match=r"chain\[0\] must be \{node, role, K, codebook, parent, digest\}"):
        build_assembly(c.root, chain=old_chain, recipe_sha256=provkit.RECIPE_SHA256, **kw)
    with pytest.raises(FqError, match=r"chain\[1\] digest 'r1' is not a sha256 hex digest"):
        build_assembly(c.root, chain=[chain[0], dict(chain[1], digest="r1")], recipe_sha256=provkit.RECIPE_SHA256, **kw)
    with pytest.raises(FqError, match="recipe_sha256 'x' is not a sha256 hex digest"):
        build_assembly(c.root, chain=chain, recipe_sha256="x", **kw)
