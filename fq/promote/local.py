"""Promotion into a local publication directory: stage, verify, then swap one link.

    DEST/published -> generations/G          (relative symlink: what consumers open)
    DEST/generations/G/{base,stages,assemblies,campaign_summary.json}
    DEST/promotions.jsonl                    (one line per promotion: generation, previous, digest)

G is ``gen-`` + the first 16 hex digits of the publication's content digest, so promoting the same
campaign twice names the same generation. A new generation is copied (never linked: published bytes
are their own) into a hidden staging name, verified there with the pinned key, renamed to G, and only
then is ``published`` swapped: a new link is made under a temporary name and ``os.replace``d over the old
one, one atomic rename. A consumer resolves ``published`` to a whole verified generation, old or new,
never to a partial one. Old generations are kept (a consumer may still be reading one, and swapping the
link back is the rollback); ``keep=N`` prunes all but the N most recent ones this directory promoted.
Promoters of one DEST are serialized by an flock on ``DEST/.fq-promote.lock`` (never unlinked); holding it,
a promoter removes the staging copies and temporary links that killed promoters left behind.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from fq import atomic, canonical
from fq.errors import FqError
from fq.promote import Publication, raise_report
from fq.verify import verify_path

LINK = "published"
GENERATIONS = "generations"
HISTORY = "promotions.jsonl"


@dataclass
class LocalResult:
    generation: str
    path: Path
    previous: str | None
    files: int
    bytes: int
    unchanged: bool = False
    pruned: list[str] = field(default_factory=list)


@contextlib.contextmanager
def _dest_lock(dest: Path):
    with open(dest / ".fq-promote.lock", "a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FqError(f"{dest}: another fq promote holds {dest / '.fq-promote.lock'}") from None
        yield


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    with open(src, "rb") as fin, open(dst, "xb") as fout:
        shutil.copyfileobj(fin, fout, 1 << 22)
        fout.flush()
        os.fsync(fout.fileno())


def current_generation(dest: Path) -> str | None:
    link = dest / LINK
    if not os.path.lexists(link):
        return None
    if not link.is_symlink():
        raise FqError(f"{link}: exists and is not a link; fq promote manages {LINK} as a link to a generation")
    target = os.readlink(link)
    parts = Path(target).parts
    if len(parts) != 2 or parts[0] != GENERATIONS:
        raise FqError(f"{link} -> {target}: not a generation fq promote made ({GENERATIONS}/NAME)")
    return parts[1]


def _history(dest: Path) -> list[dict]:
    path = dest / HISTORY
    if not path.exists():
        return []
    return [canonical.loads(line, f"{path}:{i + 1}") for i, line in enumerate(path.read_text().splitlines()) if line]


def _remove_dead_leftovers(dest: Path) -> None:
    """Staging copies and temporary links of promoters that were killed: with the DEST lock held, nobody
    else is writing them."""
    for p in (dest / GENERATIONS).glob(".staging-*"):
        shutil.rmtree(p)
    for p in dest.glob(f".{LINK}.tmp-*"):
        p.unlink()


def _swap(dest: Path, generation: str) -> None:
    tmp = dest / f".{LINK}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(f"{GENERATIONS}/{generation}")
    os.replace(tmp, dest / LINK)  # the one step a consumer can observe
    atomic.fsync_dir(dest)


def promote_local(pub: Publication, dest: str | os.PathLike, key, *, keep: int | None = None) -> LocalResult:
    """Stage ``pub`` as a generation of ``dest``, verify it with ``key``, swap ``dest/published`` to it."""
    if keep is not None and keep < 1:
        raise FqError(f"--keep {keep}: must be at least 1 (the generation being published)")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    gens = dest / GENERATIONS
    gens.mkdir(exist_ok=True)
    with _dest_lock(dest):
        _remove_dead_leftovers(dest)
        previous = current_generation(dest)
        name = f"gen-{pub.digest()[:16]}"
        target = gens / name
        if not target.exists():
            stage = gens / f".staging-{name}-{os.getpid()}"
            if stage.exists():
                shutil.rmtree(stage)
            try:
                for rel, src in pub.files.items():
                    _copy(src, stage / rel)
                # verify the copy, not the source: what consumers will read is what was checked
                raise_report(verify_path(stage, key), f"promote {pub.campaign}: staged generation {stage}")
                os.rename(stage, target)
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            atomic.fsync_dir(gens)
        else:  # same content promoted before: the link never points at a tree verified by someone else
            raise_report(verify_path(target, key), f"promote {pub.campaign}: existing generation {target}")
        unchanged = previous == name
        if not unchanged:
            _swap(dest, name)
            history = _history(dest) + [{"generation": name, "previous": previous, "digest": pub.digest(),
                                         "files": len(pub.files)}]
            atomic.write_text(dest / HISTORY, "".join(canonical.dumps(h).decode() + "\n" for h in history))
        pruned = _prune(dest, name, keep) if keep is not None else []
    sizes = pub.digests()
    return LocalResult(name, target, previous, len(pub.files), sum(z for _, z in sizes.values()), unchanged, pruned)


def _prune(dest: Path, current: str, keep: int) -> list[str]:
    """Delete generations this directory promoted, beyond the ``keep`` most recent (never the current)."""
    order: list[str] = []
    for h in reversed(_history(dest)):
        if h["generation"] not in order:
            order.append(h["generation"])
    keep_set = set(order[:keep]) | {current}
    pruned = []
    for name in order[keep:]:
        path = dest / GENERATIONS / name
        if name not in keep_set and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
            pruned.append(name)
    return pruned
