"""The lock discipline of fq.workflow.locks, with real processes holding the locks; the disk-full write
path; hub metadata kept in the campaign. Fast: no Snakemake here (tests/test_crash.py runs it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kits import crashkit as k
from tests.kits.crashkit import holder, release
from fq.errors import FqError
from fq.workflow import locks


@pytest.fixture(autouse=True)
def _forget_held():
    """Locks this test process takes are dropped after each test (jobs would simply exit)."""
    yield
    for key in list(locks._HELD):
        locks.release(key)


def test_a_claim_held_by_another_process_is_refused_by_name_and_granted_after_it_exits(tmp_path):
    ld = tmp_path / "locks"
    p = holder(f"locks.hold_worker({str(ld)!r}, 'a-layer001-block000', 'block a-layer001-block000')")
    claim = locks.claim_path(ld, "a-layer001-block000")
    assert [m for _, m in k.flock_holders(claim)] == ["WRITE"]
    with pytest.raises(FqError, match=r"block a-layer001-block000: another worker holds its claim .*a-layer001-block000\.lock"):
        locks.hold_worker(ld, "a-layer001-block000", "block a-layer001-block000")
    locks.hold_worker(ld, "a-layer001-block001", "block a-layer001-block001")  # other blocks are free
    release(p)
    assert claim.exists()  # never unlinked
    assert locks.hold_worker(ld, "a-layer001-block000", "block a-layer001-block000") == claim
    assert (os.getpid(), "WRITE") in k.flock_holders(claim)


def test_workers_lock_shared_by_workers_exclusive_for_finalize_both_directions(tmp_path):
    ld = tmp_path / "locks"
    w = holder(f"locks.hold_worker({str(ld)!r}, 'x', 'block x')")
    with pytest.raises(FqError, match="encode workers \\(possibly orphans of a killed Snakemake\\) still hold"):
        locks.hold_finalize(ld)
    locks.hold_worker(ld, "y", "block y")  # workers share it
    locks.release(ld / "workers.lock")
    release(w)
    f = holder(f"locks.hold_finalize({str(ld)!r})")
    with pytest.raises(FqError, match="finalize holds .*workers.lock"):
        locks.hold_worker(ld, "z", "block z")
    release(f)
    assert locks.hold_finalize(ld) == ld / "workers.lock"


def test_second_launcher_is_refused_and_the_lock_dies_with_its_holder(tmp_path):
    out = tmp_path / "campaign"
    p = holder(f"locks.hold_campaign({str(out)!r})")
    with pytest.raises(FqError, match="another launcher holds .*campaign.lock.*refusing to start a second one"):
        locks.hold_campaign(out)
    p.kill()  # however its owner dies, the kernel releases it
    p.wait()
    assert locks.hold_campaign(out) == out / "locks" / "campaign.lock"


def test_launcher_lock_is_not_inherited_by_the_jobs_it_starts(tmp_path):
    out = tmp_path / "campaign"
    path = locks.hold_campaign(out)
    child = subprocess.run([sys.executable, "-c", "import time; time.sleep(0.2)"], pass_fds=())
    assert child.returncode == 0
    # a job started by the launcher must not keep the campaign lock after the launcher dies: O_CLOEXEC
    fd = locks._HELD[str(path)].fileno()
    assert not os.get_inheritable(fd)


def test_dead_temps_of_own_names_only(tmp_path):
    (tmp_path / ".tmp-a-layer001-block000.safetensors.x1").write_bytes(b"half")
    (tmp_path / ".tmp-a-layer001-block001.safetensors.x2").write_bytes(b"someone else's")
    (tmp_path / ".tmp-a[1]-layer001-block000.safetensors.x3").write_bytes(b"glob characters")
    removed = locks.remove_dead_temps(tmp_path, ["a-layer001-block000.safetensors"])
    assert [p.name for p in removed] == [".tmp-a-layer001-block000.safetensors.x1"]
    assert locks.remove_dead_temps(tmp_path, ["a[1]-layer001-block000.safetensors"])[0].name.endswith("x3")
    assert (tmp_path / ".tmp-a-layer001-block001.safetensors.x2").exists()


def test_disk_full_write_is_one_line_and_leaves_nothing(tmp_path):
    from fq.core import atomic
    from fq.workflow.finalize import disk_full_is_one_line

    mnt = tmp_path / "small"
    mnt.mkdir()
    with k.mounted_tmpfs(mnt, "64k", "a small tmpfs"):
        target = mnt / "big.safetensors"
        with pytest.raises(FqError, match=r"big.safetensors: No space left on device while writing it .* nothing "
                                          r"partial is published"):
            with disk_full_is_one_line(target):
                atomic.write_bytes(target, b"x" * (256 << 10))
        assert list(mnt.iterdir()) == []  # neither the file nor its temp


def test_hub_metadata_kept_in_the_campaign_plans_without_the_hub(tmp_path, monkeypatch):
    from fq.model.source import load_source
    from fq.workflow import hub
    from fq.workflow.campaign import load_campaign

    src = k.tiny_checkpoint(tmp_path / "src")
    rev = "0123456789abcdef0123456789abcdef01234567"
    local = load_source(src, revision=rev)

    class C:  # what persist_metadata reads of a campaign
        config = {"source": {"kind": "hub", "repo": "org/tiny", "revision": rev}}
        source = local

    listing = [p.name for p in src.iterdir()]
    meta = tmp_path / "campaign" / "meta"
    hub.persist_metadata(C, meta, listing=listing, fetch=lambda name: (src / name).read_bytes())
    assert sorted(p.name for p in meta.iterdir()) == sorted(["config.json", "model.safetensors.index.json",
                                                            "tokenizer_config.json", hub.META_DOC])
    from huggingface_hub import constants  # read HF_HUB_OFFLINE once, at import: patch the constant too, restored after

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    got = hub.load_persisted(meta, "org/tiny", rev)
    assert got.summary() | {"origin": None} == local.summary() | {"origin": None}
    assert hub.load_persisted(meta, "org/tiny", "f" * 40) is None  # another revision: not these files
    assert hub.load_persisted(meta, "org/other", rev) is None
    bad = dict(json.loads((src / "config.json").read_text()), hidden_size=256)
    with pytest.raises(FqError, match="differs from the one the campaign was planned from"):
        hub.persist_metadata(C, tmp_path / "m2", listing=listing,
                             fetch=lambda n: json.dumps(bad).encode() if n == "config.json" else (src / n).read_bytes())
    # the Snakefile plans from OUT/meta when it was stored for this repo@revision (offline: the hub is never asked)
    (tmp_path / "recipe.json").write_text(json.dumps(k.RECIPE))
    cfg = {"campaign": "crash", "out": str(tmp_path / "campaign"), "recipe": str(tmp_path / "recipe.json"),
           "source": {"kind": "hub", "repo": "org/tiny", "revision": rev}, "block_size": 2, "windows": "1,2",
           "windows_on_disk": 1, "allow_unloadable": True}  # crashkit's DeepseekV3 has no MLA: no runtime loads it
    c = load_campaign(cfg)
    assert c.plan.identity_sha256 == load_campaign(dict(cfg, source={"kind": "local", "path": str(src), "revision": rev})
                                                   ).plan.identity_sha256
    assert c.source_dir == meta


def test_rehearsal_switch_accepts_exactly_0_or_1():
    import argparse

    from fq.commands.gate import rehearsal_flag

    assert rehearsal_flag("0") is False and rehearsal_flag("1") is True
    for bad in ("yes", "true", "True", "no", "false", "01", " 1", "", "2", "-1"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected exactly 0 or 1"):
            rehearsal_flag(bad)



GPU_HOLDER = """
import gc, sys, time
from fq.workflow import devices
devices.visible_cuda_devices = lambda: 2
print(devices.claim("cuda", [0, 1], sys.argv[1]), flush=True)
devices._HELD.clear()  # what interpreter shutdown does to Python objects: the GPU must stay claimed
gc.collect()
time.sleep(1.0)  # stands in for the CUDA context's teardown at exit
print(time.time(), flush=True)
"""


def test_gpu_claim_is_held_until_the_process_is_gone_and_a_waiter_gets_it_then(tmp_path, capfd, monkeypatch):
    """A job holds its GPU until the process is gone (its CUDA context dies with it), not only until Python
    drops its objects; a job waiting for the GPU (profiles/local-gpu runs two per GPU) gets it right after."""
    import time

    from fq.workflow import devices

    locks_dir = tmp_path / "locks"
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    holders = [subprocess.Popen([sys.executable, "-c", GPU_HOLDER, str(locks_dir)], stdout=subprocess.PIPE, text=True,
                                env=env) for _ in (0, 1)]
    assert sorted(h.stdout.readline().strip() for h in holders) == ["cuda:0", "cuda:1"]  # one GPU each
    monkeypatch.setattr(devices, "visible_cuda_devices", lambda: 2)
    dev = devices.claim("cuda", [0, 1], locks_dir, wait_s=30)
    claimed_at = time.time()
    last_words = [float(h.stdout.readline()) for h in holders]
    for h in holders:
        h.wait(timeout=30)
    assert dev in ("cuda:0", "cuda:1") and claimed_at >= min(last_words)  # not before a holder was done
    assert devices._HELD[-1] > 255  # a raw descriptor moved high: the kernel closes it after the driver's
    assert "claimed cuda:" in capfd.readouterr().err
