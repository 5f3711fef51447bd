"""The demo campaign on a multi-GPU box with profiles/local-gpu (issue 9): are the GPUs used as configured?

Two real Snakemake runs of the demo campaign (the same signer key, the same config but for the GPUs):

  multi   encode.devices = --devices (e.g. 0,1), --resources gpu=<2 per named GPU> (the profile's rule)
  single  encode.devices = [--single] (one GPU), --resources gpu=2

While each runs, a sampler thread asks nvidia-smi every --interval seconds which processes hold a CUDA
context on which GPU (``--query-compute-apps``) and how busy each GPU is (``utilization.gpu``). Then:

  - every configured GPU ran encode jobs (seen in the samples, and named by the jobs' own logs);
  - no process held a context on a GPU that was not configured (in the single run: every other GPU);
  - no sample shows two processes on one GPU;
  - each job's log names the GPU it claimed, and those claims are among the configured GPUs;
  - the two published trees are byte-identical (every file's sha256), and `fq verify` accepts both.

Prints a table and writes JSON (--json). Exit status 1 if a check fails.

    python3 benchmarks/multi_gpu_campaign.py --devices 0,1 --single 1 --work /tmp/mg --json $OUT/multi_gpu.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
CLAIM = re.compile(r"fq: claimed (cuda:\d+)")


def smi(*query: str) -> list[list[str]]:
    p = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                       timeout=30)
    if p.returncode:
        raise RuntimeError(f"nvidia-smi {' '.join(query)}: {p.stderr.strip() or p.stdout.strip()}")
    return [[c.strip() for c in line.split(",")] for line in p.stdout.splitlines() if line.strip()]


class Sampler(threading.Thread):
    """nvidia-smi every ``interval`` s: {t, apps: [(gpu index, pid)], util: {gpu index: %}}."""

    def __init__(self, interval: float):
        super().__init__(daemon=True)
        self.interval, self.samples, self.stop = interval, [], threading.Event()
        self.uuid = {u: int(i) for i, u in smi("--query-gpu=index,uuid")}

    def run(self):
        t0 = time.monotonic()
        while not self.stop.is_set():
            t = time.monotonic() - t0
            apps = [(self.uuid[u], int(pid)) for u, pid in smi("--query-compute-apps=gpu_uuid,pid")]
            util = {int(i): int(u) for i, u in smi("--query-gpu=index,utilization.gpu")}
            self.samples.append({"t": round(t, 2), "apps": apps, "util": util})
            self.stop.wait(self.interval)


def tree_digest(root: Path) -> dict:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


def run_campaign(work: Path, name: str, devices: list[int], key: Path, interval: float) -> dict:
    d = work / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg["out"] = str(d / "out")
    cfg["recipe"] = str(ROOT / cfg["recipe"])  # relative paths would resolve in the run directory
    cfg["signer_key"] = str(key)
    cfg["encode"].update(device="cuda", devices=devices)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(d),
           "--configfile", str(d / "config.yaml"), "--profile", str(ROOT / "profiles" / "local-gpu"),
           "--resources", f"gpu={2 * len(devices)}"]
    env = dict(os.environ, **NO_MULTICAST)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    sampler = Sampler(interval)
    sampler.start()
    t = time.monotonic()
    with open(d / "snakemake.log", "w") as log:
        rc = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.monotonic() - t
    sampler.stop.set()
    sampler.join()
    if rc:
        tail = (d / "snakemake.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"{name}: snakemake exited {rc}; {d / 'snakemake.log'} ends:\n{tail}")
    out = d / "out"
    claims = {}
    for log in sorted((out / "logs").glob("*/*.log")):
        m = CLAIM.findall(log.read_text(errors="replace"))
        if m:
            claims[f"{log.parent.name}/{log.name}"] = m
    v = subprocess.run([sys.executable, "-m", "fq", "verify", str(out / "published"), "--key",
                        str(key.with_suffix(".pub"))], capture_output=True, text=True, cwd=str(ROOT))
    return {"name": name, "devices": devices, "wall_s": round(wall, 1), "samples": sampler.samples,
            "claims": claims, "verify_rc": v.returncode, "verify": (v.stdout + v.stderr).strip()[-400:],
            "published": tree_digest(out / "published"), "gpus": sorted(sampler.uuid.values())}


def check(run: dict) -> dict:
    """Per GPU: samples with a process on it, mean utilization; and the violations."""
    configured = set(run["devices"])
    per_gpu = {g: {"samples_busy": 0, "pids": set(), "util_sum": 0} for g in run["gpus"]}
    doubled, stray = [], []
    for s in run["samples"]:
        seen: dict = {}
        for g, pid in s["apps"]:
            seen.setdefault(g, set()).add(pid)
        for g, pids in seen.items():
            per_gpu[g]["samples_busy"] += 1
            per_gpu[g]["pids"] |= pids
            if len(pids) > 1:
                doubled.append({"t": s["t"], "gpu": g, "pids": sorted(pids)})
            if g not in configured:
                stray.append({"t": s["t"], "gpu": g, "pids": sorted(pids)})
        for g, u in s["util"].items():
            per_gpu[g]["util_sum"] += u
    n = max(1, len(run["samples"]))
    claimed = sorted({c for cs in run["claims"].values() for c in cs})
    gpus = {g: {"configured": g in configured, "samples_busy": v["samples_busy"], "of_samples": len(run["samples"]),
                "processes": len(v["pids"]), "mean_util_pct": round(v["util_sum"] / n, 1)}
            for g, v in per_gpu.items()}
    return {"gpus": gpus, "two_on_one_gpu": doubled, "on_unconfigured_gpu": stray, "claimed": claimed,
            "jobs_claiming": len(run["claims"]),
            "every_configured_gpu_used": all(gpus[g]["samples_busy"] > 0 for g in configured)
            and set(claimed) == {f"cuda:{g}" for g in configured}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--devices", default="0,1", help="GPUs of the multi-GPU run (comma-separated indices)")
    ap.add_argument("--single", type=int, default=None, help="the one GPU of the single-GPU run (default: the last)")
    ap.add_argument("--work", default="/tmp/fq-multi-gpu")
    ap.add_argument("--interval", type=float, default=0.25, help="nvidia-smi sampling period, seconds")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    devices = [int(x) for x in a.devices.split(",")]
    single = devices[-1] if a.single is None else a.single
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    key = work / "signer.key"
    if not key.exists():
        sys.path.insert(0, str(ROOT))
        from fq.provenance.attest import keys

        keys.generate(work / "signer")
    runs = [run_campaign(work, "multi", devices, key, a.interval),
            run_campaign(work, "single", [single], key, a.interval)]
    checks = {r["name"]: check(r) for r in runs}
    identical = runs[0]["published"] == runs[1]["published"]
    ok = identical and all(r["verify_rc"] == 0 for r in runs) and all(
        c["every_configured_gpu_used"] and not c["two_on_one_gpu"] and not c["on_unconfigured_gpu"]
        for c in checks.values())
    print(f"{'run':<7} {'wall s':>7}  {'gpu':>3} {'configured':>10} {'samples busy':>13} {'processes':>9} "
          f"{'mean util %':>11}")
    for r in runs:
        for g, v in checks[r["name"]]["gpus"].items():
            print(f"{r['name']:<7} {r['wall_s']:>7}  {g:>3} {str(v['configured']):>10} "
                  f"{v['samples_busy']:>6}/{v['of_samples']:<6} {v['processes']:>9} {v['mean_util_pct']:>11}")
    for r in runs:
        c = checks[r["name"]]
        print(f"{r['name']}: jobs claiming a GPU {c['jobs_claiming']}, claimed {c['claimed']}, two processes on one "
              f"GPU in {len(c['two_on_one_gpu'])} samples, on an unconfigured GPU in {len(c['on_unconfigured_gpu'])}"
              f" samples, fq verify rc {r['verify_rc']}")
    print(f"published trees identical: {identical} ({len(runs[0]['published'])} files)")
    print("PASS" if ok else "FAIL")
    if a.json:
        Path(a.json).write_text(json.dumps({"runs": runs, "checks": checks, "identical": identical, "ok": ok},
                                           indent=1, default=sorted))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
