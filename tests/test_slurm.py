"""profiles/slurm: what it asks of Snakemake (always), and a real SLURM run (opt-in: FQ_SLURM=1).

The real run (tests/slurmkit.py: Debian's slurmctld, slurmd and munged on localhost, no accounting database,
two stand-in GPUs) submits the demo campaign through the profile and requires the published campaign to be
byte-identical to a local run's under the same signer key. It installs slurm-wlm/munge with apt when missing
and takes minutes on two cores (docs/slurm.md has the numbers), too long for `make test`, so CI skips it:

    FQ_SLURM=1 .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_slurm.py
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fq.attest import keys
from fq.summary import SUMMARY_NAME
from slurmkit import LocalSlurm, Unavailable, ensure_installed
from test_workflow import LAYER_MODE, RECIPE, smk, tree_digest, write_config

REPO = Path(__file__).resolve().parents[1]


def test_gpu_lock_is_per_slurm_allocation(tmp_path, monkeypatch):
    """CUDA index 0 is another physical GPU in every allocation: jobs of two allocations never wait on one lock."""
    from fq.errors import FqError
    from fq.workflow import devices

    monkeypatch.setattr(devices, "visible_cuda_devices", lambda: 1)
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert devices.claim("cuda", [0], tmp_path) == "cuda:0"
    with pytest.raises(FqError, match="no free GPU among"):  # outside SLURM: one box, one lock per GPU
        devices.claim("cuda", [0], tmp_path, wait_s=0.1)
    for job in ("101", "102"):
        monkeypatch.setenv("SLURM_JOB_ID", job)
        assert devices.claim("cuda", [0], tmp_path, wait_s=0.1) == "cuda:0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu-0.lock", "gpu-slurm101-0.lock", "gpu-slurm102-0.lock"]


@pytest.mark.parametrize("per_job,members", [("layer", [3, 3]), ("block", [5, 5])])
def test_profile_groups_encodes_per_layer(tmp_path, per_job, members):
    """One group job per layer (a layer never spans two staging windows), every encode in one of them: per_job layer,
    one member per (node, layer) -- a and a.r1 (encode_layer), the hot stage (its own rule per block set, grouped like
    encode_layer) --, each member one `srun snakemake` step in the group's allocation; per_job block, one per block."""
    write_config(tmp_path, RECIPE, encode={**LAYER_MODE, "per_job": per_job})
    p = smk(tmp_path, "-n", "--profile", str(REPO / "profiles" / "slurm"))
    out = p.stdout + p.stderr
    assert re.findall(r"Group job (\S+) \(jobs", out) == ["encode-L001", "encode-L002"]
    blocks = re.split(r"Group job \S+ \(jobs in lexicogr\. order\):", out)[1:]
    member = r"^    rule encode(_layer(_\d+)?)?:" if per_job == "layer" else r"^    rule encode:"
    assert [len(re.findall(member, b.split("\n\n[")[0], re.M)) for b in blocks] == members
    assert not re.findall(r"^rule encode", out, re.M)  # no encode job outside a group
    assert ("rule encode_layer:" in out) == (per_job == "layer") and ("rule encode:" in out) == (per_job == "block")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if os.environ.get("FQ_SLURM") != "1":
        pytest.skip("the real SLURM run takes minutes (apt install, daemons, a campaign twice): set FQ_SLURM=1")
    try:
        ensure_installed()
        c = LocalSlurm(tmp_path_factory.mktemp("slurm"), gpus=2).start()
    except Unavailable as e:
        pytest.skip(f"no SLURM cluster here: {e}")
    yield c
    c.stop()


def slurm_jobs(cluster) -> list[dict]:
    """Every job slurmctld still remembers (MinJobAge=300 keeps finished ones): name=value fields."""
    out = subprocess.run(["scontrol", "show", "job", "-o"], capture_output=True, text=True, env=cluster.env,
                         check=True).stdout
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.splitlines() if line.strip()]


@pytest.mark.slow
@pytest.mark.timeout(2400)  # minutes on two cores, more when they are shared
def test_demo_campaign_through_the_slurm_profile_equals_a_local_run(cluster, tmp_path):
    key, pub, _ = keys.generate(tmp_path / "signer")  # one signer for both runs: the whole trees must match
    local, remote = tmp_path / "local", tmp_path / "slurm"
    for d in (local, remote):
        d.mkdir()
    # the local reference encodes per block, the cluster per layer (profiles/slurm's mode): the same bytes
    write_config(local, RECIPE, signer_key=str(key))
    write_config(remote, RECIPE, signer_key=str(key), encode=LAYER_MODE)
    t0 = time.monotonic()
    smk(local)
    t_local = time.monotonic() - t0

    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(remote),
           "--configfile", str(remote / "config.yaml"), "--profile", str(REPO / "profiles" / "slurm"),
           # the demo encodes on the CPU (gpu=0); ask for a stand-in GPU anyway, so that SLURM schedules the
           # profile's --gpus request per encode group for real
           "--set-resources", "encode_layer:gpu=1", "encode_layer_2:gpu=1", "encode_layer_3:gpu=1",
           "--cores", "2", "--jobs", "4", "--latency-wait", "5", "--default-resources", "runtime=10", "mem_mb=500",
           "--slurm-init-seconds-before-status-checks", "2"]
    env = dict(cluster.env, PATH=f"{Path(sys.executable).parent}:{cluster.env['PATH']}")
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    t_slurm = time.monotonic() - t0
    assert p.returncode == 0, f"{p.stdout[-3000:]}\n{p.stderr[-8000:]}\n{cluster.logs()}"

    a, b = local / "campaign", remote / "campaign"
    assert tree_digest(b / "published") == tree_digest(a / "published")
    assert (b / SUMMARY_NAME).read_bytes() == (a / SUMMARY_NAME).read_bytes()
    assert (b / "published.verified").read_text() == (a / "published.verified").read_text()

    # a real finalize's summary promotes and verifies (it is checked against the signed plans)
    dest = tmp_path / "dest"
    for args in (["promote", b, "--to", dest], ["verify", dest / "published"]):
        q = subprocess.run([sys.executable, "-m", "fq", *map(str, args), "--key", str(pub)], capture_output=True, text=True)
        assert q.returncode == 0, q.stderr

    jobs = slurm_jobs(cluster)
    groups = [j for j in jobs if j.get("Comment", "").startswith("rule_encode-L")]  # group jobs: rule_GROUPID_...
    assert len(list((b / "fragments").rglob("*.safetensors"))) == 10
    assert sorted(j["Comment"].split("_")[1] for j in groups) == ["encode-L001", "encode-L002"]
    logs = remote / ".snakemake" / "slurm_logs"  # kept by the profile (slurm-keep-successful-logs)
    # a group job's name lists its members' rules: a and a.r1 (encode_layer) and the hot stage's layer rule
    assert sorted(p.name for p in logs.glob("group_encode-*")) == ["group_encode-L001_encode_layer_encode_layer_2",
                                                                   "group_encode-L002_encode_layer_encode_layer_3"]
    assert all(len(list(p.glob("*.log"))) == 1 for p in logs.glob("group_*"))  # one SLURM job each
    assert not list(logs.glob("rule_encode*"))  # no encode ran as a SLURM job of its own
    assert all(j["JobState"] == "COMPLETED" and "gpu:1" in j.get("TresPerJob", "") for j in groups), groups
    assert all(j["JobState"] == "COMPLETED" for j in jobs)
    encodes = 6  # (a, a.r1, a.r1.h2) x 2 layers, 3 in each group job: 1 + 3 Snakefile parses per group job
    print(f"local {t_local:.0f} s, SLURM {t_slurm:.0f} s: {len(jobs)} SLURM jobs for {len(jobs) - 2 + encodes} "
          "Snakemake jobs")
