"""A real one-node SLURM cluster on localhost, for tests and for docs/slurm.md's manual run.

Debian's ``slurmctld``, ``slurmd``, ``slurm-client`` and ``munge`` (installed by ``ensure_installed`` when
apt can reach its registry; we must be root), started as child processes in the foreground so that they
are ended by their own process ids. Everything (munge key and socket, slurm.conf, state, spool, logs)
lives under one directory; clients find the cluster through ``SLURM_CONF``. No accounting database:
``sacct`` has nothing to ask, which is exactly the case the profile's ``squeue`` status command is for.

The node advertises ``gpus`` stand-in GPU GRES whose device files are links to /dev/null (SLURM drops a
GPU without a device file): SLURM then schedules ``--gpus=N`` requests for real (a job waits for a free
GPU, two jobs never get the same one, CUDA_VISIBLE_DEVICES is set) while the work runs on the CPU. That
is what lets a GPU-less machine test the profile's GPU requests.

    python -m tests.kits.slurmkit DIR    # start a cluster in DIR, print its SLURM_CONF, stop on Ctrl-C
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo", "munged", "mungekey")


class Unavailable(Exception):
    """SLURM cannot run here; the message says why (a test skips with it)."""


def _missing() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]


def ensure_installed(timeout: float = 600) -> None:
    """Install the Debian packages if a binary is missing: needs root, apt-get and its registry."""
    if not _missing():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise Unavailable(f"SLURM binaries {_missing()} missing and not root with apt-get to install {PACKAGES}")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *PACKAGES]):
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise Unavailable(f"{' '.join(cmd)}: no answer in {timeout:.0f} s (registry unreachable?)") from None
        if p.returncode != 0:
            raise Unavailable(f"{' '.join(cmd)} failed (registry unreachable?): {p.stderr.strip()[-300:]}")
    if _missing():
        raise Unavailable(f"installed {PACKAGES} but {_missing()} still missing")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exe(name: str) -> str:
    for d in ("/usr/bin", "/usr/sbin"):  # never our own srun shim
        if Path(d, name).exists():
            return str(Path(d, name))
    return shutil.which(name) or name


class LocalSlurm:
    """slurmctld + slurmd + munged under ``root``; ``env`` points clients at it."""

    def __init__(self, root: str | os.PathLike, gpus: int = 2):
        self.root = Path(root).resolve()
        self.gpus = gpus
        self.conf = self.root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.node = socket.gethostname().split(".")[0]

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, SLURM_CONF=str(self.conf), PATH=f"{self.root / 'bin'}:{os.environ['PATH']}")

    def _write_srun_shim(self) -> None:
        # The slurm-jobstep executor (--executor slurm) drops SLURM_* from the environment of the srun it starts
        # inside the allocation (right for a cluster configured under /etc/slurm); this cluster's config is only
        # known through SLURM_CONF, so srun gets it back from a one-line wrapper first on PATH. (profiles/slurm's
        # fq-slurm starts no srun.)
        shim = self.root / "bin" / "srun"
        shim.parent.mkdir(exist_ok=True)
        shim.write_text(f'#!/bin/sh\nSLURM_CONF="{self.conf}" exec {_exe("srun")} "$@"\n')
        shim.chmod(0o755)

    def _spawn(self, name: str, *args: str) -> None:
        log = open(self.root / f"{name}.out", "ab")
        self.procs.append(subprocess.Popen([_exe(name), *args], stdout=log, stderr=subprocess.STDOUT,
                                           env=self.env, start_new_session=True))

    def _write_config(self) -> None:
        hw = subprocess.run([_exe("slurmd"), "-C"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
        node = " ".join(f for f in hw.split() if not f.startswith("NodeName="))
        for d in ("state", "spool", "munge"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        lines = [
            "ClusterName=fqtest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            f"SlurmctldPort={_free_port()}",
            f"SlurmdPort={_free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={self.root / 'state'}",
            f"SlurmdSpoolDir={self.root / 'spool'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}",
            f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SchedulerType=sched/backfill",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU",
            # no accounting database: sacct has nothing to read, job state lives in slurmctld for MinJobAge
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MinJobAge=3600",  # finished jobs stay visible to squeue (the status source) and scontrol for an hour
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            *(["GresTypes=gpu"] if self.gpus else []),
            f"NodeName={self.node} NodeAddr=127.0.0.1 {node}{gres} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        gres_conf = ""
        if self.gpus:
            dev = self.root / "dev"
            dev.mkdir(exist_ok=True)
            for i in range(self.gpus):
                if not (dev / f"nvidia{i}").is_symlink():
                    (dev / f"nvidia{i}").symlink_to("/dev/null")
            gres_conf = f"NodeName={self.node} Name=gpu File={dev}/nvidia[0-{self.gpus - 1}]\n"
        (self.root / "gres.conf").write_text(gres_conf)
        (self.root / "cgroup.conf").write_text("")

    def start(self, timeout: float = 60) -> "LocalSlurm":
        self._write_config()
        self._write_srun_shim()
        m = self.root / "munge"
        subprocess.run([_exe("mungekey"), "--create", "--force", f"--keyfile={m / 'munge.key'}"], check=True,
                       capture_output=True)
        os.chmod(m / "munge.key", 0o600)
        self._spawn("munged", "--foreground", "--force", f"--socket={m / 'munge.socket'}",
                    f"--key-file={m / 'munge.key'}", f"--pid-file={m / 'munged.pid'}", f"--log-file={m / 'munged.log'}",
                    f"--seed-file={m / 'munged.seed'}")
        self._wait(lambda: (m / "munge.socket").exists(), timeout, "munged socket")
        self._spawn("slurmctld", "-D", "-i", "-f", str(self.conf))
        self._spawn("slurmd", "-D", "-f", str(self.conf), "-N", self.node)
        self._wait(self._node_idle, timeout, "node idle in sinfo")
        return self

    def _node_idle(self) -> bool:
        p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], capture_output=True, text=True, env=self.env)
        return p.returncode == 0 and p.stdout.strip().startswith("idle")

    def _wait(self, ok, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p for p in self.procs if p.poll() is not None]
            if dead:
                raise Unavailable(f"{Path(dead[0].args[0]).name} exited ({dead[0].returncode}) while waiting for "
                                  f"{what}: {self.logs()}")
            if ok():
                return
            time.sleep(0.3)
        raise Unavailable(f"no {what} after {timeout:.0f} s: {self.logs()}")

    def logs(self, tail: int = 1500) -> str:
        out = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            p = self.root / name
            if p.is_file() and p.stat().st_size:
                out.append(f"--- {name}\n{p.read_text(errors='replace')[-tail:]}")
        return "\n".join(out)

    def _cancel_jobs(self, timeout: float = 30) -> None:
        """Cancel whatever still runs, so each job's slurmstepd (a child of slurmd that outlives it) exits."""
        ids = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True, env=self.env).stdout.split()
        if ids:
            subprocess.run(["scancel", *ids], capture_output=True, env=self.env)
        deadline = time.monotonic() + timeout
        while ids and time.monotonic() < deadline:
            if not subprocess.run(["squeue", "-h", "-t", "PD,R,CG", "-o", "%i"], capture_output=True, text=True,
                                  env=self.env).stdout.split():
                break
            time.sleep(0.5)

    def stop(self) -> None:
        if self.procs and all(p.poll() is None for p in self.procs):
            self._cancel_jobs()
        for p in reversed(self.procs):  # our own children, by pid
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self.procs.clear()

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


if __name__ == "__main__":
    ensure_installed()
    cluster = LocalSlurm(sys.argv[1]).start()
    print(f"export SLURM_CONF={cluster.conf}")
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.stop()
