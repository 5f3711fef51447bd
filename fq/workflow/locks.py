"""Who may write what in a campaign directory: kernel ``flock``s, never a file's existence.

All lock files live in ``OUT/locks/``:

    campaign.lock          the launcher (one Snakemake run) holds it exclusively for its lifetime
                           (taken while Snakemake parses the Snakefile: fq.workflow.launch), so two
                           launchers never drive one campaign, even from two working directories that
                           point ``out`` at it
    workers.lock           every job that writes into the campaign (stage, skeleton, encode, native)
                           holds it *shared* for its lifetime; finalize takes it *exclusively*, so
                           publication can never overlap a worker -- including an orphan whose
                           Snakemake was killed
    claims/NAME.lock       one per unit of work (``a-layer001-block000`` for a fragment); the job that
                           writes it holds it exclusively for its lifetime; anyone else is refused
    gpu-N.lock             one per named GPU (fq.workflow.devices)

A lock is held by an open file description, so the kernel releases it however its owner dies
(SIGKILL, OOM, preemption): a crashed worker leaves nothing to clean up, and nobody ever has to
decide whether another process's claim is "stale". A launcher killed with SIGKILL releases
``campaign.lock``, but its running jobs do not die with it: they keep their claims and their share
of ``workers.lock`` until they exit, which is exactly what a new launcher must respect.

Lock files are never unlinked. Unlinking a path that another process has already opened would let a
third process create a fresh file under the same name and flock *that* inode, while the first still
holds the old one: two owners of one block. The files are empty, so keeping them costs nothing.

Python opens files non-inheritable (O_CLOEXEC), so a launcher's ``campaign.lock`` is not inherited by
the job processes it starts; a lock taken here belongs to this process alone and lasts until it exits.
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from pathlib import Path
from typing import IO

from fq.errors import FqError

LOCK_DIR = "locks"
CAMPAIGN = "campaign.lock"
WORKERS = "workers.lock"
CLAIMS = "claims"

# Locks this process holds for its lifetime (closing the file would release them).
_HELD: dict[str, IO] = {}


def lock_dir(out: str | os.PathLike) -> Path:
    return Path(out) / LOCK_DIR


def claim_path(locks: str | os.PathLike, name: str) -> Path:
    return Path(locks) / CLAIMS / f"{name}.lock"


def _open(path: Path) -> IO:
    path.parent.mkdir(parents=True, exist_ok=True)
    # "a": create if absent, never truncate; the file is never unlinked (see the module docstring)
    return open(path, "a")


def try_flock(path: str | os.PathLike, exclusive: bool = True) -> IO | None:
    """The open lock file with the lock taken (non-blocking), or None when someone else holds it."""
    fh = _open(Path(path))
    try:
        fcntl.flock(fh, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except OSError as e:
        fh.close()
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return None
        raise
    return fh


def is_held(path: str | os.PathLike, exclusive: bool = True) -> bool:
    """Whether another process holds ``path`` in a mode that conflicts with ``exclusive``.
    Probing takes the lock for an instant; call it only where nobody may be starting (e.g. no launcher)."""
    if str(path) in _HELD:
        return False
    fh = try_flock(path, exclusive)
    if fh is None:
        return True
    fh.close()
    return False


def _keep(key: str, fh: IO) -> IO:
    _HELD[key] = fh
    return fh


def _hold(path: Path, exclusive: bool, refusal) -> Path:
    """Take ``path`` for the life of this process (once); ``refusal()`` builds the FqError message if held."""
    if str(path) not in _HELD:
        fh = try_flock(path, exclusive=exclusive)
        if fh is None:
            raise FqError(refusal())
        _keep(str(path), fh)
    return path


def release(path: str | os.PathLike) -> None:
    """Release a lock this process holds (tests and in-process callers; jobs simply exit)."""
    fh = _HELD.pop(str(path), None)
    if fh is not None:
        fh.close()


def hold_worker(locks: str | os.PathLike, name: str, what: str) -> Path:
    """A writing job's locks, for the life of this process: ``workers.lock`` shared, then the claim on
    ``name`` exclusively. Refuses (FqError, one line) when finalize is publishing or another process
    -- a live job, or an orphan of a killed Snakemake -- holds the claim. Returns the claim's path."""
    locks = Path(locks)
    workers = locks / WORKERS
    _hold(workers, False, lambda: f"{what}: finalize holds {workers} (it is publishing this campaign); refusing "
                                  f"to write into the campaign until it exits")
    claim = claim_path(locks, name)
    return _hold(claim, True, lambda: f"{what}: another worker holds its claim {claim} (a running job, or an orphan "
                                      f"of a killed Snakemake); refusing to write it. Wait until that process exits "
                                      f"(`fuser -v {claim}` names it), then run Snakemake again")


def hold_finalize(locks: str | os.PathLike) -> Path:
    """``workers.lock`` exclusively for the life of this process: no worker, live or orphaned, can be
    writing into the campaign while finalize verifies and publishes it."""
    workers = Path(locks) / WORKERS
    return _hold(workers, True, lambda: f"finalize: encode workers (possibly orphans of a killed Snakemake) still "
                                        f"hold {workers}; refusing to publish while they may be writing. Wait until "
                                        f"they exit (`fuser -v {workers}` names them), then run Snakemake again")


def holds(path: str | os.PathLike) -> bool:
    """Whether this process holds ``path`` (taken by one of the ``hold_*`` below)."""
    return str(path) in _HELD


def campaign_path(out: str | os.PathLike) -> Path:
    return lock_dir(out) / CAMPAIGN


def hold_campaign(out: str | os.PathLike) -> Path:
    """``campaign.lock`` exclusively for the life of this process (the launcher)."""
    path = campaign_path(out)
    return _hold(path, True, lambda: f"campaign {Path(out)}: another launcher holds {path} (a Snakemake run on this "
                                     f"campaign, possibly from another working directory); refusing to start a second "
                                     f"one. `fuser -v {path}` names it; stop it with one SIGINT (Ctrl-C) and wait, or "
                                     f"let it finish")


def remove_dead_temps(directory: str | os.PathLike, names) -> list[Path]:
    """Remove ``.tmp-NAME.*`` leftovers of interrupted atomic writes of ``names`` in ``directory``.
    Only for a caller that owns those names (holds their claim, or finalize's exclusive lock): then no
    live writer can be behind them. Returns what was removed."""
    d = Path(directory)
    removed = []
    if not d.is_dir():
        return removed
    for name in names:
        for p in d.glob(f".tmp-{_glob_escape(name)}.*"):
            if p.is_symlink() or p.is_file():
                p.unlink()
            elif p.is_dir():
                shutil.rmtree(p)
            else:
                continue
            removed.append(p)
    return removed


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
