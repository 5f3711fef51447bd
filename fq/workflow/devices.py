"""Which device an encode job runs on: never guessed.

``device: cpu`` encodes on the CPU. ``device: cuda`` needs the GPUs named in config (``devices``):
each job takes one by an flock on ``locks/gpu-<i>.lock`` (held until the process exits, however it
exits), so two jobs never share a GPU and no job touches a GPU the operator did not name. With CUDA
devices visible but none named, the job refuses: running one GPU while eight are billed is a bug.

A job claims its GPU late: ``check`` validates the request at the start (seconds), and ``claim`` runs
once the job has done what needs no GPU (imports, key and encoder checks, its first block's read), so
a second job per GPU (profiles/local-gpu: ``gpu`` = 2 per named GPU) waits there with all of that done
and starts encoding the moment the GPU's previous job exits. Nothing touches CUDA before the claim, so
a waiting job holds no context on any GPU.

Inside a SLURM allocation (``SLURM_JOB_ID`` set: profiles/slurm) CUDA index 0 is a different physical GPU
in every allocation, while ``locks/`` is on the shared filesystem: the lock is named after the allocation
(``gpu-slurm<JOBID>-<i>.lock``), so jobs of different allocations never wait on each other's GPU 0, and a
job waits for a sibling of its own group job as long as the allocation lasts (its time limit bounds it).
"""
from __future__ import annotations

import fcntl
import os
import resource
import sys
import time
from pathlib import Path

from fq.errors import FqError

_HELD = []  # lock descriptors stay open for the life of the process


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _last_to_close(fd: int) -> int:
    """Move the lock to the highest free descriptor number. A raw descriptor, not a Python file: the
    interpreter closes file objects while it shuts down, which freed the GPU while this process's CUDA
    context still lived (seen: the next job claimed it 0.4 s before this one had exited). The kernel closes
    a dying process's descriptors in ascending order, so the highest one goes after the driver's."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    top = 65535 if soft == resource.RLIM_INFINITY else min(soft, 65536) - 1
    try:
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, top - 16)
    except OSError:
        return fd
    os.close(fd)
    return high


def check(device: str, devices: list[int]) -> None:
    """Refuse a device request that can never be served (at a job's start, before anything is read)."""
    if device == "cpu":
        return
    if device != "cuda":
        raise FqError(f"config: encode.device: {device!r}, expected cpu or cuda")
    visible = visible_cuda_devices()
    if not devices:
        raise FqError(f"config: encode.devices is empty but encode.device is cuda ({visible} CUDA device(s) visible); "
                      f"name the GPUs to use, e.g. --config 'encode={{device: cuda, devices: [0, 1]}}'")
    bad = [d for d in devices if not 0 <= d < visible]
    if bad:
        raise FqError(f"config: encode.devices names {bad}, but only {visible} CUDA device(s) are visible")


def claim(device: str, devices: list[int], lock_dir: str | os.PathLike, wait_s: float | None = None,
          poll_s: float = 0.05) -> str:
    """The torch device string this process may use; for CUDA, a claimed one of ``devices``, waiting for one
    to come free (``wait_s``: give up after that long; None: as long as it takes -- every holder is a job that
    finishes or dies, and either frees its GPU). Says on stderr which GPU it took and how long it waited."""
    check(device, devices)
    if device == "cpu":
        return "cpu"
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    allocation = os.environ.get("SLURM_JOB_ID")
    prefix = f"gpu-slurm{allocation}-" if allocation else "gpu-"
    t0 = time.monotonic()
    deadline = t0 + wait_s if wait_s is not None and not allocation else float("inf")
    said = t0
    while True:
        for d in devices:
            fd = os.open(lock_dir / f"{prefix}{d}.lock", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            _HELD.append(_last_to_close(fd))
            print(f"fq: claimed cuda:{d} after {time.monotonic() - t0:.2f} s waiting", file=sys.stderr, flush=True)
            return f"cuda:{d}"
        now = time.monotonic()
        if now > deadline:
            raise FqError(f"no free GPU among {devices} after {wait_s:.0f} s (each is held by another encode job); "
                          f"set the profile's gpu resource to at most {2 * len(devices)}")
        if now - said >= 60:
            print(f"fq: waiting {now - t0:.0f} s for a free GPU among {devices}", file=sys.stderr, flush=True)
            said = now
        time.sleep(poll_s)
