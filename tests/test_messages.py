"""Issue 24, "Messages": each problem once, in words that point at its cause, every file named the same way.

A consumer reading ``fq verify``'s lines must see one line per problem, not the same cause repeated per plan or
followed by lines for files it explains; each line says what happened (re-encoded, stale, a plan of another
publication, a swapped base), and names its file by one rule: the PATH given joined with the file's name in the
tree. Python-API errors name no command-line option that was not given; ``fq cost-table --k`` is about K values.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.kits import provkit
from fq.cli import main
from fq.errors import FqError
from fq.planning.cost_table import parse_ks
from fq.provenance.attest.fragment import attest_fragment
from fq.provenance.combine import combine
from fq.provenance.manifest import MANIFEST_NAME
from fq.provenance.publication import NAME as PUBLICATION_NAME
from fq.provenance.verify import verify_path
from fq.runtime.load import verify_product

NOW = provkit.NOW


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return provkit.build_campaign(tmp_path_factory.mktemp("messages"))


@pytest.fixture(scope="module")
def two_bases(tmp_path_factory):
    """The demo campaign's shape: two bases (base/k2 and base/k3), each its own product."""
    c = provkit.build_campaign(tmp_path_factory.mktemp("two-bases"))
    provkit.add_base(c)
    assert verify_path(c.root, c.pub, now=NOW).ok
    return c


@pytest.fixture
def c(pristine, tmp_path):
    return provkit.private_copy(pristine, tmp_path / "c")


@pytest.fixture
def c2(two_bases, tmp_path):
    return provkit.private_copy(two_bases, tmp_path / "c2")


def problems(c):
    return verify_path(c.root, c.pub, now=NOW).problems


# -- each problem once -----------------------------------------------------------------------------------------

def test_a_missing_base_manifest_is_one_line_naming_the_plans_that_need_it(c):
    """Was 3 lines (once per plan, once for the statement) and a "not covered" line for each file it lists."""
    manifest = c.root / "base/k2" / MANIFEST_NAME
    manifest.unlink()
    assert problems(c) == [f"{manifest}: missing (needed by plans k2r1, k2r1r2)"]


def test_a_manifest_naming_a_path_outside_its_base_is_one_line(c):
    """An insider-signed manifest listing ``../escape.txt``: refused once, by the manifest's own line (was once
    more per plan pinning it), and the files it would list are not "not covered" on top."""
    manifest = c.root / "base/k2" / MANIFEST_NAME
    st = provkit._attested_line(manifest)
    st["subject"].append({"name": "../escape.txt", "digest": {"sha256": "0" * 64}})
    st["predicate"]["files"].append({"name": "../escape.txt", "size": 1})
    manifest.write_bytes(provkit._statement_line(st, c.priv))
    got = problems(c)
    assert len(got) == 1, got
    assert got[0].startswith(f"{manifest}: ") and "'../escape.txt' contains '..'" in got[0], got


def test_a_refused_manifest_leaves_no_not_covered_lines_for_the_files_it_lists(c):
    """The files a refused manifest would cover (config.json, quantization_config.json, source_config.json) are
    listed by the statement: their "not covered" lines were follow-ons of the one problem."""
    manifest = c.root / "base/k2" / MANIFEST_NAME
    manifest.write_bytes(b"not an envelope\n")
    got = problems(c)
    assert len(got) == 1 and got[0].startswith(f"{manifest}: "), got
    assert not any("not covered" in p for p in got), got


def test_a_symlinked_directory_is_one_line(c, tmp_path):
    """Was 3: the symlink, a plan's refusal of a fragment under it, the statement's "missing" for its files."""
    real = tmp_path / "elsewhere"
    shutil.move(c.root / "stages/r2", real)
    os.symlink(real, c.root / "stages/r2")
    assert problems(c) == [f"{c.root}/stages/r2: is a symlink; a published tree holds only real files"]


def test_a_deleted_base_directory_is_one_grouped_missing_line(c2):
    """Was "base/k3: cannot open directory: No such file or directory" (the plan's) beside the statement's
    grouped line: now one line, the directory missing with what it held, naming the plan that needs it."""
    shutil.rmtree(c2.root / "base/k3")
    assert problems(c2) == [f"{c2.root}/base/k3: missing, with the 4 fragments in it and 6 more file(s) "
                            f"{PUBLICATION_NAME} lists there (needed by plan k3)"]


def test_a_swapped_base_directory_is_one_line_per_directory(c2):
    """base/k2 and base/k3 swapped: was a line per file (fragments in another node's directory, every plan's
    manifest, every file missing, unlisted or different); now one line per directory naming what it holds."""
    b = c2.root / "base"
    os.rename(b / "k2", b / "tmp")
    os.rename(b / "k3", b / "k2")
    os.rename(b / "tmp", b / "k3")
    got = problems(c2)
    assert len(got) == 2, got
    for d, holds, listed, plans in (("k2", "k3", "k2", "plans k2r1, k2r1r2"), ("k3", "k2", "k3", "plan k3")):
        line = next(p for p in got if p.startswith(f"{b}/{d}/: "))
        assert re.fullmatch(
            rf"{re.escape(str(b))}/{d}/: holds the base of node {holds}, not the base {PUBLICATION_NAME} lists there "
            rf"\(its {MANIFEST_NAME} sha256 [0-9a-f]{{16}}…, listed: node {listed}'s [0-9a-f]{{16}}…\): \d+ of its "
            rf"files differ from the listing \(\d+ different, 8 missing, 8 not listed\); a swapped or copied base "
            rf"directory \(needed by {plans}\)", line), line


def test_a_stale_fragment_is_named_once_with_the_current_definition(c):
    """A fragment re-attested for an older definition of its node: was the node's "2 different definitions" line
    (not saying which is stale), a line per plan and the statement's digest line; now the node's line alone,
    naming the stale fragment and the digest the plans' chains name as current."""
    p = c.root / c.frag("r1", 1, 0)
    current = provkit.NODES["r1"]["digest"]
    stale = provkit.node_digest("r1", {"r1": {**provkit.DEFINITIONS["r1"], "K": 2}})  # r1 was K2
    attest_fragment(p, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                    quant_args={"seed": 7, "K": 1, "codebook": "mcg"}, node_digest=stale,
                    parent=provkit._attested(p)["predicate"]["parent"])
    assert problems(c) == [
        f"node r1: 1 of its 4 fragments was encoded for a stale definition (node_digest {stale[:16]}…: 1 "
        f"({c.frag('r1', 1, 0)})); the current definition is {current[:16]}…, the digest the chain of plans k2r1, "
        "k2r1r2 names; re-encode the stale one"]


# -- words that point at the cause -----------------------------------------------------------------------------

def test_a_plan_of_another_publication_is_blamed_not_the_genuine_statement(c, tmp_path):
    """fq combine blamed the genuine publication.intoto.jsonl ("it belongs to another campaign"), fq verify the
    genuine base manifest; both now name the foreign plan."""
    other = provkit.build_campaign(tmp_path / "other", signer=c, name="other")
    shutil.copy(other.plans["k2r1"], c.plans["k2r1"])
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW)
    want = (f"{c.plans['k2r1']}: a plan of another publication: its campaign identity differs in 'name' ('other', "
            f"the publication's 'test') from that of {c.root / PUBLICATION_NAME} (version 1)")
    assert str(e.value) == want + "; not a plan this publication lists"
    assert problems(c) == [want]


def test_a_reencoded_plan_line_is_called_reencoded_by_verify(c):
    """fq verify said "sha256 X is not the Y the statement lists"; the same signed plan, re-encoded, is named so."""
    line = c.plans["k2r1"].read_bytes()
    c.plans["k2r1"].write_bytes((json.dumps(json.loads(line), indent=None) + "\n").encode())
    got = problems(c)
    assert len(got) == 1, got
    assert re.fullmatch(rf"{re.escape(str(c.plans['k2r1']))}: its envelope line is not fq's canonical encoding "
                        rf"\(sha256 [0-9a-f]{{16}}…\): a re-encoded copy of a signed plan, not the line "
                        rf"{PUBLICATION_NAME} lists for product 'k2r1' \([0-9a-f]{{16}}…\); fetch the published line",
                        got[0]), got


def test_calibrate_k_is_called_k_not_a_layer_range(tmp_path, capsys):
    with pytest.raises(FqError) as e:
        parse_ks("abc")
    assert str(e.value) == "--k 'abc': 'abc' is not a K value or range (expected K or A-B, e.g. 1-4,8)"
    assert "layer" not in str(e.value)
    assert main(["cost-table", "--out", str(tmp_path / "t.json"), "--device", "cpu", "--k", "1-2,x"]) == 2
    err = capsys.readouterr().err
    assert err == "fq cost-table: --k '1-2,x': 'x' is not a K value or range (expected K or A-B, e.g. 1-4,8)\n"


def test_python_api_errors_name_no_option_that_was_not_given(c, tmp_path, capsys):
    """The runtime verifies the base the plan pins (no option at all) and combine(base_dir=...) is given no
    option: their errors name the directory only; fq combine --base still starts with --base."""
    base = c.root / "base/k2"
    (base / "extra.txt").write_text("x")
    want = f"{base}/extra.txt: not listed in {MANIFEST_NAME} (stray file in a published base)"
    with pytest.raises(FqError) as e:
        verify_product(c.plans["k2r1"], c.pub, now=NOW)
    assert str(e.value) == want
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, base_dir=base, experts="1:0-3")
    assert str(e.value) == want
    assert main(["combine", "--key", str(c.pub_path), "--plan", str(c.plans["k2r1"]), "--base", str(base),
                 "--out", str(tmp_path / "b.safetensors"), "--no-state", "--experts", "1:0-3"]) == 2
    assert capsys.readouterr().err == f"fq combine: --base: {want}\n"


# -- one way of naming files -----------------------------------------------------------------------------------

def test_every_line_names_its_file_by_its_path_in_the_tree(c, tmp_path):
    """A refused shard, a refused attestation and a broken chain edge were named relative to the tree, every other
    line by the path given: now every line starts with PATH/NAME, in fq verify and in fq combine alike."""
    frag = c.root / c.frag("r1", 3, 1)
    data = bytearray(frag.read_bytes())
    data[-5] ^= 0x01
    frag.write_bytes(bytes(data))  # a payload byte: its attestation refuses it
    att = c.root / (c.frag("r2", 1, 0) + ".intoto.jsonl")
    att.write_bytes(b"[" * 100 + b"]" * 100 + b"\n")
    got = problems(c)
    assert len(got) == 2, got
    assert got[0].startswith(f"{frag}: bytes of expert "), got
    assert got[1].startswith(f"{att}: JSON nested 100 levels deep"), got
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1r2"], c.pub, tmp_path / "a.safetensors", now=NOW, experts="1:0-3")
    assert str(e.value).startswith(f"{att}: JSON nested"), str(e.value)
