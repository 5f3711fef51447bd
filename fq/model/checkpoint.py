"""One reader of a source checkpoint directory: ``config.json`` and the weight map (the shard index, or one
``model.safetensors``' header), and the files it names.

Planning (``fq.model.source.load_source``), the calibration chain (``fq.hessian.layer.read_checkpoint``) and the
reference forward (``fq.model.checkpoint_model``) all read a source through here, so a directory one of them takes the
others take too, and one bad file is refused the same way everywhere:

- every file is a plain name in the directory (the index's shard names included: they become staging and deletion
  paths), opened once and checked to be a regular file: a FIFO, a socket, a device or a directory is refused, as is a
  file that changes between the check and the open. A symlink is followed to a regular file: the Hugging Face cache's
  snapshots (``huggingface-cli download`` without ``--local-dir``) are symlinks into its blobs, and the directory is
  the operator's own choice (a published tree, which is someone else's, is opened by ``fq.core.safepath.open_regular``,
  which follows nothing);
- ``config.json`` and the index are at most 64 MiB of JSON objects parsed by ``fq.core.canonical.loads`` (its depth and
  number limits); the index has a non-empty ``weight_map`` of tensor name -> plain shard file name; a lone
  ``model.safetensors``' header is read by fq's reader (``fq.model.shards.read_header``).

    read_meta(directory) -> CheckpointMeta(dir, config, config_bytes, weight_map, index_bytes, single_header)
    open_file(directory, name, where=None) -> binary file object
    read_file(directory, name, where=None, limit=64 MiB) -> bytes
    check_weight_map(index, where) -> {tensor: shard}
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from fq.core import canonical
from fq.core.safepath import describe_mode
from fq.errors import FqError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
JSON_LIMIT = 64 << 20


def _check_plain(name: object, where: str, what: str = "file name in the checkpoint directory") -> str:
    if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise FqError(f"{where}: expected a plain {what}, got {name!r}")
    return name


def open_file(directory: str | os.PathLike, name: str, where: str | None = None) -> BinaryIO:
    """``directory/name`` opened for reading: a plain name, a regular file (a symlink is followed to one)."""
    where = where or f"{directory}/{name}"
    path = Path(directory) / _check_plain(name, where)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise FqError(f"{where}: not found") from None
    except OSError as e:
        raise FqError(f"{where}: cannot read: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FqError(f"{where}: {describe_mode(st.st_mode)}, expected a regular file")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)  # never blocks on a FIFO swapped in since
    except OSError as e:
        raise FqError(f"{where}: cannot read: {e.strerror}") from None
    st2 = os.fstat(fd)
    if not stat.S_ISREG(st2.st_mode) or (st2.st_dev, st2.st_ino) != (st.st_dev, st.st_ino):
        os.close(fd)
        raise FqError(f"{where}: changed while being opened; refusing")
    return os.fdopen(fd, "rb")


def read_file(directory: str | os.PathLike, name: str, where: str | None = None, limit: int = JSON_LIMIT) -> bytes:
    """The whole of a small file of the checkpoint (config.json, the index), refused over ``limit`` bytes."""
    where = where or f"{directory}/{name}"
    with open_file(directory, name, where) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > limit:
            raise FqError(f"{where}: {size} bytes, larger than the {limit}-byte limit for this kind of file")
        return fh.read(limit + 1)


def check_weight_map(index, where: str) -> dict[str, str]:
    """The index's ``weight_map``: a non-empty object of tensor name -> plain shard file name."""
    wm = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(wm, dict) or not wm:
        raise FqError(f"{where}: weight_map: expected a non-empty object tensor name -> shard file")
    for name, shard in wm.items():
        # shard names become staging and deletion paths
        _check_plain(shard, f"{where}: weight_map[{name!r}]", "shard file name")
    return dict(wm)


@dataclass(frozen=True)
class CheckpointMeta:
    dir: Path
    config: dict
    config_bytes: bytes
    weight_map: dict  # tensor -> shard file
    index_bytes: bytes | None  # the index file's bytes; None for a lone model.safetensors
    single_header: object = None  # a lone model.safetensors' header (fq.model.shards.Header)

    @property
    def config_sha256(self) -> str:
        return canonical.sha256_hex(self.config_bytes)

    @property
    def shards(self) -> list[str]:
        return sorted(set(self.weight_map.values()))


def read_meta(directory: str | os.PathLike) -> CheckpointMeta:
    """config.json and the weight map of a checkpoint directory (the index, or one model.safetensors' header)."""
    from fq.model.shards import read_header

    d = Path(directory)
    if not d.is_dir():
        raise FqError(f"{d}: not a directory (expected a checkpoint directory with {CONFIG} and {INDEX})")
    config_bytes = read_file(d, CONFIG)
    config = canonical.loads(config_bytes, f"{d}/{CONFIG}")
    if not isinstance(config, dict):
        raise FqError(f"{d}/{CONFIG}: expected a JSON object, got {type(config).__name__}")
    if (d / INDEX).exists():
        index_bytes = read_file(d, INDEX)
        wm = check_weight_map(canonical.loads(index_bytes, f"{d}/{INDEX}"), f"{d}/{INDEX}")
        return CheckpointMeta(d, config, config_bytes, wm, index_bytes)
    if not (d / SINGLE).exists():
        raise FqError(f"{d}: neither {INDEX} nor {SINGLE} found (fq reads a Hugging Face safetensors checkpoint)")
    with open_file(d, SINGLE) as fh:
        header = read_header(fh, f"{d}/{SINGLE}")
    return CheckpointMeta(d, config, config_bytes, {e.name: SINGLE for e in header.entries}, None, header)
