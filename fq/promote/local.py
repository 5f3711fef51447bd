"""Promotion into a local publication directory: stage, verify, then swap one link.

    DEST/published -> generations/G          (relative symlink: what consumers open)
    DEST/generations/G/{base,stages,assemblies,publication.intoto.jsonl,campaign_summary.json}
    DEST/generations/G.replaced              (G was current once and is no longer: when it was replaced)
    DEST/promotions.jsonl                    (one line per promotion: generation, previous, digest, files,
                                              signer, version)

The campaign's published tree is verified with the pinned key first, before any file is hashed whole or
copied (``verify_path`` compares each file's listed size before reading it: a planted sparse terabyte is refused,
not hashed and copied). G is ``gen-`` + the first 16 hex digits of the publication's content digest (names,
sizes and the digests that verification checked), so promoting the same campaign twice names the same
generation. A new generation is copied (never linked: published bytes
are their own) into a hidden staging name, verified there with the pinned key, renamed to G, and only
then is ``published`` swapped: a new link is made under a temporary name and ``os.replace``d over the old
one, one atomic rename. A consumer resolves ``published`` to a whole verified generation, old or new,
never to a partial one.

Old generations are kept (a consumer may still be reading one, and swapping the link back is the
rollback). ``keep=N`` removes generations beyond the N most recent ones this directory promoted, but never

- the generation this very promotion replaced: a reader may have resolved the link a moment before the
  swap, so it is removed, at the earliest, by a later promotion; nor
- a generation replaced less than ``grace`` seconds ago (``G.replaced`` records when, on this host's
  clock; a replaced generation without one is given one now, so its grace starts now).

A reader that resolved ``published`` to G at time t can therefore read all of G until at least t + grace,
and in any case until a promotion after the one that replaced G. Pruning happens only inside a promotion
(there is no daemon): nothing is removed between promotions, and every promotion with ``keep`` removes
whatever has become removable, so nothing accumulates forever. A pruned generation is first renamed to a
hidden ``.pruning-G`` (one atomic step: no half-deleted tree ever bears a generation's name), then deleted.

Promoters of one DEST are serialized by an flock on ``DEST/.fq-promote.lock`` (never unlinked); holding it,
a promoter removes the staging copies, half-pruned trees and temporary links that killed promoters left
behind.

A new generation's publication version (its signed publication statement's) must be above every version
this directory promoted under the same key (``promotions.jsonl``) and above the current generation's: the
same content again is the same generation and changes nothing, but an older campaign, or a changed one under
a version already promoted, is refused before anything is copied (and checked again on the verified copy).
Promoting again a generation this directory promoted before (``promotions.jsonl``) is the operator's rollback
and is exempt: ``LocalResult.behind`` then names the highest version promoted when the generation's own is
below it, because consumers holding a state file refuse it (to roll content back for them, publish it again
with a higher version).
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from fq.core import atomic, canonical
from fq.errors import FqError, SignatureError
from fq.promote import Publication, check_version, raise_report
from fq.provenance.publication import NAME as PUBLICATION_NAME, read_publication
from fq.provenance.verify import verify_path

LINK = "published"
GENERATIONS = "generations"
HISTORY = "promotions.jsonl"
REPLACED = ".replaced"  # GENERATIONS/G.replaced: when G stopped being current
GENERATION_NAME = re.compile(r"gen-[0-9a-f]{16}")  # G: gen- and 16 hex digits of the publication's content digest
DEFAULT_GRACE_S = 24 * 3600


@dataclass
class LocalResult:
    generation: str
    path: Path
    previous: str | None
    files: int
    bytes: int
    unchanged: bool = False
    pruned: list[str] = field(default_factory=list)
    retained: list[str] = field(default_factory=list)  # beyond keep, but a reader may still hold them
    behind: int | None = None  # a rollback: the highest version promoted, above this generation's


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
    # the name becomes paths (the G.replaced marker, pruning): only one fq promote makes, never '..' or '.'
    if len(parts) != 2 or parts[0] != GENERATIONS or not GENERATION_NAME.fullmatch(parts[1]):
        raise FqError(f"{link} -> {target}: not a generation fq promote made ({GENERATIONS}/gen-<16 hex digits>); "
                      f"point it at one, or remove it")
    return parts[1]


def _history(dest: Path) -> list[dict]:
    path = dest / HISTORY
    if not path.exists():
        return []
    return [canonical.loads(line, f"{path}:{i + 1}") for i, line in enumerate(path.read_text().splitlines()) if line]


def _remove_dead_leftovers(dest: Path) -> None:
    """Staging copies, half-pruned trees, temporary links and marker temp files of promoters that were
    killed: with the DEST lock held, nobody else is writing them."""
    gens = dest / GENERATIONS
    for p in [*gens.glob(".staging-*"), *gens.glob(".pruning-*")]:
        shutil.rmtree(p)
    for p in [*dest.glob(f".{LINK}.tmp-*"), *gens.glob(f".tmp-*{REPLACED}.*")]:
        p.unlink()
    for p in gens.glob(f"*{REPLACED}"):  # the marker of a generation whose removal was interrupted
        if not (gens / p.name[:-len(REPLACED)]).is_dir():
            p.unlink()


def _swap(dest: Path, generation: str) -> None:
    tmp = dest / f".{LINK}.tmp-{os.getpid()}"
    with contextlib.suppress(FileNotFoundError):
        tmp.unlink()
    tmp.symlink_to(f"{GENERATIONS}/{generation}")
    os.replace(tmp, dest / LINK)  # the one step a consumer can observe
    atomic.fsync_dir(dest)


def _promoted_versions(dest: Path, current: str | None, signer: str, key) -> list[tuple[str, int]]:
    """(what, version) of the publications this directory holds or held under ``signer``'s key."""
    out = [(f"generation {h['generation']} (promoted before)", h["version"]) for h in _history(dest)
           if h.get("signer") == signer and type(h.get("version")) is int]
    if current is not None and os.path.lexists(dest / GENERATIONS / current / PUBLICATION_NAME):
        try:
            stmt = read_publication(dest / GENERATIONS / current, key)
        except SignatureError:
            return out  # another signer's publication: not this key's version sequence
        out.append((f"the current generation {current}", stmt.version))
    return out


def _mark_replaced(gens: Path, name: str, by: str | None, now_ns: int) -> None:
    atomic.write_text(gens / f"{name}{REPLACED}", canonical.dumps(
        {"generation": name, "replaced_at_ns": now_ns, "replaced_by": by}).decode() + "\n")


def _replaced_at_ns(gens: Path, name: str, now_ns: int) -> int:
    """When ``name`` stopped being current. No readable record (replaced by an fq that wrote none, or a
    damaged file): its grace starts now, and the record says so."""
    path = gens / f"{name}{REPLACED}"
    with contextlib.suppress(FileNotFoundError, FqError, UnicodeDecodeError):
        doc = canonical.loads(path.read_bytes(), str(path))
        if isinstance(doc, dict) and doc.get("generation") == name and type(doc.get("replaced_at_ns")) is int:
            return doc["replaced_at_ns"]
    _mark_replaced(gens, name, None, now_ns)
    return now_ns


def promote_local(pub: Publication, dest: str | os.PathLike, key, *, keep: int | None = None,
                  grace: float = DEFAULT_GRACE_S) -> LocalResult:
    """Stage ``pub`` as a generation of ``dest``, verify it with ``key``, swap ``dest/published`` to it.

    ``keep``: prune generations beyond the ``keep`` most recent, except the one this promotion replaced and
    any replaced less than ``grace`` seconds ago (module docstring)."""
    if keep is not None and keep < 1:
        raise FqError(f"--keep {keep}: must be at least 1 (the generation being published)")
    if not grace >= 0:  # NaN too
        raise FqError(f"--grace {grace}: must be a number of seconds >= 0")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    gens = dest / GENERATIONS
    gens.mkdir(exist_ok=True)
    with _dest_lock(dest):
        _remove_dead_leftovers(dest)
        previous = current_generation(dest)
        # the source verified before anything is hashed whole or copied: sizes first (a planted 1 TB sparse file is
        # refused, not hashed and copied), then the digests verification checked name the generation
        report = verify_path(pub.published, key, summary=pub.summary)
        raise_report(report, f"promote {pub.campaign}")
        pub.adopt(report)
        name = f"gen-{pub.digest()[:16]}"
        target = gens / name
        where = f"promote {pub.campaign} to {dest}"
        rollback = name != previous and target.is_dir() and any(h.get("generation") == name for h in _history(dest))
        if name != previous and not rollback:  # before copying
            early = read_publication(pub.published, key)
            check_version(early, _promoted_versions(dest, previous, early.signer, key), where)
        if not target.exists():
            stage = gens / f".staging-{name}-{os.getpid()}"
            if stage.exists():
                shutil.rmtree(stage)
            try:
                for rel, src in pub.files.items():
                    _copy(src, stage / rel)
                # verify the copy, not the source: what consumers will read is what was checked
                raise_report(verify_path(stage, key), f"promote {pub.campaign}: staged generation {stage}")
                stmt = read_publication(stage, key)
                check_version(stmt, _promoted_versions(dest, previous, stmt.signer, key), where)
                os.rename(stage, target)
            except BaseException:
                shutil.rmtree(stage, ignore_errors=True)
                raise
            atomic.fsync_dir(gens)
        else:  # same content promoted before: the link never points at a tree verified by someone else
            raise_report(verify_path(target, key), f"promote {pub.campaign}: existing generation {target}")
            stmt = read_publication(target, key)
            if name != previous and not rollback:  # renamed into place by a promoter killed before its swap
                check_version(stmt, _promoted_versions(dest, previous, stmt.signer, key), where)
        behind = None
        if rollback:  # promoted before: the operator's rollback, whatever its version
            highest = max((v for _, v in _promoted_versions(dest, previous, stmt.signer, key)), default=0)
            behind = highest if highest > stmt.version else None
        unchanged = previous == name
        if not unchanged:
            _swap(dest, name)
            if previous is not None:  # from this instant a reader may hold previous without knowing it is old
                _mark_replaced(gens, previous, name, time.time_ns())
            with contextlib.suppress(FileNotFoundError):  # current again (a rollback): not replaced
                (gens / f"{name}{REPLACED}").unlink()
            history = _history(dest) + [{"generation": name, "previous": previous, "digest": pub.digest(),
                                         "files": len(pub.files), "signer": stmt.signer, "version": stmt.version}]
            atomic.write_text(dest / HISTORY, "".join(canonical.dumps(h).decode() + "\n" for h in history))
        pruned, retained = _prune(dest, name, None if unchanged else previous, keep, grace) \
            if keep is not None else ([], [])
    sizes = pub.digests()
    return LocalResult(name, target, previous, len(pub.files), sum(z for _, z in sizes.values()), unchanged,
                       pruned, retained, behind)


def _prune(dest: Path, current: str, replaced: str | None, keep: int, grace: float) -> tuple[list[str], list[str]]:
    """Delete generations this directory promoted beyond the ``keep`` most recent, never the current one,
    never ``replaced`` (the one this promotion replaced), never one replaced less than ``grace`` s ago.
    Returns (pruned, retained: beyond ``keep`` but kept for readers)."""
    gens = dest / GENERATIONS
    order: list[str] = []
    for h in reversed(_history(dest)):
        if h["generation"] not in order:
            order.append(h["generation"])
    keep_set = set(order[:keep]) | {current}
    now_ns = time.time_ns()
    pruned, retained = [], []
    for name in order[keep:]:
        path = gens / name
        if name in keep_set or not path.is_dir() or path.is_symlink():
            continue
        if name == replaced or now_ns - _replaced_at_ns(gens, name, now_ns) < grace * 1e9:
            retained.append(name)
            continue
        doomed = gens / f".pruning-{name}"
        os.rename(path, doomed)  # one step: the name now means "whole" or "absent", never "half-deleted"
        atomic.fsync_dir(gens)
        shutil.rmtree(doomed)
        with contextlib.suppress(FileNotFoundError):
            (gens / f"{name}{REPLACED}").unlink()
        pruned.append(name)
    return pruned, retained
