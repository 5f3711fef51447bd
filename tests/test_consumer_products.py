"""Issue 15: what a consumer asked for is what it gets, and every consumer command checks a plan the same way.

- a plan copied over another product's file is refused by fq verify, combine, mesh-plan and tp-export, each
  naming the product it is;
- the signed publication statement (``publication.intoto.jsonl``): a withheld product, a missing or unlisted
  file, a summary that is not its view (bpw included) are refused; single-plan consumers check the plan is the
  one it lists;
- versions rise per signer across campaigns: an older complete campaign of the same key is a rollback, for
  consumers with a state file and for fq promote;
- one set of plan checks (``fq.provenance.product``): an insider-signed plan with a wrong fragment size is refused by
  all four, with one message;
- errors a user must never see: a missing fragment is one line naming the fragment and the plans that need it,
  a wrong key is one line, and a re-encoded plan line is called what it is.
"""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from tests.kits import provkit
from fq.cli import main
from fq.core import canonical
from fq.errors import FqError
from fq.provenance.assembly import PlanState, read_assembly
from fq.provenance.attest import dsse
from fq.provenance.attest.statement import PUBLICATION
from fq.provenance.combine import combine
from fq.provenance.publication import NAME as PUBLICATION_NAME, read_publication
from fq.provenance.summary import SUMMARY_NAME, summary_view
from fq.provenance.verify import verify_path

NOW = provkit.NOW


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return provkit.build_campaign(tmp_path_factory.mktemp("consumer"))


@pytest.fixture
def c(pristine, tmp_path):
    """A private copy of the module's campaign (tests tamper with it); same key."""
    return provkit.private_copy(pristine, tmp_path / "c")


def consumers(c, plan, tmp_path, capsys) -> dict[str, str]:
    """What each consumer command says about ``plan`` (its one stderr line), all expected to refuse it."""
    key = ["--key", str(c.pub_path)]
    runs = {
        "verify": ["verify", str(c.root), *key],
        "combine": ["combine", *key, "--plan", str(plan), "--out", str(tmp_path / "a.safetensors"), "--no-state"],
        "mesh-plan": ["mesh-plan", str(plan), *key, "--tp", "1"],
        "tp-export": ["tp-export", str(plan), *key, "--tp", "1", "--sign-key", str(c.key_path), "--out",
                      str(tmp_path / "export"), "--no-state"],
    }
    said = {}
    for name, argv in runs.items():
        capsys.readouterr()
        rc = main(argv)
        err = capsys.readouterr().err
        assert rc == (1 if name == "verify" else 2), (name, rc, err)
        said[name] = err
    assert not (tmp_path / "a.safetensors").exists() and not (tmp_path / "export").exists()
    return said


def problems(c, **kw) -> list[str]:
    return verify_path(c.root, c.pub, now=NOW, **kw).problems


# -- 1. product swap -------------------------------------------------------------------------------------------

def test_a_plan_copied_over_another_products_file_is_refused_by_every_consumer(c, tmp_path, capsys):
    shutil.copy(c.plans["k2r1"], c.plans["k2r1r2"])  # validly signed, same campaign: only the name lies
    said = consumers(c, c.plans["k2r1r2"], tmp_path, capsys)
    want = (re.escape(f"{c.plans['k2r1r2']}: file name does not match its product 'k2r1': the file asks for product "
                      "'k2r1r2', the signed plan is product 'k2r1' (a plan copied under another product's name)"))
    for name, err in said.items():
        assert re.fullmatch(f"fq {name}: {want}\n", err), (name, err)  # one line each, the same words


def test_a_plan_file_not_named_for_a_product_is_refused(c, tmp_path):
    other = c.root / "assemblies" / "renamed.jsonl"
    shutil.copy(c.plans["k2r1"], other)
    with pytest.raises(FqError, match=r"renamed\.jsonl: file name does not match its product 'k2r1' \(a plan is "
                                      r"PRODUCT\.assembly\.intoto\.jsonl"):
        combine(other, c.pub, tmp_path / "a.safetensors", now=NOW)


# -- 2. the publication statement ------------------------------------------------------------------------------

def test_the_publication_statement_lists_every_file_and_product(c):
    stmt = read_publication(c.root, c.pub)
    files = sorted(p.relative_to(c.root).as_posix() for p in c.root.rglob("*") if p.is_file())
    assert sorted(stmt.files) == [f for f in files if f != PUBLICATION_NAME]
    assert stmt.version == 1 and stmt.signer == c.campaign["signer"]
    pred = stmt.predicate
    assert set(pred["products"]) == {"k2r1", "k2r1r2"} and set(pred["bases"]) == {"k2"}
    for product, path in c.plans.items():
        plan = read_assembly(path, c.pub, now=NOW)
        e = pred["products"][product]
        assert (e["file"], e["sha256"], e["version"]) == (f"assemblies/{product}.assembly.intoto.jsonl", plan.sha256, 1)
        assert e["bpw"] == sum(n["K"] for n in plan.predicate["chain"]) and e["chain"] == provkit.PRODUCTS[product]
    line = (c.root / PUBLICATION_NAME).read_bytes()
    provkit.publish(c)  # deterministic: the same tree gives the same line
    assert (c.root / PUBLICATION_NAME).read_bytes() == line
    assert json.loads(dsse.open_envelope(line, c.pub, "x"))["predicateType"] == PUBLICATION
    report = verify_path(c.root, c.pub, now=NOW)
    assert report.ok and [p.version for p in report.publications] == [1]


def test_a_withheld_product_is_refused_by_verify(c):
    c.plans["k2r1r2"].unlink()
    shutil.rmtree(c.root / "stages" / "r2")
    assert problems(c) == [
        f"{c.plans['k2r1r2']}: product 'k2r1r2' is listed in {PUBLICATION_NAME} (version 1) but its plan is missing "
        "(a withheld product)",
        f"{c.root}/stages/r2/: missing, with the 8 file(s) {PUBLICATION_NAME} lists under it"]


def test_a_tree_without_its_publication_statement_is_refused(c):
    (c.root / PUBLICATION_NAME).unlink()
    assert problems(c) == [f"{c.root / PUBLICATION_NAME}: missing; a published tree carries the signed publication "
                           "statement finalize writes (what it contains, with its version)"]
    assert verify_path(c.root / "base" / "k2", c.pub, now=NOW).ok  # a base directory alone is no publication


def test_unlisted_files_and_other_digests_are_refused(c, tmp_path):
    extra = provkit.build_campaign(tmp_path / "x", signer=c)  # the same key's fragments of another campaign...
    shutil.copytree(extra.root / "stages" / "r2", c.root / "stages" / "r2b")  # ...added as a whole directory
    got = problems(c)
    assert f"{c.root}/stages/r2b/: 8 file(s) not listed in {PUBLICATION_NAME} (not part of this publication)" in got
    # an attestation re-signed by the campaign's own key over the same shard: valid, but not the listed line
    c2 = provkit.build_campaign(tmp_path / "y")
    att = c2.root / "stages" / "r1" / "r1-layer001-block000.safetensors.intoto.jsonl"
    env = canonical.loads(att.read_bytes())
    env["signatures"] = env["signatures"] + [{"keyid": "x", "sig": env["signatures"][0]["sig"]}]
    att.write_bytes(dsse.envelope_line(env))
    assert any(re.fullmatch(rf"{re.escape(str(att))}: sha256 [0-9a-f]{{16}}… is not the [0-9a-f]{{16}}… "
                            rf"{PUBLICATION_NAME} lists", p) for p in problems(c2)), problems(c2)


def test_the_summary_is_exactly_the_view_of_the_publication_statement(c):
    pub = read_publication(c.root, c.pub)
    summary = summary_view(pub.predicate)
    (c.root / SUMMARY_NAME).write_text(canonical.pretty(summary))
    assert verify_path(c.root, c.pub, now=NOW).ok
    summary["products"]["k2r1"]["bpw"] = 9  # unchecked before issue 15
    summary["recipe"]["name"] = "renamed"
    summary["extra"] = 1
    (c.root / SUMMARY_NAME).write_text(canonical.pretty(summary))
    where, signed = c.root / SUMMARY_NAME, c.root / PUBLICATION_NAME
    assert problems(c) == [f"{where}: extra is not in the signed publication ({signed})",
                           f"{where}: products.k2r1.bpw is 9, the signed publication ({signed}) says 3",
                           f"{where}: recipe.name is 'renamed', the signed publication ({signed}) says 'provkit'"]


def test_single_plan_consumers_require_the_plan_the_publication_lists(c, tmp_path, capsys):
    """A validly signed newer plan of k2r1 that the publication statement beside it does not list is refused by
    every consumer; without a statement beside it a plan stands on its own signature (documented)."""
    listed = read_publication(c.root, c.pub).files["assemblies/k2r1.assembly.intoto.jsonl"]
    provkit._plan(c, "k2r1", 2, provkit.EXPIRES, c.priv)  # re-planned, publication not re-signed
    said = consumers(c, c.plans["k2r1"], tmp_path, capsys)
    want = rf"{re.escape(str(c.plans['k2r1']))}: not the plan .*{PUBLICATION_NAME} lists for product 'k2r1' " \
           rf"\(sha256 [0-9a-f]{{16}}… version 2; the publication lists {listed[:16]}… version 1\)"
    for name in ("combine", "mesh-plan", "tp-export"):
        assert re.fullmatch(f"fq {name}: {want}\n", said[name]), said[name]
    assert said["verify"] == (f"fq verify: {c.plans['k2r1']}: sha256 {read_assembly(c.plans['k2r1'], c.pub).sha256[:16]}… "
                              f"is not the {listed[:16]}… {PUBLICATION_NAME} lists (the plan of product 'k2r1', "
                              "version 1 listed)\n")
    (c.root / PUBLICATION_NAME).unlink()
    res = combine(c.plans["k2r1"], c.pub, tmp_path / "b.safetensors", now=NOW)
    assert res.path.exists()

    # a plan of another campaign of the same key, put where this publication has no such product
    other = provkit.build_campaign(tmp_path / "o", signer=c, name="other")
    provkit.PRODUCTS["k2only"] = ["k2"]
    try:
        plan = other.replan("k2only", 1)
    finally:
        del provkit.PRODUCTS["k2only"]
    c.replan("k2r1r2", 2)  # a publication again: every plan at its version 2
    shutil.copy(plan, c.root / "assemblies" / plan.name)
    with pytest.raises(FqError, match=r"campaign identity differs in 'name'"):
        combine(c.root / "assemblies" / plan.name, c.pub, tmp_path / "c.safetensors", now=NOW)


def test_a_plan_not_in_the_publication_is_refused(c, tmp_path):
    provkit.PRODUCTS["k2only"] = ["k2"]
    try:
        plan = provkit._plan(c, "k2only", 1, provkit.EXPIRES, c.priv)  # signed, but not published
    finally:
        del provkit.PRODUCTS["k2only"]
    with pytest.raises(FqError, match=rf"product 'k2only' is not in the publication .*{PUBLICATION_NAME} \(version 1 "
                                      r"lists k2r1, k2r1r2\); a plan from another publication\?"):
        combine(plan, c.pub, tmp_path / "a.safetensors", now=NOW)
    assert f"{plan}: not listed in {PUBLICATION_NAME} (not part of this publication)" in problems(c)


# -- 3. rollback across campaigns of one signer ----------------------------------------------------------------

def test_an_older_campaign_of_the_same_signer_is_a_rollback(tmp_path, capsys):
    old = provkit.build_campaign(tmp_path / "old", name="spring")
    new = provkit.build_campaign(tmp_path / "new", signer=old, name="autumn", version=2)
    state = tmp_path / "state.json"
    assert main(["combine", "--key", str(new.pub_path), "--plan", str(new.plans["k2r1"]), "--out",
                 str(tmp_path / "new.safetensors"), "--state", str(state)]) == 0
    recorded = json.loads(state.read_text())
    fp = new.campaign["signer"]
    assert set(recorded) == {f"{fp}/product/k2r1", f"{fp}/publication"}
    assert {v["version"] for v in recorded.values()} == {2}
    capsys.readouterr()
    assert main(["combine", "--key", str(old.pub_path), "--plan", str(old.plans["k2r1"]), "--out",
                 str(tmp_path / "old.safetensors"), "--state", str(state)]) == 2
    err = capsys.readouterr().err
    assert err == (f"fq combine: {old.plans['k2r1']}: plan version 1 is older than version 2 already seen for k2r1 "
                   "(rollback refused); versions rise per signer, across its campaigns\n")
    # a product the newer campaign's consumer never opened: the publication's version still refuses it
    with pytest.raises(FqError, match=r"publication version 1 is older than version 2 already seen for signer "):
        combine(old.plans["k2r1r2"], old.pub, tmp_path / "old.safetensors", now=NOW, state=PlanState(state))
    got = problems(old, state=PlanState(state))
    assert any("publication version 1 is older than version 2" in p for p in got), got
    assert any("plan version 1 is older than version 2 already seen for k2r1 (rollback refused)" in p for p in got)
    assert verify_path(new.root, new.pub, now=NOW, state=PlanState(state)).ok


def test_promote_refuses_a_publication_version_not_above_the_destinations(tmp_path, capsys):
    def campaign_dir(c):  # what finalize leaves: OUT/published and the summary beside it
        out = c.root.parent / "out"
        out.mkdir()
        os.rename(c.root, out / "published")
        stmt = read_publication(out / "published", c.pub)
        (out / SUMMARY_NAME).write_text(canonical.pretty(summary_view(stmt.predicate)))
        return out

    a = provkit.build_campaign(tmp_path / "a", version=2)
    b = provkit.build_campaign(tmp_path / "b", signer=a, version=2, seed=1)  # other bytes, the same version
    older = provkit.build_campaign(tmp_path / "older", signer=a, version=1, seed=2)
    newer = provkit.build_campaign(tmp_path / "newer", signer=a, version=3, seed=3)
    outs = {n: campaign_dir(c) for n, c in (("a", a), ("b", b), ("older", older), ("newer", newer))}
    dest, key = tmp_path / "dest", str(a.pub_path)
    assert main(["promote", str(outs["a"]), "--to", str(dest), "--key", key]) == 0
    first = os.readlink(dest / "published")
    for name in ("b", "older"):
        capsys.readouterr()
        assert main(["promote", str(outs[name]), "--to", str(dest), "--key", key]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(rf"fq promote: promote {re.escape(str(outs[name]))} to {re.escape(str(dest))}: publication "
                            rf"version {1 if name == 'older' else 2} is not above version 2 of generation gen-\w+ "
                            r"\(promoted before\); consumers refuse a lower version and a changed publication under "
                            r"the same one \(raise assembly.version and finalize again\)\n", err), err
        assert os.readlink(dest / "published") == first and len(list((dest / "generations").iterdir())) == 1
    assert main(["promote", str(outs["a"]), "--to", str(dest), "--key", key]) == 0  # the same content: no change
    assert main(["promote", str(outs["newer"]), "--to", str(dest), "--key", key]) == 0
    assert os.readlink(dest / "published") != first
    capsys.readouterr()
    assert main(["promote", str(outs["a"]), "--to", str(dest), "--key", key]) == 0  # back to a generation promoted
    assert os.readlink(dest / "published") == first  # before: the operator's rollback, said to be one
    assert f"rollback: {first.split('/')[1]}'s publication version is below version 3 promoted before; consumers " \
           "holding a state file refuse it" in capsys.readouterr().out
    assert main(["promote", str(outs["older"]), "--to", str(dest), "--key", key]) == 2  # never promoted: refused
    assert "publication version 1 is not above version 3" in capsys.readouterr().err
    history = [json.loads(line) for line in (dest / "promotions.jsonl").read_text().splitlines()]
    assert [(h["version"], h["signer"]) for h in history] == [(2, a.campaign["signer"]), (3, a.campaign["signer"]),
                                                              (2, a.campaign["signer"])]


@pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")  # huggingface_hub's LFS upload
def test_promote_to_the_hub_refuses_a_version_not_above_mains(tmp_path, capsys, monkeypatch):
    import huggingface_hub.constants
    from tests.kits.hubfake import FakeHub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    a = provkit.build_campaign(tmp_path / "a", version=2)
    b = provkit.build_campaign(tmp_path / "b", signer=a, version=2, seed=1)
    outs = {}
    for name, c in (("a", a), ("b", b)):
        out = c.root.parent / "out"
        out.mkdir()
        os.rename(c.root, out / "published")
        stmt = read_publication(out / "published", c.pub)
        (out / SUMMARY_NAME).write_text(canonical.pretty(summary_view(stmt.predicate)))
        outs[name] = out
    hub = FakeHub().start()
    try:
        hub.create_repo("org/model", {"README.md": b"# model\n"})
        args = ["--to", "hf://org/model", "--key", str(a.pub_path), "--endpoint", hub.endpoint]
        assert main(["promote", str(outs["a"]), *args]) == 0
        assert main(["promote", str(outs["a"]), *args]) == 0  # the same publication again
        main_sha = hub.head("org/model", "main")
        capsys.readouterr()
        assert main(["promote", str(outs["b"]), *args]) == 2
        err = capsys.readouterr().err
        assert "publication version 2 is not above version 2 of hf://org/model@main" in err, err
        assert hub.head("org/model", "main") == main_sha
    finally:
        hub.stop()


# -- 6. one set of plan checks ---------------------------------------------------------------------------------

def test_every_consumer_refuses_an_insider_signed_plan_with_a_wrong_fragment_size(c, tmp_path, capsys):
    """fq verify used to accept it (it never compared sizes), fq combine refused it: now the size is checked
    within the plan (a fragment's experts end where the fragment ends), where every consumer reads it."""
    plan = read_assembly(c.plans["k2r1r2"], c.pub, now=NOW).predicate
    victim = next(f for f in plan["fragments"] if f["node"] == "r1")
    victim["size"] += 1
    provkit.sign_plan(c, plan, "k2r1r2")  # the campaign's key signs it, and the publication listing it
    said = consumers(c, c.plans["k2r1r2"], tmp_path, capsys)
    msg = (f"{c.plans['k2r1r2']}: fragment {victim['name']}: size {victim['size']} is not where its last expert's "
           f"bytes end ({victim['size'] - 1}); a fragment holds nothing after its experts")
    for name, err in said.items():
        assert err == f"fq {name}: {msg}\n", (name, err)


def test_every_consumer_refuses_an_insider_signed_plan_with_a_wrong_header_digest(c, tmp_path, capsys):
    """The attestation-against-plan checks are one function (fq.provenance.product.VerifiedProduct.check_fragment):
    verify did not compare the header digest either."""
    plan = read_assembly(c.plans["k2r1r2"], c.pub, now=NOW).predicate
    victim = next(f for f in plan["fragments"] if f["node"] == "k2")  # a base fragment: mesh-plan reads it too
    attested = victim["header_sha256"]
    victim["header_sha256"] = "0" * 64
    provkit.sign_plan(c, plan, "k2r1r2")
    said = consumers(c, c.plans["k2r1r2"], tmp_path, capsys)
    msg = re.escape(f"{victim['name']}: attestation and plan disagree on the shard's header_sha256 "
                    f"('{attested}' attested, '{'0' * 64}' in the plan)")
    for name, err in said.items():
        assert err.count("\n") == 1 and re.search(msg, err), (name, err)


# -- errors a user must never see ------------------------------------------------------------------------------

def test_a_missing_fragment_is_one_line_naming_it_and_the_plans_that_need_it(c):
    frag = c.root / c.frag("r1", 1, 0)
    frag.unlink()  # its attestation stays: still one problem, named by the fragment
    want = [f"{frag}: missing (needed by plans k2r1, k2r1r2)"]
    assert problems(c) == want
    frag.with_name(frag.name + ".intoto.jsonl").unlink()
    assert problems(c) == want
    shutil.rmtree(c.root / "stages" / "r2")
    assert problems(c) == want + [f"{c.root}/stages/r2: missing, with the 4 fragments in it (needed by plan k2r1r2)"]
    assert verify_path(c.plans["k2r1"], c.pub, now=NOW).problems == [
        f"{c.plans['k2r1']}: fragment {c.frag('r1', 1, 0)} is missing"]


def test_a_wrong_key_is_one_line(c, tmp_path, capsys):
    assert main(["keygen", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert main(["verify", str(c.root), "--key", str(tmp_path / "other.pub")]) == 1
    err = capsys.readouterr().err
    assert re.fullmatch(rf"fq verify: {re.escape(str(c.root))}: none of the 17 signed documents verifies under the "
                        rf"pinned key [0-9a-f]{{16}}… \(their signatures name key ids {c.campaign['signer'][:16]}\); "
                        r"is --key this campaign's signer\?\n", err), err


def test_a_reencoded_plan_line_is_called_a_reencoding(c, tmp_path):
    state = PlanState(tmp_path / "state.json")
    combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, state=state)
    line = c.plans["k2r1"].read_bytes()
    reencoded = (json.dumps(json.loads(line), indent=None) + "\n").encode()  # ", " and ": ": the same signed payload
    assert reencoded != line
    c.plans["k2r1"].write_bytes(reencoded)
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1"], c.pub, tmp_path / "b.safetensors", now=NOW, state=state)
    assert re.search(r"k2r1\.assembly\.intoto\.jsonl: the envelope is encoded differently from the plan seen for k2r1 "
                     r"version 1: the same signed statement, but line sha256 [0-9a-f]{16}…, not [0-9a-f]{16}… "
                     r"\(a re-encoded copy of the published line; fetch the original\)", str(e.value)), str(e.value)
    assert "different plan" not in str(e.value)
    with pytest.raises(FqError, match=r"its envelope line is not fq's canonical encoding .*: a re-encoded copy of a "
                                      r"signed plan, not the line .* lists for product 'k2r1'"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "b.safetensors", now=NOW)
