"""Crash safety with real processes: Snakemake launched as an operator would, then killed.

One uninterrupted campaign (the baseline) is built per module on a tiny local checkpoint (128x128
experts, one K3 base and one K3 stage, block size 2: four encode jobs); while it runs, second launchers
are started against it. The other tests build their own campaign directories with the same signer
key, so everything they publish must be byte-identical to the baseline.

Figures (kills, resumes, bytes compared) are printed; run with ``pytest -s`` to see them.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.kits import crashkit as k
from fq.core import canonical
from fq.errors import FqError

pytestmark = pytest.mark.slow

COMPARED = ("published", "fragments", "skeleton", "metrics", "campaign_summary.json", "published.verified",
            "plan.json", "campaign.json")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("crash")
    return root, k.tiny_checkpoint(root / "src"), k.keygen(root / "keys" / "signer")


def campaign_digest(camp: Path) -> dict[str, str]:
    out = {}
    for name in COMPARED:
        p = camp / name
        if p.is_dir():
            out.update({f"{name}/{r}": h for r, h in k.tree_digest(p).items()})
        elif p.is_file():
            out[name] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def campaign_bytes(camp: Path) -> int:
    return sum((camp / r).stat().st_size for r in campaign_digest(camp))


@pytest.fixture(scope="module")
def inited(tiny):
    """A campaign directory where init has bound the key and the encoder, and nothing is encoded yet."""
    root, src, key = tiny
    d = root / "inited"
    k.write_config(d, src, key)
    k.smk(d, "campaign/campaign.json")
    return d


@pytest.fixture(scope="module")
def baseline(tiny):
    """The uninterrupted run; while it runs, three more launchers try the same campaign and a dry run looks at it."""
    root, src, key = tiny
    d = root / "baseline"
    k.write_config(d, src, key)
    p = k.start(d, *k.TARGETS)
    try:
        # the launcher takes the lock while Snakemake parses the Snakefile, before its DAG (fq.workflow.launch)
        k.wait_for(lambda: "this launcher holds" in (d / "launcher.log").read_text(errors="replace"), 120,
                   "the first launcher to take the campaign lock")
        seen = {}
        t = time.monotonic()
        seen["same_dir"] = k.smk(d, *k.TARGETS, check=False)
        seen["same_dir_s"] = time.monotonic() - t
        # without the workflow profile: Snakemake's own directory lock and incomplete-output check are on, and
        # would be Snakemake's to fail on first if fq's lock came after them
        seen["no_profile"] = k.smk(d, "--workflow-profile", "none", *k.TARGETS, check=False)
        other = root / "other-workdir"
        k.write_config(other, src, key, out=str(d / "campaign"))
        seen["other_dir"] = k.smk(other, check=False)
        seen["dry_run"] = k.smk(other, "-n", check=False)
        seen["first_alive"] = p.poll() is None
        assert p.wait(timeout=600) == 0, (d / "launcher.log").read_text()[-4000:]
    finally:
        if p.poll() is None:
            k.killpg(p)
    camp = d / "campaign"
    return d, campaign_digest(camp), seen


def test_second_launcher_on_one_campaign_is_refused(baseline):
    """Refused with fq's one line, always, and before Snakemake builds its DAG: the lock is taken at parse time, so
    no check of Snakemake's (its directory lock, an incomplete output of a job the first launcher is running) can
    stop the second launcher first with another error, and the refusal does not wait for a DAG."""
    d, digest, seen = baseline
    assert seen["first_alive"], "the first launcher must still be running while the others are tried"
    for key in ("same_dir", "no_profile", "other_dir"):  # same working directory, and another one whose out: points here
        p = seen[key]
        out = p.stdout + p.stderr
        assert p.returncode == 1, out[-3000:]
        assert "another launcher holds" in out and "campaign.lock" in out, out[-3000:]
        assert "refusing to start a second one" in out
        assert "Building DAG of jobs" not in out and "Exception" not in out, out[-3000:]
    assert seen["same_dir_s"] < 60
    assert seen["dry_run"].returncode == 0, seen["dry_run"].stderr[-3000:]  # snakemake -n is never blocked
    # the refused launchers changed nothing: the first one's campaign verifies
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(d / "campaign" / "published"), "--key",
                        str(d / "campaign" / "signer.pub")], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    print(f"\nsecond launchers refused: same working directory (with and without the workflow profile) and another "
          f"one; refusal took {seen['same_dir_s']:.1f} s")


def test_orphaned_encode_worker_keeps_its_claim(inited):
    d = inited
    t0 = time.monotonic()
    name = "a-layer001-block000"
    target = f"campaign/fragments/a/{name}.safetensors"
    claim = d / "campaign" / "locks" / "claims" / f"{name}.lock"
    p = k.start(d, target)
    try:
        holders = k.wait_for(lambda: claim.exists() and k.flock_holders(claim), 120, f"an encode job to claim {name}")
        orphan = holders[0][0]
        assert "encode" in k.cmdline(orphan)
        os.kill(p.pid, signal.SIGKILL)  # the launcher only: its worker keeps running, orphaned
        p.wait()
        assert k.alive(orphan) and k.flock_holders(claim) == holders
        # Freeze the orphan while the new launcher runs, so the test cannot race its finishing: stopped or not,
        # it is alive and holds its claim, which is all that matters.
        os.kill(orphan, signal.SIGSTOP)
        try:
            r = k.smk(d, target, check=False)
        finally:
            os.kill(orphan, signal.SIGCONT)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-3000:]
        assert f"block {name}" in out and "another worker holds its claim" in out, out[-3000:]
        assert k.alive(orphan) and k.flock_holders(claim) == holders  # refused without touching the orphan
        k.wait_for(lambda: not k.alive(orphan), 120, "the orphan to finish its block")
    finally:
        k.killpg(p)
    assert claim.exists()  # lock files are never unlinked
    assert not k.flock_holders(claim)
    frag = d / target  # the orphan committed its block whole

    from fq.provenance.attest import keys
    from fq.provenance.attest.fragment import verify_shard

    doc = canonical.load(d / "campaign" / "campaign.json")
    verify_shard(frag.parent, frag.name, keys.load_public(d / "campaign" / "signer.pub"), campaign=doc["identity"])
    orphans_bytes = frag.read_bytes()
    k.smk(d, "--force", target)  # the claim is free now: a new run gets it, and re-encodes the orphan's bytes
    assert frag.read_bytes() == orphans_bytes
    print(f"\norphan {orphan} kept claim {claim.name} after its Snakemake was SIGKILLed; a new run was refused it, "
          f"then got it after the orphan exited ({time.monotonic() - t0:.0f} s)")


def _finalize_started(log: Path, since: float) -> bool:
    """Finalize of this round holds the workers lock (Snakemake recreates the log for every run of the job)."""
    try:
        return log.stat().st_mtime >= since and "finalize: holding" in log.read_text(errors="replace")
    except FileNotFoundError:
        return False


def _finalize_step(log: Path) -> str:
    lines = [l for l in log.read_text(errors="replace").splitlines() if l.startswith("finalize: ")] if log.exists() else []
    return lines[-1].split()[1] if lines else "-"


def _finalize_seconds(log: Path) -> float:
    """How long the finalize pass took (its last log line says: 'finalize: done: ... [+S s]')."""
    last = [l for l in log.read_text().splitlines() if l.startswith("finalize: done:")][-1]
    return float(last.rsplit("[+", 1)[1].split()[0])


def _committed(camp: Path) -> int:
    return len(list((camp / "metrics").rglob("*.json"))) if (camp / "metrics").exists() else 0


def test_sigkill_loop_resumes_to_a_byte_identical_campaign(tiny, baseline):
    """SIGKILL the whole process group at seeded random points of encode, then of finalize; resume each time."""
    root, src, key = tiny
    base_dir, want, _ = baseline
    span = _finalize_seconds(base_dir / "campaign" / "logs" / "finalize.log")  # lock to done, uninterrupted
    d = root / "killed"
    k.write_config(d, src, key)
    camp = d / "campaign"
    flog = camp / "logs" / "finalize.log"
    rng = random.Random(20261129)
    kills, steps, rounds = Counter(), Counter(), Counter()
    # 8 kills, 4 of them in finalize (its verify, publish and sign steps each hit at seeded points): every round
    # costs a Snakemake start, so the count is the test's price
    n_fragments, min_kills, min_finalize_kills = 4, 8, 4
    t0 = time.monotonic()
    while True:
        assert sum(rounds.values()) < 100, f"no end in sight: kills {dict(kills)}, rounds {dict(rounds)}"
        before_commits, since = _committed(camp), time.time() - 0.05
        encoding = before_commits < n_fragments
        if sum(kills.values()) >= min_kills and kills["finalize"] >= min_finalize_kills and not encoding:
            break
        complete = (camp / "published.verified").is_file()
        # a campaign that finished before enough kills landed: finalize it again (idempotent) and keep killing
        extra = ("--forcerun", "finalize") if complete else ()
        rounds["forced finalize" if complete else "resume" if rounds else "first run"] += 1
        p = k.start(d, *k.TARGETS, *extra)
        try:
            if encoding:
                if kills["encode"] < 2:
                    # the first rounds: kill a block mid-encode (a block takes several seconds here)
                    k.wait_for(lambda: "encode" in k.running_scripts(p.pid).values() or p.poll() is not None, 300,
                               "an encode job")
                    delay = rng.uniform(0.0, 2.0)
                else:
                    # then wait for this run's first committed block (so every round makes progress), and kill at
                    # a random point of the blocks still in flight
                    k.wait_for(lambda: _committed(camp) > before_commits or p.poll() is not None, 300,
                               "a committed block")
                    delay = rng.uniform(0.0, 4.0)
                time.sleep(delay)
                running = sorted(set(k.running_scripts(p.pid).values()))
                step = None
            else:
                # wait until finalize holds the workers lock (its imports are done), then kill at a random point
                # of its verify/publish/sign pass (as long as its last full pass: some hundredths of a second)
                k.wait_for(lambda: _finalize_started(flog, since) or p.poll() is not None, 300, "finalize", poll=0.002)
                seen = time.monotonic()
                delay = rng.uniform(0.0, span)
                m = re.search(r"\(pid (\d+);", flog.read_text(errors="replace"))
                time.sleep(max(0.0, delay - (time.monotonic() - seen)))
                running = ["finalize"] if m and k.alive(int(m.group(1))) else []
                if not running:
                    running = sorted(set(k.running_scripts(p.pid).values()))
                step = _finalize_step(flog) if "finalize" in running else None
        finally:
            k.killpg(p)
        if flog.exists() and "finalize: done:" in flog.read_text(errors="replace"):
            span = _finalize_seconds(flog)  # a re-finalize (files already published) is quicker: aim at its pass
        if p.returncode == 0:  # it finished before the kill landed: not a kill
            continue
        assert p.returncode == -signal.SIGKILL, (d / "launcher.log").read_text()[-4000:]
        kills["finalize" if "finalize" in running else "encode" if "encode" in running else
              "other (" + ",".join(running or ["between jobs"]) + ")"] += 1
        if step:
            steps[step] += 1
    # the last resume runs to the end
    rounds["resume"] += 1
    p = k.start(d, *k.TARGETS)
    assert p.wait(timeout=600) == 0, (d / "launcher.log").read_text()[-4000:]
    wall = time.monotonic() - t0
    got = campaign_digest(camp)
    assert got == want, sorted(set(got.items()) ^ set(want.items()))[:10]
    nbytes = campaign_bytes(camp)
    leftovers = [str(p) for p in camp.rglob(".tmp-*")]
    assert not leftovers, leftovers
    staged = list((camp / "staging").glob("*.safetensors")) if (camp / "staging").exists() else []
    assert not staged, staged
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(camp / "published"), "--key", str(camp / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    total = sum(kills.values())
    resumes = sum(n for r, n in rounds.items() if r != "first run")
    print(f"\nSIGKILL loop: {total} kills of the whole process group {dict(kills)}, {resumes} resumes {dict(rounds)}, "
          f"{wall:.0f} s; finalize step at its kills (its last full pass took {span:.3f} s): {dict(steps)}; {len(got)} files, {nbytes} bytes compared with "
          f"the uninterrupted run: identical")
    assert total >= min_kills and kills["finalize"] >= min_finalize_kills and kills["encode"] >= 2
    assert resumes >= total


def _edit_encoder(path: Path, field: str, value) -> None:
    """Simulate a rebuilt encoder: change one bound field of campaign.json's encoder and re-seal its digest."""
    doc = canonical.load(path)
    enc = {kk: v for kk, v in doc["encoder"].items() if kk != "digest"}
    enc[field] = value
    enc["digest"] = canonical.sha256_hex(canonical.dumps(enc))
    doc["encoder"] = enc
    doc["identity"] = dict(doc["identity"], encoder=enc["digest"])
    path.write_text(canonical.pretty(doc))


def _campaign(d: Path):
    import yaml

    from fq.workflow.campaign import load_campaign

    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cwd = os.getcwd()
    os.chdir(d)
    try:
        return load_campaign(cfg)
    finally:
        os.chdir(cwd)


def _run_init(d: Path, key: Path):
    from fq.workflow.init import run_init

    cwd = os.getcwd()
    os.chdir(d)
    try:
        return run_init(_campaign(d), str(key), "cpu", "campaign/campaign.json")
    finally:
        os.chdir(cwd)


def test_other_key_or_rebuilt_encoder_fails_in_seconds_at_launch_init_and_encode(tiny, inited):
    root, src, key = tiny
    d = inited  # init bound the key and the encoder; this block is not encoded yet
    camp = d / "campaign"
    frag = "campaign/fragments/a/a-layer002-block000.safetensors"
    staged = sorted((camp / "staging").glob("*")) if (camp / "staging").exists() else []
    other = k.keygen(root / "keys" / "other")
    timings = {}

    k.write_config(d, src, other)
    t = time.monotonic()
    r = k.smk(d, *k.TARGETS, check=False)  # the launcher refuses before its first job
    timings["key at launch"] = time.monotonic() - t
    assert r.returncode != 0 and "is not this campaign's signer" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert (sorted((camp / "staging").glob("*")) if (camp / "staging").exists() else []) == staged  # nothing staged
    t = time.monotonic()
    r = k.smk(d, "--no-hooks", frag, check=False)  # without the launcher's check (as a cluster job runs): the job
    timings["key at encode"] = time.monotonic() - t
    assert r.returncode != 0 and "is not this campaign's signer" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]
    assert not (d / frag).exists()
    with pytest.raises(FqError, match="already bound to another signer"):
        _run_init(d, other)

    k.write_config(d, src, key)
    _edit_encoder(camp / "campaign.json", "torch", "0.0.0+rebuilt")
    t = time.monotonic()
    r = k.smk(d, *k.TARGETS, check=False)
    timings["encoder at launch"] = time.monotonic() - t
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "encoder build differs" in out and "torch" in out, out[-3000:]
    t = time.monotonic()
    r = k.smk(d, "--no-hooks", frag, check=False)
    timings["encoder at encode"] = time.monotonic() - t
    out = r.stdout + r.stderr
    assert r.returncode != 0 and "encoder build differs" in out and "0.0.0+rebuilt" in out, out[-3000:]
    assert not (d / frag).exists()
    with pytest.raises(FqError, match="already bound to another encoder"):
        _run_init(d, key)
    assert all(s < 60 for s in timings.values()), timings
    print("\nrefusals (whole snakemake invocation, seconds): " + ", ".join(f"{w} {s:.1f}" for w, s in timings.items()))


def _gate(capsys, monkeypatch, cfg: Path, *args, path: str | None = None) -> tuple[int, str, str]:
    """`fq gate` in this process (its CLI, exit code included): (exit code, stdout, stderr)."""
    from fq.cli import main

    monkeypatch.setenv("PATH", path if path is not None else k.env()["PATH"])
    monkeypatch.chdir(cfg.parent)  # the gate chdirs to --directory; monkeypatch restores our cwd afterwards
    capsys.readouterr()
    try:
        rc = main(["gate", "--configfile", str(cfg), "--directory", str(cfg.parent), *args])
    except SystemExit as e:  # argparse: usage errors
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def _gate_lines(out: str, status: str) -> set[str]:
    """The check names reported with ``status`` (ok, warn, FAIL, note)."""
    return {line.split(None, 1)[1].split("  ")[0].strip() for line in out.splitlines()
            if line.startswith(f"  {status} ")}


def test_release_gate_passes_a_finished_campaign(baseline, capsys, monkeypatch):
    d, _, _ = baseline
    rc, out, err = _gate(capsys, monkeypatch, d / "config.yaml")
    assert rc == 0, out + err
    assert "committed work" in _gate_lines(out, "ok") and "4 fragments" in out
    assert not _gate_lines(out, "FAIL")
    assert "cannot tell a persistent volume from an instance disk" in out


def test_release_gate_names_everything_that_would_not_survive_the_release(baseline, tmp_path, capsys, monkeypatch):
    """The campaign on its own filesystem (a tmpfs standing in for the persistent volume); the key, the recipe,
    the config, the source and fq itself elsewhere: each is named, exit 1; a rehearsal waives exactly that."""
    import json

    base_dir, _, _ = baseline
    vol = tmp_path / "vol"
    vol.mkdir()
    with k.mounted_tmpfs(vol, "16m", needs="; this test needs root"):
        shutil.copytree(base_dir / "campaign", vol / "campaign")
        cfg = json.loads((base_dir / "config.yaml").read_text())
        conf = tmp_path / "config.yaml"
        conf.write_text(json.dumps(dict(cfg, out=str(vol / "campaign"))))
        rc, out, err = _gate(capsys, monkeypatch, conf)
        assert rc == 1, out + err
        assert {"signer key", "recipe", "config file", "source checkpoint", "source shards", "fq package", "tool fq",
                "tool snakemake", "workflow Snakefile"} <= _gate_lines(out, "FAIL"), out
        assert {"campaign directory", "campaign.json", "signer.pub", "committed work", "processes"} <= _gate_lines(out, "ok")
        assert f"not on the campaign's filesystem {vol}" in out and "do NOT release" in out
        rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "1")  # finalizing here: off-volume only warns
        assert rc == 0, out + err
        assert "signer key" in _gate_lines(out, "warn") and "rehearsal: waived" in out
        rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "yes")
        assert rc == 2 and "'yes': expected exactly 0 or 1" in err, err
        # a missing tool is named, and fails even a rehearsal (finalize here would need it too)
        rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "1", path="/usr/bin:/bin")
        assert rc == 1 and {"tool fq", "tool snakemake"} <= _gate_lines(out, "FAIL"), out
        assert "fq: not found on PATH" in out and "snakemake: not found on PATH" in out
        # a launcher still running; an orphan worker still running
        camp = vol / "campaign"
        h = k.holder(f"locks.hold_campaign({str(camp)!r})")
        try:
            rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "1")
        finally:
            k.release(h)
        assert rc == 1 and "launcher" in _gate_lines(out, "FAIL"), out
        h = k.holder(f"locks.hold_worker({str(camp / 'locks')!r}, 'a-layer001-block000', 'block a-layer001-block000')")
        try:
            rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "1")
        finally:
            k.release(h)
        assert rc == 1 and "workers" in _gate_lines(out, "FAIL") and "possibly orphans" in out, out
        # an uncommitted block: the GPU work is not done
        (camp / "metrics" / "a" / "a-layer002-block000.json").unlink()
        rc, out, err = _gate(capsys, monkeypatch, conf, "--rehearsal", "1")
        assert rc == 1 and "committed work" in _gate_lines(out, "FAIL") and "a-layer002-block000.json" in out, out


def test_disk_full_while_publishing_leaves_no_partial_file(tiny, baseline):
    root, _, _ = tiny
    base_dir, want, _ = baseline
    d = root / "diskfull"
    shutil.copytree(base_dir, d, symlinks=True)  # the committed campaign, Snakemake's records included
    camp = d / "campaign"
    pub = camp / "published"
    want_pub = {r.removeprefix("published/"): h for r, h in want.items() if r.startswith("published/")}
    size = sum((base_dir / "campaign" / "published" / r).stat().st_size for r in want_pub)
    shutil.rmtree(pub)
    (camp / "campaign_summary.json").unlink()
    (camp / "published.verified").unlink()
    pub.mkdir()
    with k.mounted_tmpfs(pub, max(size // 2, 8192), "a small tmpfs", "; the disk-full test needs root"):
        r = k.smk(d, *k.TARGETS, check=False)
        out = r.stdout + r.stderr
        assert r.returncode != 0, out[-3000:]
        assert "No space left on device while writing it" in out and "nothing partial is published" in out, out[-4000:]
        files = [p for p in pub.rglob("*") if p.is_file()]
        assert files, "some files fit before the disk filled"
        for p in files:  # every file under its final name is whole: the bytes the uninterrupted run published
            rel = p.relative_to(pub).as_posix()
            assert not p.name.startswith(".tmp-"), rel
            assert hashlib.sha256(p.read_bytes()).hexdigest() == want_pub[rel], rel
        assert len(files) < len(want_pub)
        partial = len(files)
        subprocess.run(["mount", "-o", "remount,size=16m", str(pub)], check=True)  # the operator frees space
        k.smk(d, *k.TARGETS)  # and finalize resumes
        assert campaign_digest(camp) == want
    print(f"\ndisk full: tmpfs of {max(size // 2, 8192)} bytes for {size} bytes of products; {partial} whole files "
          f"published before the refusal, none partial; resumed after remount to the baseline's bytes")
