"""Issue 24, items 1 and 2: what every consumer records and what it compares before reading.

- `fq verify` reads and records the plan-version state (default ``$XDG_STATE_HOME/fq/plan-versions.json``, as
  `fq combine` does): a consumer who only verifies is refused an older publication afterwards.
- Sizes before hashes: a published file replaced by a sparse terabyte (free for whoever plants it) is refused by its
  listed size before a byte is read, by `fq verify`, `fq combine --base` and `fq promote` (which copies nothing).
"""
from __future__ import annotations

import json
import os
import time

import pytest

import provkit
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


def test_verify_of_a_tampered_tree_records_nothing(tmp_path):
    c = provkit.build_campaign(tmp_path)
    (c.root / "stages/r1/stray.txt").write_text("x")
    assert verify(c) == 1 and not default_state().exists()


def test_a_junk_state_file_is_one_usage_error(tmp_path, capsys):
    c = provkit.build_campaign(tmp_path)
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
def test_verify_refuses_a_sparse_terabyte_by_its_listed_size(tmp_path, rel):
    c = provkit.build_campaign(tmp_path)
    if not (c.root / rel).exists():
        pytest.fail(f"provkit has no {rel}: {sorted(p.name for p in (c.root / 'base/k2').iterdir())}")
    plant_sparse(c.root / rel)
    t = time.monotonic()
    problems = verify_path(c.root, c.pub, now=provkit.NOW).problems
    assert time.monotonic() - t < 60  # hashing the terabyte would take the better part of an hour
    name = rel.rsplit("/", 1)[-1]
    mine = [p for p in problems if name in p and f"{TB} bytes" in p]
    assert mine and "refused before reading it" in mine[0], problems


def test_combine_base_refuses_a_sparse_terabyte_before_reading_it(tmp_path):
    c = provkit.build_campaign(tmp_path)
    plant_sparse(c.root / "base/k2/source_config.json")
    with pytest.raises(FqError, match=rf"source_config\.json: {TB} bytes, fq-manifest\.intoto\.jsonl says \d+ "
                                      r"\(larger than listed; refused before reading it\)"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW, base_dir=c.root / "base/k2")
    assert not (tmp_path / "a.safetensors").exists()


def test_combine_refuses_a_sparse_fragment_by_the_plans_size(tmp_path):
    c = provkit.build_campaign(tmp_path)
    plant_sparse(c.root / c.frag("r1", 1, 0))
    with pytest.raises(FqError, match=rf"{TB} bytes, the plan says \d+ \(larger than listed"):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=provkit.NOW)


def test_promote_refuses_a_sparse_terabyte_before_hashing_or_copying(tmp_path, capsys):
    from test_promote import write_summary

    c = provkit.build_campaign(tmp_path)
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
