"""Which device an encode job runs on: never guessed.

``device: cpu`` encodes on the CPU. ``device: cuda`` needs the GPUs named in config (``devices``):
each job takes one by an flock on ``locks/gpu-<i>.lock`` (held until the process exits, however it
exits), so two jobs never share a GPU and no job touches a GPU the operator did not name. With CUDA
devices visible but none named, the job refuses: running one GPU while eight are billed is a bug.

Inside a SLURM allocation (``SLURM_JOB_ID`` set: profiles/slurm) CUDA index 0 is a different physical GPU
in every allocation, while ``locks/`` is on the shared filesystem: the lock is named after the allocation
(``gpu-slurm<JOBID>-<i>.lock``), so jobs of different allocations never wait on each other's GPU 0, and a
job waits for a sibling of its own group job as long as the allocation lasts (its time limit bounds it).
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from fq.errors import FqError

_HELD = []  # lock files stay open for the life of the process


def visible_cuda_devices() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def claim(device: str, devices: list[int], lock_dir: str | os.PathLike, wait_s: float = 600.0) -> str:
    """The torch device string this process may use; for CUDA, a claimed one of ``devices``."""
    if device == "cpu":
        return "cpu"
    if device != "cuda":
        raise FqError(f"config: encode.device: {device!r}, expected cpu or cuda")
    visible = visible_cuda_devices()
    if not devices:
        raise FqError(f"config: encode.devices is empty but encode.device is cuda ({visible} CUDA device(s) visible); "
                      f"name the GPUs to use, e.g. --config 'encode={{device: cuda, devices: [0, 1]}}'")
    bad = [d for d in devices if not 0 <= d < visible]
    if bad:
        raise FqError(f"config: encode.devices names {bad}, but only {visible} CUDA device(s) are visible")
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    allocation = os.environ.get("SLURM_JOB_ID")
    prefix = f"gpu-slurm{allocation}-" if allocation else "gpu-"
    deadline = time.monotonic() + wait_s if not allocation else float("inf")
    while True:
        for d in devices:
            fh = open(lock_dir / f"{prefix}{d}.lock", "a")
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                continue
            _HELD.append(fh)
            return f"cuda:{d}"
        if time.monotonic() > deadline:
            raise FqError(f"no free GPU among {devices} after {wait_s:.0f} s (each is held by another encode job); "
                          f"set the profile's gpu resource to at most {len(devices)}")
        time.sleep(0.5)
