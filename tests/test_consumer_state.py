"""Issue 24, items 1 and 2: what every consumer records and what it compares before reading.

- `fq verify` reads and records the plan-version state (default ``$XDG_STATE_HOME/fq/plan-versions.json``, as
  `fq combine` does): a consumer who only verifies is refused an older publication afterwards.
- Sizes before hashes: a published file replaced by a sparse terabyte (free for whoever plants it) is refused by its
  listed size before a byte is read, by `fq verify`, `fq combine --base` and `fq promote` (which copies nothing).
"""
from __future__ import annotations

import json
import os
import re
import time

import pytest

from tests.kits import provkit
from fq.cli import main
from fq.cli_args import default_state
from fq.errors import FqError
from fq.provenance.assembly import PlanState
from fq.provenance.combine import combine
from fq.provenance.verify import verify_path

TB = 1 << 40


def two_versions(tmp_path):
    old = provkit.build_campaign(tmp_path / "old", name="spring")
    new = provkit.build_campaign(tmp_path / "new", signer=old, name="autumn", version=2)
    return old, new


def verify(c, *extra):
    return main(["verify", str(c.root), "--key", str(c.pub_path), *extra])


# -- 1. fq verify records what it accepted ------------------------------------------------------------------------

def test_verify_records_versions_in_the_default_state_and_then_refuses_a_rollback(tmp_path, capsys):
    old, new = two_versions(tmp_path)
    state = default_state()
    assert str(state).startswith(os.environ["XDG_STATE_HOME"]) and not state.exists()
    assert verify(new) == 0
    recorded = json.loads(state.read_text())
    fp = new.campaign["signer"]
    assert set(recorded) == {f"{fp}/publication"} | {f"{fp}/product/{p}" for p in provkit.PRODUCTS}
    assert {v["version"] for v in recorded.values()} == {2}
    capsys.readouterr()
    assert verify(old) == 1
    err = capsys.readouterr().err
    assert "publication version 1 is older than version 2 already seen" in err and "rollback refused" in err
    assert json.loads(state.read_text()) == recorded  # a refused tree records nothing


def test_verify_with_an_explicit_state_file_writes_it_and_no_state_writes_nothing(tmp_path, capsys):
    old, new = two_versions(tmp_path)
    state = tmp_path / "seen" / "state.json"
    assert verify(old, "--no-state") == 0 and not default_state().exists()
    assert verify(new, "--state", str(state)) == 0 and state.is_file() and not default_state().exists()
    assert verify(old, "--state", str(state)) == 1
    assert verify(old, "--no-state") == 0  # the user's explicit choice
    with pytest.raises(SystemExit):
        main(["verify", str(old.root), "--key", str(old.pub_path), "--no-state", "--state", str(state)])


def test_verify_of_a_tampered_tree_records_nothing(tmp_path, campaign_copy):
    c = campaign_copy
    (c.root / "stages/r1/stray.txt").write_text("x")
    assert verify(c) == 1 and not default_state().exists()


def test_a_junk_state_file_is_one_usage_error(tmp_path, capsys, campaign_copy):
    c = campaign_copy
    junk = tmp_path / "junk.json"
    junk.write_text('{"x": 1}')
    assert verify(c, "--state", str(junk)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "plan state must map signer/product" in err and str(junk) in err


def test_a_single_plan_verified_alone_is_recorded_too(tmp_path):
    old, new = two_versions(tmp_path)
    assert main(["verify", str(new.plans["k2r1"]), "--key", str(new.pub_path)]) == 0
    with pytest.raises(FqError, match="plan version 1 is older than version 2 already seen for k2r1"):
        combine(old.plans["k2r1"], old.pub, tmp_path / "a.safetensors", now=provkit.NOW,
                state=PlanState(default_state()))


# -- 2. sizes before hashes -----------------------------------------------------------------------------------------

def plant_sparse(path):
    """A terabyte where a published file was: no disk, a 50-minute hash."""
    with open(path, "r+b") as fh:
        fh.truncate(TB)
    assert os.stat(path).st_blocks * 512 < 1 << 30


@pytest.mark.parametrize("rel", ["stages/r1/r1-layer001-block000.safetensors", "base/k2/source_config.json",
                                 "base/k2/model-00001-of-00001.safetensors", "base/k2/config.json"])
def test_verify_refuses_a_sparse_terabyte_by_its_listed_size(tmp_path, rel, campaign_copy):
    c = campaign_copy
    if not (c.root / rel).exists():
        pytest.fail(f"provkit has no {rel}: {sorted(p.name for p in (c.root / 'base/k2').iterdir())}")
    plant_sparse(c.root / rel)
    t = time.monotonic()
    problems = verify_path(c.root, c.pub, now=provkit.NOW).problems
    assert time.monotonic() - t < 60  # hashing the terabyte would take the better part of an hour
    name = rel.rsplit("/", 1)[-1]
    mine = [p for p in problems if name in p and f"{TB} bytes" in p]
    assert mine and "refused before reading it" in mine[0], problems


def test_combine_base_refuses_a_sparse_terabyte_before_reading_it(tmp_path, campaign_copy):
    c = campaign_copy
    plant_sparse(c.root / "base/k2/source_config.json")
    with pytest.raises(FqError, match=rf"source_config\.json: {TB} bytes, fq-manifest\.intoto\.jsonl says \d+ "
                                      r"\(larger than listed; refused before reading it\)"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW, base_dir=c.root / "base/k2")
    assert not (tmp_path / "a.safetensors").exists()


def test_combine_refuses_a_sparse_fragment_by_the_plans_size(tmp_path, campaign_copy):
    c = campaign_copy
    plant_sparse(c.root / c.frag("r1", 1, 0))
    with pytest.raises(FqError, match=rf"{TB} bytes, the plan says \d+ \(larger than listed"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW)


def test_promote_refuses_a_sparse_terabyte_before_hashing_or_copying(tmp_path, capsys, campaign_copy):
    from tests.test_promote import write_summary

    c = campaign_copy
    out = tmp_path / "out"
    out.mkdir()
    os.rename(c.root, out / "published")
    write_summary(out, c)
    plant_sparse(out / "published" / c.frag("r1", 1, 0))
    dest = tmp_path / "dest"
    assert main(["promote", str(out), "--to", str(dest), "--key", str(c.pub_path)]) == 2
    err = capsys.readouterr().err
    assert f"{TB} bytes, its attestation says" in err and "refused before reading it" in err
    assert not (dest / "generations").exists() or not any((dest / "generations").iterdir())


# -- insider-signed but checkable: what a fragment says it was encoded with ------------------------------------------

def ldlq_args(layer: int, K: int = 1, codebook: str = "mcg", sha: str = "a" * 64) -> dict:
    from fq.hessian import store
    return {"seed": 0, "K": K, "codebook": codebook, "objective": store.OBJECTIVE_LDLQ,
            "hessian": {"file": store.file_name(layer), "sha256": sha, "calibration": "c" * 64,
                        "capture": "all-experts"}}


def refusals(c, rel, tmp_path):
    """What each entry point says of the tree: fq verify (tree and the shard alone) and fq combine."""
    tree = verify_path(c.root, c.pub, now=provkit.NOW).problems
    alone = verify_path(c.root / rel, c.pub, now=provkit.NOW).problems
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW)
    return tree, alone, str(e.value)


@pytest.mark.parametrize("case,args,message", [
    ("another layer's Hessian", {**ldlq_args(3)}, r"a fragment of layer 1 names Hessian file "
                                                   r"'hessian-layer003\.safetensors', not its layer's"),
    ("K that is not the fragment's", {**ldlq_args(1, K=3)}, r"quant_args says K=3, the fragment is K=1"),
    ("LDLQ without a Hessian", {k: v for k, v in ldlq_args(1).items() if k != "hessian"},
     r"objective is LDLQ but names no Hessian"),
    ("a Hessian under weight-only", {**ldlq_args(1), "objective": "weight-only MSE, no Hessian"},
     r"names a Hessian, but its objective is 'weight-only MSE, no Hessian', not LDLQ"),
])
def test_every_consumer_cross_checks_the_attested_quant_args(tmp_path, case, args, message, campaign_copy):
    c = campaign_copy
    rel = c.frag("r1", 1, 0)
    provkit.insider_resign(c, rel, quant_args=args)
    tree, alone, combined = refusals(c, rel, tmp_path)
    for got in (tree, alone, [combined]):
        assert any(re.search(message, m) for m in got), (case, got)


def test_combine_refuses_a_plan_whose_layer_mixes_two_objectives(tmp_path, campaign_copy):
    """One fragment of layer 1 re-signed as encoded against layer 1's Hessian, its neighbours weight-only: fq verify
    of the tree found it; fq combine and the runtime, which open one plan, now do too."""
    c = campaign_copy
    provkit.insider_resign(c, c.frag("r1", 1, 0), quant_args=ldlq_args(1))
    with pytest.raises(FqError, match=r"encoded against (weight-only|Hessian a{64}), but .* of the same layer 1 "
                                      r"against (Hessian a{64}|weight-only); a campaign binds one Hessian per layer"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW)
    assert any("a campaign binds one Hessian per layer" in p for p in verify_path(c.root, c.pub, now=provkit.NOW).problems)


def test_a_publication_and_its_plans_carry_one_version(tmp_path, campaign_copy):
    """An insider's statement at version 3 over plans of version 1 (finalize signs every plan with the publication's
    version): refused by the producer's own builder and by every consumer."""
    from fq.provenance.publication import NAME

    c = campaign_copy
    with pytest.raises(FqError, match="products.k2r1 is a plan of version 1, the publication is version 3"):
        provkit.publish(c, version=3)
    st = provkit._attested_line(c.root / NAME)
    st["predicate"]["version"] = 3
    (c.root / NAME).write_bytes(provkit._statement_line(st, c.priv))
    want = r"products\.k2r1 is a plan of version 1, the publication is version 3; a publication's plans carry its version"
    assert any(re.search(want, p) for p in verify_path(c.root, c.pub, now=provkit.NOW).problems)
    with pytest.raises(FqError, match=want):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW)
