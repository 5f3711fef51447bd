"""Names of files inside a campaign or published tree, and opening them without escaping the tree.

A *name* is a relative POSIX path (``stages/r1/r1-layer003-block000.safetensors``). Names come from
signed plans and attestations, but also from whoever assembled the directory, so they are checked
before use: no absolute paths, no ``..``, no empty, ``.`` or hidden components, no backslashes or
control characters.

``open_regular`` walks a name one component at a time from a directory descriptor with
``O_NOFOLLOW``: a symlink anywhere on the path, or a FIFO, device or directory where a file should
be, is refused instead of followed (a FIFO would otherwise block the reader forever).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO, Callable

from fq.errors import FqError

_COMPONENT = re.compile(r"[A-Za-z0-9_+=@-][A-Za-z0-9_.+=@-]*")
_CHUNK = 8 << 20


def check_name(name: object, what: str = "name") -> str:
    """Return ``name`` if it is a safe relative path, else raise naming the offending part."""
    if not isinstance(name, str) or not name:
        raise FqError(f"{what}: expected a non-empty relative path, got {name!r}")
    if name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise FqError(f"{what}: absolute path {name!r} refused; names are relative to the tree")
    for part in name.split("/"):
        if part == "..":
            raise FqError(f"{what}: {name!r} contains '..'; names may not leave the tree")
        if not _COMPONENT.fullmatch(part):
            raise FqError(f"{what}: {name!r} has an invalid component {part!r} "
                          "(expected letters, digits, '_.+=@-', not starting with '.')")
    return name


def describe_mode(mode: int) -> str:
    for test, label in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                        (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                        (stat.S_ISBLK, "a block device")):
        if test(mode):
            return label
    return "not a regular file"


def open_regular(root: str | os.PathLike, name: str, what: str | None = None, *, size: int | None = None,
                 listed_by: str = "its signed listing") -> BinaryIO:
    """Open ``root/name`` for reading; every component must be a real directory or regular file. ``size``: the
    size a signed document lists for the file, compared before a byte is read (a planted 1 TB sparse file costs
    its maker nothing and a reader an hour of hashing); ``listed_by`` names that document in the refusal."""
    check_name(name, what or "name")
    label = what or name
    parts = name.split("/")
    try:
        dfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError:  # the file wanted is what is missing (a deleted base directory, say), named as such
        raise FqError(f"{label}: missing (its directory {root} does not exist)") from None
    except OSError as e:
        raise FqError(f"{root}: cannot open directory: {e.strerror}") from None
    try:
        for i, part in enumerate(parts):
            try:
                st = os.stat(part, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                raise FqError(f"{label}: missing ({'/'.join(parts[:i + 1])} does not exist under {root})") from None
            last = i == len(parts) - 1
            if last and not stat.S_ISREG(st.st_mode) or not last and not stat.S_ISDIR(st.st_mode):
                where = "/".join(parts[: i + 1])
                raise FqError(f"{label}: {where} is {describe_mode(st.st_mode)}, expected "
                              f"{'a regular file' if last else 'a directory'}")
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
            flags |= os.O_NONBLOCK if last else os.O_DIRECTORY
            try:
                fd = os.open(part, flags, dir_fd=dfd)
            except OSError as e:
                raise FqError(f"{label}: cannot open {'/'.join(parts[:i + 1])}: {e.strerror}") from None
            os.close(dfd)
            dfd = fd
        st2 = os.fstat(dfd)
        if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
            raise FqError(f"{label}: changed while being opened; refusing")
        if size is not None and st2.st_size != size:
            how = "truncated" if st2.st_size < size else "larger than listed"
            raise FqError(f"{label}: {st2.st_size} bytes, {listed_by} says {size} ({how}; refused before reading it)")
        fh = os.fdopen(dfd, "rb")
        dfd = -1
        return fh
    finally:
        if dfd >= 0:
            os.close(dfd)


def read_regular(root: str | os.PathLike, name: str, what: str | None = None, limit: int = 64 << 20) -> bytes:
    """Whole contents of a small regular file (attestations, plans); refuses files over ``limit``."""
    with open_regular(root, name, what) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FqError(f"{what or name}: {size} bytes, larger than the {limit}-byte limit for this kind of file")
        return fh.read(limit + 1)


def split_path(path: str | os.PathLike) -> tuple[Path, str]:
    """(directory, base name) of a user-given file path, for ``open_regular``."""
    p = Path(path)
    if not p.name or p.name in (".", ".."):
        raise FqError(f"{path}: expected a file path")
    return (p.parent if str(p.parent) else Path(".")), p.name


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    """sha256 of a whole file, read in chunks (bounded memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while data := fh.read(chunk):
            h.update(data)
    return h.hexdigest()


def sha256_stream(fh: BinaryIO, ranges: list[tuple[int, int]] = (),
                  taps: list[tuple[int, int, Callable[[int, memoryview], None]]] = ()) -> tuple[str, int, list[str]]:
    """One pass over ``fh`` from offset 0: (sha256 of everything, size, sha256 of each (offset, length)).

    ``ranges`` must be sorted and non-overlapping; shards are verified in one read instead of one
    read for the file plus one per expert. ``taps``: (offset, length, fn) — ``fn(at, piece)`` sees the
    bytes of that range as they stream by, ``at`` = the piece's offset within the range (pieces may split
    anywhere); what it raises ends the pass.
    """
    fh.seek(0)
    whole = hashlib.sha256()
    parts = [hashlib.sha256() for _ in ranges]
    pos = 0
    # the whole-file digest in a second thread: hashlib releases the GIL on large updates, so the two digests
    # of each chunk take the time of one (a 300 MB fragment is digested as it is committed, while the GPU waits)
    with ThreadPoolExecutor(1, thread_name_prefix="fq-sha256") as pool:
        pending = None
        while True:
            chunk = fh.read(_CHUNK)
            if pending is not None:
                pending.result()
            if not chunk:
                break
            pending = pool.submit(whole.update, chunk)
            end = pos + len(chunk)
            view = memoryview(chunk)
            for h, (off, length) in zip(parts, ranges):
                lo, hi = max(off, pos), min(off + length, end)
                if lo < hi:
                    h.update(view[lo - pos: hi - pos])
            for off, length, fn in taps:
                lo, hi = max(off, pos), min(off + length, end)
                if lo < hi:
                    fn(lo - off, view[lo - pos: hi - pos])
            pos = end
    return whole.hexdigest(), pos, [h.hexdigest() for h in parts]
