"""safetensors files whose layout fq decides: tensors in the caller's order, so a group (one expert)
is one contiguous byte range, and a strict reader that trusts nothing in the header.

File format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N,
N bytes of JSON header, then the data. Here the header is compact JSON with ``__metadata__``
first and tensors in layout order, padded with spaces so the data starts 8-byte aligned; data
offsets are dense (safetensors refuses gaps). No timestamps: the same tensors give the same bytes.
``safetensors.safe_open`` reads these files unchanged.

The reader validates every entry (known dtype, integer shape, ``end - begin == numel * itemsize``),
offsets start at 0 and tile the data with no overlap or gap, and the data ends where the file does.
Byte ranges it hands out are absolute file offsets.
"""
from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, BinaryIO, Iterable, Mapping

from fq.core import atomic
from fq.core.canonical import loads, sha256_hex
from fq.errors import FqError

if TYPE_CHECKING:
    import torch

# safetensors dtype -> (bytes per element, name of the torch dtype). Names, not torch objects: reading and
# verifying headers must not import torch (it is most of a CLI's or a Snakemake job's start-up time).
DTYPES: dict[str, tuple[int, str]] = {
    "BOOL": (1, "bool"), "U8": (1, "uint8"), "I8": (1, "int8"),
    "F8_E4M3": (1, "float8_e4m3fn"), "F8_E5M2": (1, "float8_e5m2"),
    "F8_E8M0": (1, "float8_e8m0fnu"),  # ue8m0 block scales (DeepSeek-V4's ``.scale`` tensors): 2^(byte - 127)
    "I16": (2, "int16"), "U16": (2, "uint16"), "F16": (2, "float16"), "BF16": (2, "bfloat16"),
    "I32": (4, "int32"), "U32": (4, "uint32"), "F32": (4, "float32"),
    "I64": (8, "int64"), "U64": (8, "uint64"), "F64": (8, "float64"),
}


def torch_dtype(dtype: str) -> "torch.dtype":
    """The torch dtype of a safetensors dtype name."""
    import torch

    return getattr(torch, DTYPES[dtype][1])


@functools.cache
def _by_torch() -> dict:
    return {torch_dtype(name): name for name in DTYPES}


MAX_HEADER = 100 << 20  # the safetensors limit


@dataclass(frozen=True)
class RawTensor:
    """A tensor as bytes: what the writer lays out (lets skeleton copies stay byte-verbatim)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview

    @classmethod
    def of(cls, name: str, t: torch.Tensor) -> "RawTensor":
        import torch

        dtype = _by_torch().get(t.dtype)
        if dtype is None:
            raise FqError(f"{name}: dtype {t.dtype} cannot be stored in safetensors")
        t = t.detach().to("cpu").contiguous()
        # a view of the tensor's bytes, not a copy (the writer writes it out; a 300 MB fragment copied cost 0.1 s)
        data = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b""
        return cls(name, dtype, tuple(t.shape), data)


@dataclass(frozen=True)
class Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute file offset
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass(frozen=True)
class Header:
    """A validated safetensors header; ``raw`` is the file's first ``data_start`` bytes."""

    source: str
    raw: bytes
    data_start: int
    file_size: int
    metadata: dict[str, str]
    entries: tuple[Entry, ...]  # in offset order

    @property
    def sha256(self) -> str:
        return sha256_hex(self.raw)

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise FqError(f"{self.source}: no tensor {name!r}")

    def span(self, names: Iterable[str], what: str) -> tuple[int, int]:
        """(offset, length) of tensors that must be one contiguous run; else raise naming ``what``."""
        chosen = sorted((e for e in self.entries if e.name in set(names)), key=lambda e: e.start)
        if not chosen:
            raise FqError(f"{self.source}: {what} has no tensors")
        for a, b in zip(chosen, chosen[1:]):
            if a.end != b.start:
                raise FqError(f"{self.source}: {what} is not one contiguous byte range "
                              f"({a.name} ends at {a.end}, {b.name} starts at {b.start})")
        return chosen[0].start, chosen[-1].end - chosen[0].start


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 1


def encode_header(tensors: list[RawTensor], metadata: Mapping[str, str]) -> bytes:
    """The 8-byte length plus the padded JSON header for ``tensors`` laid out in the given order."""
    head: dict[str, object] = {}
    if metadata:
        for k, v in metadata.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise FqError(f"safetensors metadata: {k!r}: keys and values must be strings, got {type(v).__name__}")
        head["__metadata__"] = dict(metadata)
    offset = 0
    for t in tensors:
        if t.name == "__metadata__" or t.name in head:
            raise FqError(f"safetensors writer: tensor name {t.name!r} is reserved or repeated")
        if t.dtype not in DTYPES:
            raise FqError(f"{t.name}: unknown safetensors dtype {t.dtype!r}")
        need = _numel(t.shape) * DTYPES[t.dtype][0]
        if len(t.data) != need:
            raise FqError(f"{t.name}: {len(t.data)} bytes given, {t.dtype} {list(t.shape)} needs {need}")
        head[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + need]}
        offset += need
    body = json.dumps(head, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    body += b" " * (-(8 + len(body)) % 8)
    return struct.pack("<Q", len(body)) + body


_PIECE = 1 << 26  # 64 MiB: written and hashed piece by piece, while it is still in cache


def write_shard(path: str | os.PathLike, tensors: list[RawTensor], metadata: Mapping[str, str]) -> str:
    """Write tensors in exactly this order, atomically (temp, fsync, rename); returns the file's sha256, hashed
    as it is written (a calibration hidden-state file is 12.6 GB at GLM-5's width: reading it back cost a pass)."""
    header = encode_header(tensors, metadata)
    h = hashlib.sha256(header)
    with atomic.atomic_open(path, "wb") as fh:
        fh.write(header)
        for t in tensors:
            view = memoryview(t.data).cast("B")
            for lo in range(0, len(view), _PIECE):
                piece = view[lo: lo + _PIECE]
                fh.write(piece)
                h.update(piece)
    return h.hexdigest()


def read_header(fh: BinaryIO, source: str) -> Header:
    """Parse and validate the header of an open shard; every lie in it is refused by name."""
    size = os.fstat(fh.fileno()).st_size
    fh.seek(0)
    prefix = fh.read(8)
    if len(prefix) < 8:
        raise FqError(f"{source}: truncated: {size} bytes, a safetensors file has at least an 8-byte header length")
    (n,) = struct.unpack("<Q", prefix)
    if n > MAX_HEADER or 8 + n > size:
        raise FqError(f"{source}: header length {n} does not fit in the file ({size} bytes); truncated or not safetensors")
    body = fh.read(n)
    obj = loads(body, f"{source} (safetensors header)")
    if not isinstance(obj, dict):
        raise FqError(f"{source}: safetensors header must be a JSON object")
    meta = obj.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise FqError(f"{source}: __metadata__ must map strings to strings")
    data_start, data_len = 8 + n, size - 8 - n
    entries = []
    for name, spec in obj.items():
        where = f"{source}: tensor {name!r}"
        if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_offsets"}:
            raise FqError(f"{where}: expected exactly dtype, shape, data_offsets")
        dtype, shape, offs = spec["dtype"], spec["shape"], spec["data_offsets"]
        if dtype not in DTYPES:
            raise FqError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            raise FqError(f"{where}: shape must be a list of non-negative integers, got {shape!r}")
        if not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs):
            raise FqError(f"{where}: data_offsets must be two integers, got {offs!r}")
        begin, end = offs
        need = _numel(tuple(shape)) * DTYPES[dtype][0]
        if not 0 <= begin <= end:
            raise FqError(f"{where}: data_offsets {offs} are not an ordered range")
        if end - begin != need:
            raise FqError(f"{where}: data_offsets {offs} span {end - begin} bytes, {dtype} {shape} needs {need}")
        entries.append(Entry(name, dtype, tuple(shape), data_start + begin, need))
    entries.sort(key=lambda e: (e.start, e.end))
    pos = data_start
    prev = None
    for e in entries:
        if e.start < pos:
            raise FqError(f"{source}: tensor {e.name!r} overlaps {prev.name!r} "
                          f"(starts at data offset {e.start - data_start}, {prev.name!r} ends at {pos - data_start})")
        if e.start > pos:
            raise FqError(f"{source}: gap before tensor {e.name!r} (data offset {pos - data_start} to "
                          f"{e.start - data_start} belongs to no tensor)")
        pos, prev = e.end, e
    if pos - data_start != data_len:
        if pos - data_start > data_len:
            raise FqError(f"{source}: truncated: header says data ends at byte {pos}, file has {size} bytes")
        raise FqError(f"{source}: {data_len - (pos - data_start)} trailing bytes after the last tensor")
    fh.seek(0)
    raw = fh.read(data_start)
    return Header(source, raw, data_start, size, dict(meta), tuple(entries))


def read_whole(path: str | os.PathLike, what: str) -> tuple[Header, bytes]:
    """(header, every byte) of a small safetensors file read in one go; ``what`` names it in errors ("the Hessian
    file"). Refuses a file that changed between the header and the bytes."""
    where = str(path)
    try:
        fh = open(path, "rb")
    except OSError as e:
        raise FqError(f"{where}: cannot read {what}: {e.strerror}") from None
    with fh:
        header = read_header(fh, where)
        fh.seek(0)
        data = fh.read()
    if data[:header.data_start] != header.raw or len(data) != header.file_size:
        raise FqError(f"{where}: changed while it was read")
    return header, data


def read_into_tensors(path: str | os.PathLike, what: str) -> tuple[Header, dict[str, torch.Tensor], str]:
    """(header, every tensor, the file's sha256) of a safetensors file, read in one pass straight into the tensors'
    memory and hashed on the way (``read_whole`` then ``tensors_in_range`` hold the bytes twice and copy them once:
    a 12.6 GB hidden-state file at GLM-5's width). Refuses a file whose size changes while it is read."""
    import torch

    where = str(path)
    try:
        fh = open(path, "rb", buffering=0)
    except OSError as e:
        raise FqError(f"{where}: cannot read {what}: {e.strerror}") from None
    with fh:
        header = read_header(fh, where)
        h = hashlib.sha256(header.raw)
        data = torch.empty(header.file_size - header.data_start, dtype=torch.uint8)
        view = memoryview(data.numpy()).cast("B")
        fh.seek(header.data_start)
        got = 0
        while got < len(view):
            n = fh.readinto(view[got: got + _PIECE])
            if not n:
                break
            h.update(view[got: got + n])
            got += n
        if got != len(view) or fh.read(1) or os.fstat(fh.fileno()).st_size != header.file_size:
            raise FqError(f"{where}: changed while it was read")
    out = {}
    for e in header.entries:
        lo, dtype = e.start - header.data_start, torch_dtype(e.dtype)
        piece = data[lo: lo + e.length]
        if lo % torch.empty(0, dtype=dtype).element_size():
            piece = piece.clone()  # an unaligned offset: its own storage, so that the view below is allowed
        out[e.name] = piece.view(dtype).reshape(e.shape) if e.length else torch.empty(e.shape, dtype=dtype)
    return header, out, h.hexdigest()


def read_range(fh: BinaryIO, offset: int, length: int, source: str) -> bytes:
    fh.seek(offset)
    data = fh.read(length)
    if len(data) != length:
        raise FqError(f"{source}: truncated: wanted {length} bytes at {offset}, got {len(data)}")
    return data


def tensors_in_range(header: Header, names: Iterable[str], offset: int, data: bytes) -> dict[str, torch.Tensor]:
    """Materialize tensors from the bytes of a range that starts at absolute ``offset``."""
    import torch

    out = {}
    for name in names:
        e = header.entry(name)
        lo = e.start - offset
        if lo < 0 or lo + e.length > len(data):
            raise FqError(f"{header.source}: tensor {name!r} lies outside the range that was read")
        dtype = torch_dtype(e.dtype)
        if e.length == 0:
            out[name] = torch.empty(e.shape, dtype=dtype)
        else:
            buf = bytearray(data[lo: lo + e.length])
            out[name] = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(e.shape)
    return out
