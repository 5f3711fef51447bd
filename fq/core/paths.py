"""Pre-checks of the paths a command is given, run before any work: an output fq cannot write, or an input it
cannot read, is refused in one line naming the option and the path -- not after a 45 s measurement, and never as
an OSError's traceback.

An output is written the way ``fq.core.atomic`` writes: its missing parent directories are made, a temp file is
created beside it and renamed over it. So its nearest existing ancestor must be a directory fq may write in.
"""
from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path

from fq.core.safepath import describe_mode
from fq.errors import FqError


def _nearest_existing(path: Path) -> Path:
    for p in (path, *path.parents):  # a relative path ends at "."
        if os.path.lexists(p):
            return p
    return Path(path.anchor or ".")  # the working directory was removed


def _check_writable_dir(d: Path, option: str, path: str | os.PathLike) -> None:
    """``d`` is, or can be made as, a directory fq may create files in."""
    a = _nearest_existing(d)
    if not a.is_dir():
        what = "a regular file" if a.is_file() else describe_mode(os.lstat(a).st_mode)
        raise FqError(f"{option} {path}: {a} is {what}, not a directory")
    if not os.access(a, os.W_OK | os.X_OK):
        raise FqError(f"{option} {path}: cannot write in {a} (permission denied or a read-only file system)")
    problem = _create_problem(a)
    if problem:
        raise FqError(f"{option} {path}: cannot write in {a} ({problem})")


def _create_problem(d: Path) -> str | None:
    """Why no file can be created in the existing directory ``d``, or None: an empty temp file is made and removed
    there, as the atomic write will make one. ``os.access`` is not enough: it answers yes to root for any directory
    of a writable mount, /proc and /sys included, where creating a file still fails."""
    try:
        fd, name = tempfile.mkstemp(prefix=".fq-write-probe-", dir=d)
    except OSError as e:
        return e.strerror or str(e)
    os.close(fd)
    with contextlib.suppress(OSError):
        os.unlink(name)
    return None


def check_output_file(path: str | os.PathLike, option: str) -> Path:
    """``path`` can be written as a file: not a directory, nor an existing device, FIFO or socket (the atomic write
    would rename a file over it), its parent a writable directory (or one that can be made)."""
    p = Path(path)
    if p.is_dir() or str(path).endswith(os.sep):
        raise FqError(f"{option} {path}: is a directory; expected a file name")
    with contextlib.suppress(OSError):
        mode = os.stat(p).st_mode
        if not stat.S_ISREG(mode):
            raise FqError(f"{option} {path}: is {describe_mode(mode)}; expected a regular file name (fq writes a new "
                          f"file and renames it over the name)")
    _check_writable_dir(p.parent, option, path)
    return p


def check_output_dir(path: str | os.PathLike, option: str) -> Path:
    """``path`` is, or can be made as, a directory fq may write files in (not a regular file, nor under one)."""
    p = Path(path)
    _check_writable_dir(p, option, path)
    return p


def read_text_arg(path: str | os.PathLike, option: str) -> str:
    """The UTF-8 text of the regular file ``path`` (a FIFO would block, a directory is no text)."""
    try:
        mode = os.stat(path).st_mode
        if not stat.S_ISREG(mode):
            raise FqError(f"{option} {path}: is {describe_mode(mode)}, not a text file")
        data = Path(path).read_bytes()
    except OSError as e:
        raise FqError(f"{option} {path}: cannot read: {e.strerror}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FqError(f"{option} {path}: not UTF-8 text at byte {e.start} "
                      f"(0x{data[e.start:e.start + 1].hex()}: {e.reason})") from None
