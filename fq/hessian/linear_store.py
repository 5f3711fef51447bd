"""The input Hessians of a layer's non-expert linears (a whole-model base's attention, shared experts, dense MLP) or of
the head: one safetensors file per layer, ``linears-layer{L:03d}.safetensors``, and ``linears-head.safetensors``.

Linears that read the same input tensor (q/k/v, or MLA's q_a/kv_a, off the post-norm hidden states; a shared or
dense MLP's gate/up) share one Hessian: a group. Tensors, group i = 0, 1, ... in the order of the metadata's
``groups`` (fq.model.shards layout):

    h.{i}        F32 [n(n+1)/2]   Σ xᵀx over the calibration tokens, x the group's input (n its in_features), the
                                  packed upper triangle of ``fq.hessian.store.pack``
    h.{i}.count  I64 []           tokens summed (rows × cols)

Metadata (strings, keys sorted, no timestamps): ``format`` (fq-linear-hessian/1), ``architecture``, ``layer`` (the
decoder layer, or ``head``), ``groups`` (canonical JSON ``[{"linears": [tensor prefix, ...], "in_features": n}]``,
groups ordered by their first linear, linears sorted), ``tokens``, ``rows``, ``cols``, ``calibration``,
``config_sha256``, ``source_shards`` (the shards read, with their sha256), ``hidden_in`` (the hidden-state file
consumed), ``row_batch``, ``torch``, ``transformers``.

As with the experts' file (``fq.hessian.store``), the file's sha256 is what an encode is bound to:
``read_linear_hessians(path, expect_sha256)`` refuses any other file.

    linear_file_name(layer | None) -> "linears-layer{L:03d}.safetensors" | "linears-head.safetensors"
    write_linear_hessians(path, sums, meta) -> sha256       # sums: LinearSums (fq.hessian.capture)
    read_linear_hessians(path, expect_sha256=None) -> LinearHessians   # .names, .group_of(name), .for_linear(name)
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fq.core import canonical
from fq.errors import FqError
from fq.hessian.store import check_finite, pack, packed_len, read_bound, unpack

if TYPE_CHECKING:
    import torch

FORMAT = "fq-linear-hessian/1"
META_KEYS = ("architecture", "calibration", "cols", "config_sha256", "format", "groups", "hidden_in", "layer",
             "row_batch", "rows", "source_shards", "tokens", "torch", "transformers")
INT_KEYS = ("tokens", "rows", "cols", "row_batch")
HEAD = "head"
_HEX64 = re.compile(r"[0-9a-f]{64}")


def linear_file_name(layer: int | None) -> str:
    return f"linears-{HEAD}.safetensors" if layer is None else f"linears-layer{layer:03d}.safetensors"


@dataclass(eq=False)
class LinearSums:
    """One layer's (or the head's) linear input sums in float64, not divided by the counts."""

    layer: int | None
    groups: tuple[tuple[str, ...], ...]  # linears reading one input, each sorted; ordered by first name
    sums: tuple["torch.Tensor", ...]  # [n, n] float64 per group
    counts: tuple[int, ...]
    rows: int
    cols: int

    @property
    def tokens(self) -> int:
        return self.rows * self.cols


def _layer_text(layer: int | None) -> str:
    return HEAD if layer is None else str(layer)


def write_linear_hessians(path: str | os.PathLike, sums: LinearSums, meta: dict) -> str:
    """Write ``sums`` with ``meta`` (META_KEYS less format, layer, groups, tokens: those come from ``sums``);
    atomic; returns the file's sha256."""
    import torch

    from fq.core.safepath import sha256_file
    from fq.model.shards import RawTensor, write_shard

    groups = [{"linears": list(g), "in_features": int(s.shape[0])} for g, s in zip(sums.groups, sums.sums)]
    full = {**meta, "format": FORMAT, "layer": _layer_text(sums.layer), "groups": groups, "tokens": sums.tokens}
    missing, extra = sorted(set(META_KEYS) - set(full)), sorted(set(full) - set(META_KEYS))
    if missing or extra:
        raise FqError(f"{path}: linear Hessian metadata: missing {missing}, unknown {extra}")
    for k in ("groups", "source_shards"):
        if not isinstance(full[k], str):
            full[k] = canonical.dumps(full[k]).decode("utf-8")
    strings = {k: str(full[k]) for k in sorted(full)}
    _check_meta(strings, str(path))
    tensors = []
    for i, (s, c) in enumerate(zip(sums.sums, sums.counts)):
        tensors += [RawTensor.of(f"h.{i}", pack(s)), RawTensor.of(f"h.{i}.count", torch.tensor(c, dtype=torch.int64))]
    write_shard(path, tensors, strings)
    return sha256_file(path)


def _check_meta(meta: dict, where: str) -> dict:
    missing, extra = sorted(set(META_KEYS) - set(meta)), sorted(set(meta) - set(META_KEYS))
    if missing or extra:
        raise FqError(f"{where}: metadata fields missing {missing}, unknown {extra} ({FORMAT})")
    if meta["format"] != FORMAT:
        raise FqError(f"{where}: metadata field format is {meta['format']!r}, expected {FORMAT!r}")
    out = dict(meta)
    for k in INT_KEYS:
        if not re.fullmatch(r"[1-9][0-9]{0,15}", meta[k]):
            raise FqError(f"{where}: metadata field {k} is {meta[k]!r}, expected a positive integer")
        out[k] = int(meta[k])
    if out["tokens"] != out["rows"] * out["cols"]:
        raise FqError(f"{where}: metadata field tokens is {out['tokens']}, expected rows x cols")
    layer = meta["layer"]
    if layer != HEAD and not re.fullmatch(r"0|[1-9][0-9]{0,5}", layer):
        raise FqError(f"{where}: metadata field layer is {layer!r}, expected a layer number or {HEAD!r}")
    out["layer"] = None if layer == HEAD else int(layer)
    for k in ("calibration", "config_sha256"):
        if not _HEX64.fullmatch(meta[k]):
            raise FqError(f"{where}: metadata field {k} is {meta[k]!r}, expected a sha256 (64 hex digits)")
    if meta["hidden_in"] and not _HEX64.fullmatch(meta["hidden_in"]):
        raise FqError(f"{where}: metadata field hidden_in is {meta['hidden_in']!r}, expected a sha256 or empty")
    shards = canonical.loads(meta["source_shards"], f"{where}: metadata field source_shards")
    if not isinstance(shards, dict) or not shards or not all(
            isinstance(k, str) and isinstance(v, str) and _HEX64.fullmatch(v) for k, v in shards.items()):
        raise FqError(f"{where}: metadata field source_shards must be a non-empty JSON object shard -> sha256")
    out["source_shards"] = shards
    groups = canonical.loads(meta["groups"], f"{where}: metadata field groups")
    seen: set = set()
    ok = isinstance(groups, list) and bool(groups)
    for g in groups if ok else ():
        names = g.get("linears") if isinstance(g, dict) else None
        n = g.get("in_features") if isinstance(g, dict) else None
        if sorted(g) != ["in_features", "linears"] or not isinstance(names, list) or not names \
                or not all(isinstance(x, str) and x for x in names) or names != sorted(names) \
                or seen & set(names) or not isinstance(n, int) or isinstance(n, bool) or n < 1:
            ok = False
            break
        seen |= set(names)
    if ok and [g["linears"][0] for g in groups] != sorted(g["linears"][0] for g in groups):
        ok = False
    if not ok:
        raise FqError(f"{where}: metadata field groups must be a non-empty JSON list of {{linears: [sorted names], "
                      "in_features: n}, each linear in one group, groups ordered by their first linear")
    out["groups"] = groups
    return out


@dataclass(eq=False)
class LinearHessians:
    """A verified linear Hessian file. ``for_linear(name)``: the full symmetric float64 H = XᵀX / count of the group
    holding ``name``."""

    path: str
    sha256: str
    meta: dict
    counts: tuple[int, ...]
    _packed: dict = field(repr=False)

    @property
    def layer(self) -> int | None:
        return self.meta["layer"]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(sorted(n for g in self.meta["groups"] for n in g["linears"]))

    def group_of(self, name: str) -> int:
        for i, g in enumerate(self.meta["groups"]):
            if name in g["linears"]:
                return i
        raise FqError(f"{self.path}: no Hessian for linear {name!r} (the file covers {', '.join(self.names)})")

    def for_linear(self, name: str) -> "torch.Tensor":
        i = self.group_of(name)
        return unpack(self._packed[f"h.{i}"], self.meta["groups"][i]["in_features"]) / self.counts[i]


def read_linear_hessians(path: str | os.PathLike, expect_sha256: str | None = None) -> LinearHessians:
    """Read and check a linear Hessian file (digest, metadata, tensor set, dtypes, shapes, counts, finite values)."""
    from fq.model.shards import tensors_in_range

    where = str(path)
    header, data, digest = read_bound(path, expect_sha256, "linear Hessian")
    meta = _check_meta(dict(header.metadata), where)
    want = {}
    for i, g in enumerate(meta["groups"]):
        want[f"h.{i}"] = ("F32", (packed_len(g["in_features"]),))
        want[f"h.{i}.count"] = ("I64", ())
    have = {e.name: e for e in header.entries}
    if sorted(have) != sorted(want):
        raise FqError(f"{where}: tensors {sorted(have)}, expected {sorted(want)} (one h.i and h.i.count per group)")
    for name, (dtype, shape) in want.items():
        e = have[name]
        if e.dtype != dtype or tuple(e.shape) != shape:
            raise FqError(f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)}, expected {dtype} {list(shape)}")
    t = tensors_in_range(header, list(want), 0, data)
    del data
    counts = tuple(int(t.pop(f"h.{i}.count")) for i in range(len(meta["groups"])))
    for i, c in enumerate(counts):
        if c != meta["tokens"]:
            raise FqError(f"{where}: tensor 'h.{i}.count' is {c}, expected tokens = {meta['tokens']}")
    check_finite(t, where)
    return LinearHessians(where, digest, meta, counts, t)
