"""The rehearsal checkpoint's shards, written one tensor at a time (``fq.model.rehearsal`` plans them).

A shard's header is known before any weight exists (names, dtypes, shapes), so it is written first, the file is
sized, and each tensor is made and written at its offset in module order -- FP8 weight and scale together, the
bf16 head and embeddings a chunk of rows at a time -- while the data keeps safetensors' layout. Memory is one
matrix (float32) at a time, whatever the shard size: a full-width MoE layer of 32 experts is ~1.2 G parameters.
Each shard is written under a temp name and renamed when complete (``fq.core.atomic``); a shard already under its
final name with the planned header and size is kept, so a killed generation resumes where it stopped.
"""
from __future__ import annotations

import math
import os
from pathlib import Path

from fq.core import atomic
from fq.errors import FqError
from fq.model import synth_weights as sw
from fq.model.shards import DTYPES, RawTensor, encode_header

METADATA = {"format": "pt"}
EMBED_STD = 1.0  # the residual stream starts at O(1) per channel, as the layers' outputs are
NORM_OUTLIERS_PER = 512  # one outlier channel per this many channels of a norm (at least one)


class _Size:
    """Stands in for a tensor's bytes when only the header is encoded."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n


def header_and_offsets(stored) -> tuple[bytes, dict[str, int], int]:
    """(header bytes, absolute offset of each tensor, file size) of a shard's stored tensors in data order."""
    raws = [RawTensor(n, dt, s, _Size(math.prod(s) * DTYPES[dt][0])) for n, dt, s in stored]
    header = encode_header(raws, METADATA)
    offsets, pos = {}, len(header)
    for r in raws:
        offsets[r.name] = pos
        pos += len(r.data)
    return header, offsets, pos


def _complete(path: Path, header: bytes, size: int) -> bool:
    try:
        if path.stat().st_size != size:
            return False
        with open(path, "rb") as fh:
            return fh.read(len(header)) == header
    except FileNotFoundError:
        return False


def write_shards(out: Path, shards, seed: int, *, progress: bool = True) -> None:
    """Every (name, [Spec]) of ``shards`` into ``out`` (module doc)."""
    from tqdm import tqdm

    total = sum(sp.nbytes() for _, group in shards for sp in group)
    with tqdm(total=total, unit="B", unit_scale=True, desc="rehearsal source", disable=not progress) as bar:
        for name, group in shards:
            header, offsets, size = header_and_offsets(data_order(group))
            path = out / name
            if _complete(path, header, size):
                bar.update(sum(sp.nbytes() for sp in group))
                continue
            bar.set_postfix_str(name)
            with atomic.atomic_open(path, "wb") as fh:
                fh.write(header)
                fh.truncate(size)
                for sp in group:
                    _write_tensor(fh, sp, seed, offsets)
                    bar.update(sp.nbytes())
            if os.path.getsize(path) != size:
                raise FqError(f"{path}: wrote {os.path.getsize(path)} bytes, the header plans {size}")


def _put(fh, offset: int, t) -> None:
    import torch

    fh.seek(offset)
    fh.write(memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy()))


def data_order(group) -> list[tuple[str, str, tuple[int, ...]]]:
    """The stored tensors of a shard's Specs in safetensors' data order: by dtype (wider first), then by name."""
    stored = [t for sp in group for t in sp.stored()]
    return sorted(stored, key=lambda t: (-DTYPES[t[1]][0], t[0]))


def _write_tensor(fh, sp, seed: int, offsets: dict[str, int]) -> None:
    """Make ``sp`` (seeded by its name) and write its stored tensor(s) at their offsets."""
    import torch

    gen = sw.generator(seed, sp.name)
    if sp.kind == "fp8":
        out_, in_ = sp.shape
        q, scale = sw.fp8_blocks(sw.trained_like(out_, in_, 1 / math.sqrt(in_), gen))
        _put(fh, offsets[sp.name], q)
        _put(fh, offsets[sp.name + "_scale_inv"], scale)
        return
    if sp.kind in ("linear16", "embed"):
        out_, in_ = sp.shape
        std = EMBED_STD if sp.kind == "embed" else 1 / math.sqrt(in_)
        for row0, rows in sw.trained_like_chunks(out_, in_, std, gen):
            _put(fh, offsets[sp.name] + row0 * in_ * 2, rows.to(torch.bfloat16))
        return
    (n,) = sp.shape
    if sp.kind == "norm":
        t = sw.norm_profile(n, gen, outliers=max(1, n // NORM_OUTLIERS_PER)).to(torch.bfloat16)
    elif sp.kind == "ln_bias":
        t = (torch.randn(n, generator=gen) * 0.02).to(torch.bfloat16)
    elif sp.kind == "bias32":
        t = torch.randn(n, generator=gen) * 0.01
    else:
        raise FqError(f"{sp.name}: unknown rehearsal tensor kind {sp.kind!r}")
    _put(fh, offsets[sp.name], t)
