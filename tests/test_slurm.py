"""profiles/slurm: what it asks of Snakemake (always), and a real SLURM run (opt-in: FQ_SLURM=1).

The real run (tests/kits/slurmkit.py: Debian's slurmctld, slurmd and munged on localhost, no accounting database,
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

from fq.provenance.attest import keys
from fq.provenance.summary import SUMMARY_NAME
from tests.kits.slurmkit import LocalSlurm, Unavailable, ensure_installed
from tests.test_workflow import LAYER_MODE, RECIPE, smk, tree_digest, write_config

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


class _Resources(dict):
    __getattr__ = dict.__getitem__  # job.resources.cpus_per_task, as the slurm plugin reads it


class _Job:
    def __init__(self, threads, **resources):
        self.threads, self.resources = threads, _Resources(resources)


def test_profile_runs_slurm_jobs_through_fq_slurm(tmp_path, monkeypatch):
    """profiles/slurm selects fq-slurm (snakemake_executor_plugin_fq_slurm, installed with fq): Snakemake finds it from
    any directory, its settings are the slurm plugin's under fq-slurm-, and the Snakemake a SLURM job runs executes its
    jobs with the local executor (no `srun snakemake` step and no second Snakefile parse per member), sized to the
    allocation: --cores as the CPUs sbatch was asked for, --resources gpu as its --gpus."""
    import yaml

    import snakemake_executor_plugin_fq_slurm as fq_slurm

    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    assert profile["executor"] == "fq-slurm"
    # no slurm-* key left: the slurm plugin's own settings are accepted, and fq-slurm would ignore them
    assert [k for k in profile if "slurm" in k] == ["fq-slurm-status-command",
                                                    "fq-slurm-init-seconds-before-status-checks",
                                                    "fq-slurm-keep-successful-logs"]
    probe = ("from snakemake_interface_executor_plugins.registry import ExecutorPluginRegistry as R\n"
             "p = R().get_plugin('fq-slurm'); print(p.cli_prefix, p.settings_cls.__module__, p.executor.__module__)")
    q = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True)  # not the checkout
    assert q.stdout.split() == ["fq-slurm", "snakemake_executor_plugin_slurm", "snakemake_executor_plugin_fq_slurm"], \
        q.stderr

    ex = object.__new__(fq_slurm.Executor)
    assert ex.additional_general_args() == "--executor local"  # the parent's: --executor slurm-jobstep --jobs 1
    monkeypatch.setattr(fq_slurm.SlurmExecutor, "get_job_args", lambda self, job: "--target-jobs x --cores all")
    assert ex.get_job_args(_Job(4, gpu=1)) == "--target-jobs x --cores all --cores 4 --resources gpu=1"
    assert ex.get_job_args(_Job(4, gpu=0)) == "--target-jobs x --cores all --cores 4"
    assert ex.get_job_args(_Job(1, gpu=2, cpus_per_gpu=8)) == "--target-jobs x --cores all --cores 16 --resources gpu=2"
    assert ex.get_job_args(_Job(4, cpus_per_task=-1)) == "--target-jobs x --cores all"  # no CPU request: the node's
    assert ex.get_job_args(_Job(1, gres="gpu:2", cpus_per_gpu=8)) == "--target-jobs x --cores all"  # GPUs unknown
    # only a run: directive makes the local executor start another snakemake (and parse): fq's rules have none
    sources = [REPO / "Snakefile", *sorted((REPO / "rules").glob("*.smk"))]
    assert not [p.name for p in sources if re.search(r"^\s+run:", p.read_text(), re.M)]


@pytest.mark.parametrize("per_job,members", [("layer", [3, 3]), ("block", [5, 5])])
def test_profile_groups_encodes_per_layer(tmp_path, per_job, members):
    """One group job per layer (a layer never spans two staging windows), every encode in one of them: per_job layer,
    one member per (node, layer) -- a and a.r1 (encode_layer), the hot stage (its own rule per block set, grouped like
    encode_layer) --, all run by the group job's one Snakemake process (fq-slurm); per_job block, one per block."""
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
           "--fq-slurm-init-seconds-before-status-checks", "2"]
    env = dict(cluster.env, PATH=f"{Path(sys.executable).parent}:{cluster.env['PATH']}")
    t0 = time.monotonic()
    # from outside the checkout, as on a login node: Snakemake must find fq-slurm where fq's install put it
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path)
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
    logs = remote / ".snakemake" / "slurm_logs"  # kept by the profile (fq-slurm-keep-successful-logs)
    # a group job's name lists its members' rules: a and a.r1 (encode_layer) and the hot stage's layer rule
    assert sorted(p.name for p in logs.glob("group_encode-*")) == ["group_encode-L001_encode_layer_encode_layer_2",
                                                                   "group_encode-L002_encode_layer_encode_layer_3"]
    assert all(len(list(p.glob("*.log"))) == 1 for p in logs.glob("group_*"))  # one SLURM job each
    assert not list(logs.glob("rule_encode*"))  # no encode ran as a SLURM job of its own
    assert all(j["JobState"] == "COMPLETED" and "gpu:1" in j.get("TresPerJob", "") for j in groups), groups
    assert all(j["JobState"] == "COMPLETED" for j in jobs)

    # fq-slurm: one Snakefile parse per SLURM job, the group's members run inside it. "Building DAG of jobs" is logged
    # once per Snakemake process that parses the Snakefile and plans the campaign (the job script's, and under the
    # slurm-jobstep executor each member's `srun snakemake` step too); "Provided remote nodes" is what a Snakemake
    # that hands its jobs to another executor (slurm-jobstep) logs, "Provided cores" what the local executor logs.
    parses = {p.relative_to(logs): p.read_text().count("Building DAG of jobs") for p in logs.rglob("*.log")}
    assert len(parses) == len(jobs) and set(parses.values()) == {1}, parses
    for p in logs.glob("group_encode-*/*.log"):
        text = p.read_text()
        assert "--executor local" in text and "Provided cores: " in text, text
        assert "Provided remote nodes" not in text, text
        assert len(re.findall(r"^localrule encode_layer(_\d+)?:$", text, re.M)) == 3, text  # a, a.r1, a.r1.h2
    # and no job step at all: slurmd logs "launch task StepId=<job>.<step>" for every srun inside an allocation
    steps = re.findall(r"launch task StepId=\S+", (cluster.root / "slurmd.log").read_text())
    assert not steps, steps
    encodes = 6  # (a, a.r1, a.r1.h2) x 2 layers, 3 in each group job: one Snakefile parse per group job
    print(f"local {t_local:.0f} s, SLURM {t_slurm:.0f} s: {len(jobs)} SLURM jobs for {len(jobs) - 2 + encodes} "
          f"Snakemake jobs; Snakefile parses per SLURM job: {sorted(set(parses.values()))}, job steps: {len(steps)}")
