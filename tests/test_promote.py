"""fq promote: a local publication directory for real, and a Hub repository against a fake Hub (tests/kits/hubfake.py).

The campaign is provkit's signed tree placed as OUT/published, with a summary bound to its publication statement and the
operational files a real campaign directory holds (logs, locks, keys, metrics, staging, fragments) beside it.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.kits import provkit
from fq.cli import main as fq_main
from fq.core import canonical
from fq.errors import FqError
from fq.promote import collect, is_publishable
from fq.provenance.publication import NAME as PUBLICATION_NAME, read_publication
from fq.provenance.summary import SUMMARY_NAME, summary_view
from fq.provenance.verify import verify_path
from tests.kits.hubfake import FakeHub

# huggingface_hub's own LFS upload passes bytes as data=, which httpx2 deprecates
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=<...>':DeprecationWarning")

OPERATIONAL = ("logs/encode/k2-layer001-block000.log", "locks/gpu-0.lock", "keys/signer.key", "metrics/k2/m.json",
               "staging/model-00001-of-00001.safetensors", "fragments/k2/k2-layer001-block000.safetensors",
               "campaign.json", "benchmarks/finalize.tsv", ".snakemake/log/x.log")


def write_summary(out: Path, c, recipe_name: str = "provkit", version: int = 1) -> None:
    """What finalize writes: the signed publication statement (re-signed, with ``version``, when what it states
    changes) and the summary, its view (fq.provenance.summary.summary_view)."""
    here = dataclasses.replace(c, root=out / "published")
    for product in provkit.PRODUCTS:  # finalize signs every plan with the publication's version
        provkit._plan(here, product, version, provkit.EXPIRES, c.priv)
    provkit.publish(c, version=version, recipe_name=recipe_name, root=out / "published")
    stmt = read_publication(out / "published", c.pub)
    (out / SUMMARY_NAME).write_text(canonical.pretty(summary_view(stmt.predicate)))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("promote")
    c = provkit.build_campaign(tmp, card=True, model_signing=True)  # base k2 with its model card and model.sig
    out = tmp / "out"
    out.mkdir()
    os.rename(c.root, out / "published")
    write_summary(out, c)
    for rel in OPERATIONAL:
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(b"operational " + rel.encode())
    return out, c


@pytest.fixture
def camp(built, tmp_path):
    """A private copy: tests tamper with it."""
    out, c = built
    shutil.copytree(out, tmp_path / "out", symlinks=True)
    return tmp_path / "out", c


def files_under(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def promote(*args) -> int:
    return fq_main(["promote", *map(str, args)])


# -- the publishable set -------------------------------------------------------------------------------

def test_publishable_set_is_enumerated_not_filtered(camp):
    out, c = camp
    pub = collect(out)
    assert set(pub.files) == set(files_under(out / "published")) | {SUMMARY_NAME}  # no operational file
    assert all(is_publishable(n) for n in pub.files) and not any(is_publishable(o) for o in OPERATIONAL)
    (out / "published" / "notes.txt").write_text("hello")
    (out / "published" / "stages" / ".tmp-x.safetensors.abc").write_bytes(b"")
    with pytest.raises(FqError, match=r"2 problem\(s\).*notes\.txt: not a publishable path.*\.tmp-x.*interrupted"):
        collect(out)


def test_summary_is_checked_against_the_signed_plans(camp):
    out, c = camp
    assert verify_path(out / "published", c.pub, summary=out / SUMMARY_NAME).ok
    doc = canonical.load(out / SUMMARY_NAME)
    doc["products"]["k2r1"]["bytes"] += 1
    doc["bases"]["k2"]["manifest_sha256"] = "f" * 64
    (out / SUMMARY_NAME).write_text(canonical.pretty(doc))
    problems = verify_path(out / "published", c.pub, summary=out / SUMMARY_NAME).problems
    assert any("products.k2r1.bytes" in p for p in problems) and any("bases.k2.manifest_sha256" in p for p in problems)


# -- local publication directory ------------------------------------------------------------------------

def test_local_promotion_swaps_one_link_to_a_verified_generation(camp, tmp_path, capsys):
    out, c = camp
    dest = tmp_path / "dest"
    (dest / "generations" / ".staging-gen-0-1234" / "base").mkdir(parents=True)  # a killed promoter's leftovers
    (dest / ".published.tmp-1234").symlink_to("generations/gen-0")
    (dest / "generations" / ".pruning-gen-1" / "stages").mkdir(parents=True)  # ...a killed pruner's
    (dest / "generations" / "gen-1.replaced").write_text("{}\n")  # the marker of a generation it removed
    (dest / "generations" / ".tmp-gen-2.replaced.x1y2").write_text("")
    assert promote(out, "--to", dest, "--key", c.pub_path) == 0
    assert sorted(p.name for p in dest.iterdir()) == [".fq-promote.lock", "generations", "promotions.jsonl", "published"]
    link = dest / "published"
    first = os.readlink(link)
    assert link.is_symlink() and first.startswith("generations/gen-")
    assert [p.name for p in (dest / "generations").iterdir()] == [first.split("/")[1]]
    assert set(files_under(link)) == set(collect(out).files)  # nothing operational, the summary at the root
    assert fq_main(["verify", str(link), "--key", str(c.pub_path)]) == 0  # through the link, summary included

    assert promote(out, "--to", dest, "--key", c.pub_path) == 0  # same content: same generation, no swap
    assert os.readlink(link) == first and "already current" in capsys.readouterr().out

    # a new generation (a changed recipe name: a new publication statement, with a higher version); a reader
    # resolving the link meanwhile only ever sees one whole generation
    summary_v1 = (out / SUMMARY_NAME).read_bytes()
    publication_v1 = (out / "published" / PUBLICATION_NAME).read_bytes()
    plans_v1 = {f"assemblies/{p.name}": p.read_bytes() for p in (out / "published" / "assemblies").iterdir()}
    write_summary(out, c, recipe_name="provkit-v2", version=2)
    families = [set(files_under(link))]
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            try:
                seen.append(frozenset(files_under(Path(os.path.realpath(link)))))
            except FileNotFoundError:  # a file of the generation vanished under us: never expected
                seen.append(None)

    t = threading.Thread(target=reader)
    t.start()
    try:
        assert promote(out, "--to", dest, "--key", c.pub_path, "--keep", "1") == 0
    finally:
        stop.set()
        t.join()
    second = os.readlink(link)
    assert second != first and all(s is not None and s == families[0] for s in seen)
    # --keep 1 does not remove the generation this promotion replaced (a reader may have resolved it a moment
    # before the swap); a later promotion does: test_local_keep_removes_replaced_generations_only_later
    assert files_under(dest / first) == files_under(Path(os.path.realpath(link))) | {SUMMARY_NAME: summary_v1,
                                                                                      PUBLICATION_NAME: publication_v1,
                                                                                      **plans_v1}
    assert fq_main(["verify", str(dest / first), "--key", str(c.pub_path)]) == 0
    said = capsys.readouterr().out
    assert "pruned" not in said and "1 replaced kept for readers" in said
    assert [h["generation"] for h in map(canonical.loads, (dest / "promotions.jsonl").read_text().splitlines())] == \
        [first.split("/")[1], second.split("/")[1]]


# A reader in its own process: resolves the link once, reports what it resolved, waits (holding no open file
# of the generation: an open descriptor would survive an unlink and hide the race), then reads every file
# of what it resolved and verifies it there.
READER = r"""
import contextlib, hashlib, json, os, sys
from pathlib import Path
from fq.cli import main
link, key = sys.argv[1], sys.argv[2]
gen = os.path.realpath(link)
print(gen, flush=True)
sys.stdin.readline()
files = {p.relative_to(gen).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
         for p in sorted(Path(gen).rglob("*")) if p.is_file()}
with contextlib.redirect_stdout(sys.stderr):
    rc = main(["verify", gen, "--key", key])
print(json.dumps({"files": files, "verify": rc}), flush=True)
"""


def generations(dest: Path) -> list[str]:
    return sorted(p.name for p in (dest / "generations").iterdir())


def current(dest: Path) -> str:
    return os.readlink(dest / "published").split("/")[1]


def test_local_reader_that_resolved_the_link_reads_its_whole_generation_after_promotions(camp, tmp_path):
    out, c = camp
    dest, link = tmp_path / "dest", tmp_path / "dest" / "published"
    assert promote(out, "--to", dest, "--key", c.pub_path) == 0
    a = current(dest)
    write_summary(out, c, recipe_name="provkit-v2", version=2)
    held = {n: sha for n, (sha, _) in collect(out).digests().items()}  # generation b, as the reader will read it
    assert promote(out, "--to", dest, "--key", c.pub_path, "--keep", "1", "--grace", "0") == 0
    b = current(dest)
    assert generations(dest) == sorted([a, f"{a}.replaced", b])

    reader = subprocess.Popen([sys.executable, "-c", READER, str(link), str(c.pub_path)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert reader.stdout.readline().strip() == str((dest / "generations" / b).resolve())  # it resolved b...
        # ...then, before it reads a byte, a promotion with the harshest settings swaps and prunes
        write_summary(out, c, recipe_name="provkit-v3", version=3)
        assert promote(out, "--to", dest, "--key", c.pub_path, "--keep", "1", "--grace", "0") == 0
        assert current(dest) not in (a, b) and not (dest / "generations" / a).exists()  # a pruned, b not
        said, _ = reader.communicate("read\n", timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0
    assert json.loads(said.splitlines()[-1]) == {"files": held, "verify": 0}  # every file of b, verified


def test_local_keep_removes_replaced_generations_only_later(camp, tmp_path, capsys):
    out, c = camp
    dest = tmp_path / "dest"
    for bad in (["--grace", "0"], ["--keep", "1", "--grace", "-1"], ["--keep", "1", "--grace", "nan"]):
        assert promote(out, "--to", dest, "--key", c.pub_path, *bad) == 2  # strict: nothing promoted
        assert capsys.readouterr().err.startswith("fq promote: ") and not os.path.lexists(dest / "published")
    assert promote(out, "--to", "hf://org/model", "--key", c.pub_path, "--grace", "0") == 2
    assert "not a Hub repository" in capsys.readouterr().err

    def promote_v(v, *keep):
        write_summary(out, c, recipe_name=f"provkit-v{v}", version=v)
        assert promote(out, "--to", dest, "--key", c.pub_path, *keep) == 0
        return current(dest)

    def replaced_at_ns(g):
        doc = canonical.loads((dest / "generations" / f"{g}.replaced").read_text())
        assert doc["generation"] == g
        return doc["replaced_at_ns"]

    a = promote_v(1)
    b = promote_v(2, "--keep", "1", "--grace", "0")
    assert generations(dest) == sorted([a, f"{a}.replaced", b])  # a: just replaced, kept whatever --grace says
    before = time.time_ns()
    assert promote_v(1, "--keep", "1", "--grace", "0") == a  # rollback to the kept generation: one swap
    assert generations(dest) == sorted([a, b, f"{b}.replaced"])  # a is current again: no marker; b kept
    assert before <= replaced_at_ns(b) <= time.time_ns()
    cc = promote_v(3, "--keep", "1", "--grace", "0")
    assert generations(dest) == sorted([a, f"{a}.replaced", cc])  # b (replaced by the rollback) removed now
    d = promote_v(4, "--keep", "2")  # default grace (a day): a, replaced a moment ago, stays
    assert generations(dest) == sorted([a, f"{a}.replaced", cc, f"{cc}.replaced", d])
    assert "1 replaced kept for readers" in capsys.readouterr().out
    assert promote_v(4, "--keep", "2", "--grace", "0") == d  # already current: a later promotion all the same
    assert generations(dest) == sorted([cc, f"{cc}.replaced", d])  # a removed; cc is within --keep 2
    assert "already current" in capsys.readouterr().out

    e = promote_v(5, "--keep", "1", "--grace", "3600")
    assert generations(dest) == sorted([cc, f"{cc}.replaced", d, f"{d}.replaced", e])  # both within the grace
    # cc was replaced two hours ago (its marker, rewritten: the only clock promotion reads), d a moment ago
    doc = canonical.loads((dest / "generations" / f"{cc}.replaced").read_text())
    doc["replaced_at_ns"] -= 2 * 3600 * 10 ** 9
    (dest / "generations" / f"{cc}.replaced").write_text(canonical.dumps(doc).decode())
    (dest / "generations" / f"{d}.replaced").unlink()  # replaced by an fq that recorded nothing: grace from now
    before = time.time_ns()
    assert promote_v(5, "--keep", "1", "--grace", "3600") == e
    assert generations(dest) == sorted([d, f"{d}.replaced", e]) and replaced_at_ns(d) >= before
    time.sleep(0.6)
    assert promote_v(5, "--keep", "1", "--grace", "0.5") == e  # d's grace has run out: nothing is left behind
    assert generations(dest) == [e] and "pruned 1" in capsys.readouterr().out
    assert sorted(p.name for p in dest.iterdir()) == [".fq-promote.lock", "generations", "promotions.jsonl", "published"]
    assert [h["generation"] for h in map(canonical.loads, (dest / "promotions.jsonl").read_text().splitlines())] == \
        [a, b, a, cc, d, e]
    assert fq_main(["verify", str(dest / "published"), "--key", str(c.pub_path)]) == 0


def test_local_promotion_refuses_a_bad_campaign_and_leaves_the_link(camp, tmp_path, capsys):
    out, c = camp
    dest = tmp_path / "dest"
    assert promote(out, "--to", dest, "--key", c.pub_path) == 0
    before = os.readlink(dest / "published")
    other = provkit.build_campaign(tmp_path / "other")  # a campaign signed by another key
    assert promote(out, "--to", dest, "--key", other.pub_path) == 2
    assert "problem(s)" in capsys.readouterr().err
    frag = out / "published" / "stages" / "r1" / "r1-layer001-block000.safetensors"
    data = bytearray(frag.read_bytes())
    data[-1] ^= 1
    frag.write_bytes(bytes(data))
    assert promote(out, "--to", dest, "--key", c.pub_path) == 2
    err = capsys.readouterr().err
    assert err.startswith("fq promote: ") and len(err.strip().splitlines()) == 1 and "r1-layer001-block000" in err
    assert os.readlink(dest / "published") == before
    assert [p.name for p in (dest / "generations").iterdir()] == [before.split("/")[1]]  # no staging left behind


@pytest.mark.parametrize("target", ["generations/..", "generations/gen-1.replaced",
                                    "generations/gen-0123456789abcdef/..", "../generations/gen-0123456789abcdef",
                                    "generations/.staging-gen-0-1"])
def test_local_promotion_refuses_a_current_link_to_no_generation(camp, tmp_path, capsys, target):
    """Issue 42: ``published -> generations/..`` was taken as generation '..', and its replacement marked by writing
    generations/..replaced. A link fq promote did not make is refused by name; nothing is copied or written."""
    out, c = camp
    dest = tmp_path / "dest"
    (dest / "generations").mkdir(parents=True)
    (dest / "published").symlink_to(target)
    assert promote(out, "--to", dest, "--key", c.pub_path) == 2
    err = capsys.readouterr().err
    assert err == (f"fq promote: {dest / 'published'} -> {target}: not a generation fq promote made "
                   f"(generations/gen-<16 hex digits>); point it at one, or remove it\n"), err
    assert os.readlink(dest / "published") == target
    assert sorted(p.name for p in dest.iterdir()) == [".fq-promote.lock", "generations", "published"]
    assert list((dest / "generations").iterdir()) == []


# -- Hugging Face repository (fake hub) -------------------------------------------------------------------

@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)  # the fake speaks LFS, not Xet
    monkeypatch.delenv("HF_TOKEN", raising=False)
    h = FakeHub().start()
    h.create_repo("org/model", {"README.md": b"# model\n", "stages/old/old-layer001-block000.safetensors": b"stale"})
    yield h
    h.stop()


def test_hub_promotion_copies_the_resolved_commit_and_a_concurrent_push_does_not_leak(camp, hub):
    out, c = camp
    pub = collect(out)
    evil = {"stages/r1/r1-layer001-block000.safetensors": b"pushed meanwhile",
            "stages/evil/evil-layer001-block000.safetensors": b"not ours", SUMMARY_NAME: b"{}"}
    # the push lands right after the staging branch is resolved (the second time it is read: the first is
    # the head the upload commit is computed from), before main is touched
    hub.after("GET", r"/api/models/org/model/revision/fq-staging",
              lambda h: h.push("org/model", "fq-staging", evil, message="concurrent push"),
              when=lambda h: h.seen("POST", r"/api/models/org/model/commit/fq-staging"))
    assert promote(out, "--to", "hf://org/model", "--key", c.pub_path, "--endpoint", hub.endpoint) == 0

    main = hub.tree("org/model", "main")
    local = {n: p.read_bytes() for n, p in pub.files.items()}
    assert {n: b for n, b in main.items() if is_publishable(n)} == local  # exactly the verified campaign
    assert main["README.md"] == b"# model\n" and "stages/old/old-layer001-block000.safetensors" not in main
    card = (out / "published" / "base/k2/README.md").read_bytes()  # the base's model card is published with it
    assert main["base/k2/README.md"] == card and card.startswith(b"---\nbase_model: ")
    assert main["base/k2/model.sig"] == (out / "published" / "base/k2/model.sig").read_bytes()
    staging = hub.tree("org/model", "fq-staging")
    assert staging["stages/evil/evil-layer001-block000.safetensors"] == b"not ours"  # the push happened...
    assert all(is_publishable(n) or n in (".gitattributes", "README.md") for n in set(main) | set(staging))

    repo = hub.repos["org/model"]
    (b1, staged, m1), (b2, _, m2), (b3, promoted, m3) = repo.log[2:]  # after the repository's own two commits
    assert (b1, b2, b3) == ("fq-staging", "fq-staging", "main") and m2 == "concurrent push"
    assert m3 == f"fq promote: main = fq-staging@{staged[:12]} (out)" and repo.branches["main"] == promoted
    # ...after the resolve: nothing was uploaded from then on, main was built from server-side copies
    resolved_at = max(i for i, (m, p) in enumerate(hub.requests) if p == "/api/models/org/model/revision/fq-staging")
    later = hub.requests[resolved_at:]
    assert not any(m == "PUT" or "/lfs/" in p or "/preupload/" in p for m, p in later)


def test_hub_promotion_refuses_a_staging_branch_changed_before_resolve(camp, hub, capsys):
    out, c = camp
    main_before = hub.head("org/model", "main")
    hub.after("POST", r"/api/models/org/model/commit/fq-staging",
              lambda h: h.push("org/model", "fq-staging", {"assemblies/k2r1.assembly.intoto.jsonl": b"swapped"}))
    assert promote(out, "--repo", "org/model", "--key", c.pub_path, "--endpoint", hub.endpoint) == 2
    err = capsys.readouterr().err
    assert "is not the verified campaign" in err and "assemblies/k2r1.assembly.intoto.jsonl: different bytes" in err
    assert hub.head("org/model", "main") == main_before  # nothing promoted
