"""Fragments (one node's encoding of one block) and skeleton shards, as fq lays them out.

Expert fragment: for each expert in ascending order, for each projection (gate, up, down), the
EXL3 tensors ``trellis, suh, svh[, mul1|mcg]`` — so every expert is one contiguous byte range and
``expert sha256`` means what it says. Base and stage fragments have the same per-expert key set;
a stage holds only the experts its selection names within the block. Header metadata (strings):
``format=fq-fragment/1, kind=expert, node, role, layer, block, K, codebook, layout`` (JSON). ``K`` is a fragment spec
(``fq.core.kbits``) in its header form: ``"3"`` (every linear at K=3, as every fixed-K base and stage writes it), or
the canonical JSON of K per projection, ``{"down":3,"gate":2,"up":2}`` (a budgeted base: exllamav3 takes one K per
projection of a layer); ``kbits.PROJECTIONS`` names the layout's projections in order (gate, up, down, whatever the
checkpoint calls them). Every linear's K derived from its tensors is its projection's.

Skeleton shard: the non-expert tensors of one source shard, byte-verbatim, sorted by name;
metadata ``format=fq-fragment/1, kind=skeleton, source_shard``.

Linear fragment (whole-model bases): one linear node's encoding of one class of non-expert linears of one layer
(or of the head): per linear in name order, ``{name}.trellis, .suh, .svh[, .mul1|.mcg]`` under the checkpoint's own
prefix (``model.layers.3.self_attn.q_proj``), each linear one contiguous range; metadata
``format=fq-fragment/1, kind=linear, node, class, layer`` (decimal, or ``head``) ``, K, codebook``.

    write_fragment(path, layout=, node=, role=, layer=, block=, K=, codebook=, experts={E: {proj: {suffix: tensor}}})
        # K: a fragment spec, int or {"gate", "up", "down": K} (as JSON too); ShardInfo.meta["K"] is it, checked
    write_skeleton(path, tensors=[RawTensor|(name, tensor)], source_shard=)
    write_linears(path, node=, cls=, layer=, K=, codebook=, linears={name: {suffix: tensor}})
    describe(fh, name) -> ShardInfo   # validated header + digests, one read of the file
    fragment_filename(node, layer, block) -> "NODE-layerLLL-blockBBB.safetensors"
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Iterable, Mapping

from fq.core import kbits
from fq.core.canonical import loads
from fq.core.safepath import sha256_stream
from fq.errors import FqError
from fq.model.experts import ExpertLayout, derive_linear, expert_keys, suffixes
from fq.model.shards import Header, RawTensor, read_header, write_shard
from fq.provenance.scales import SCALE_SUFFIXES, check_scale

if TYPE_CHECKING:
    import torch

FORMAT = "fq-fragment/1"
ROLES = ("base", "stage")
# The recipe schema's node names (dots allowed: "k2.r1"), never "..": a name is also a file-name prefix.
NODE_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+=@-]{0,63}")


def check_node(node: object, where: str = "node") -> str:
    if not isinstance(node, str) or not NODE_RE.fullmatch(node) or ".." in node:
        raise FqError(f"{where}: node name {node!r} must be 1-64 of letters, digits, '_.+=@-' (no '..'), starting alphanumeric")
    return node


def fragment_filename(node: str, layer: int, block: int) -> str:
    """The one file name of a node's fragment for (layer, block); attestations sign this name."""
    check_node(node)
    return f"{node}-layer{layer:03d}-block{block:03d}.safetensors"


def linear_filename(node: str, layer: int | None) -> str:
    """The file name of a linear node's fragment of one layer (None: the head)."""
    check_node(node)
    return f"{node}-head.safetensors" if layer is None else f"{node}-layer{layer:03d}.safetensors"


LINEAR_CLASSES = ("attention", "shared", "dense", "head")
_LINEAR_NAME = re.compile(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*")


def attestation_name(shard_name: str) -> str:
    """The attestation line that sits beside a shard."""
    return shard_name + ".intoto.jsonl"


@dataclass(frozen=True)
class ExpertRange:
    expert: int
    offset: int
    length: int
    sha256: str

    def to_json(self) -> dict:
        return {"expert": self.expert, "offset": self.offset, "length": self.length, "sha256": self.sha256}


@dataclass(frozen=True)
class TensorRange:
    name: str
    offset: int
    length: int
    sha256: str

    def to_json(self) -> dict:
        return {"name": self.name, "offset": self.offset, "length": self.length, "sha256": self.sha256}


@dataclass(frozen=True)
class ShardInfo:
    """What a shard's bytes say about it (nothing here is taken from an attestation)."""

    name: str
    sha256: str
    size: int
    header: Header
    kind: str
    meta: dict
    experts: tuple[ExpertRange, ...] = ()
    tensors: tuple[TensorRange, ...] = ()
    linears: dict = field(default_factory=dict)  # (expert, proj) -> Linear (expert fragments); name -> Linear (linear)


def _int(meta: Mapping[str, str], key: str, source: str) -> int:
    v = meta.get(key)
    if not isinstance(v, str) or not re.fullmatch(r"0|[1-9][0-9]{0,8}", v):
        shown = v if not isinstance(v, str) or len(v) <= 24 else f"{v[:12]}… ({len(v)} characters)"
        raise FqError(f"{source}: header metadata {key!r} must be a non-negative decimal integer of at most 9 "
                      f"digits, got {shown!r}")
    return int(v)


def fragment_meta(header: Header) -> dict:
    """Typed fragment metadata from a validated header; refuses anything not written by fq."""
    m, src = header.metadata, header.source
    if m.get("format") != FORMAT:
        raise FqError(f"{src}: header metadata format is {m.get('format')!r}, expected {FORMAT!r}")
    kind = m.get("kind")
    if kind == "skeleton":
        if set(m) != {"format", "kind", "source_shard"}:
            raise FqError(f"{src}: skeleton metadata keys {sorted(m)}, expected format, kind, source_shard")
        return {"kind": kind, "source_shard": m["source_shard"]}
    if kind == "linear":
        want = {"format", "kind", "node", "class", "layer", "K", "codebook"}
        if set(m) != want:
            raise FqError(f"{src}: linear fragment metadata keys {sorted(m)}, expected {sorted(want)}")
        if m["class"] not in LINEAR_CLASSES:
            raise FqError(f"{src}: header metadata class {m['class']!r}, expected one of {', '.join(LINEAR_CLASSES)}")
        layer = None if m["layer"] == "head" else _int(m, "layer", src)
        if (layer is None) != (m["class"] == "head"):
            raise FqError(f"{src}: header metadata layer {m['layer']!r} for class {m['class']!r} (the head's fragment "
                          f"says layer 'head', every other class a decoder layer)")
        K = kbits.from_meta(m["K"], f"{src}: header metadata K")
        if not kbits.is_one(K):
            raise FqError(f"{src}: header metadata K {m['K']!r}: a linear fragment holds one K")
        return {"kind": kind, "node": check_node(m["node"], f"{src}: node"), "class": m["class"], "layer": layer,
                "K": K, "codebook": m["codebook"]}
    if kind != "expert":
        raise FqError(f"{src}: header metadata kind is {kind!r}, expected 'expert', 'linear' or 'skeleton'")
    want = {"format", "kind", "node", "role", "layer", "block", "K", "codebook", "layout"}
    if set(m) != want:
        raise FqError(f"{src}: fragment metadata keys {sorted(m)}, expected {sorted(want)}")
    if m["role"] not in ROLES:
        raise FqError(f"{src}: header metadata role {m['role']!r}, expected base or stage")
    where = f"{src}: header metadata layout"
    layout = ExpertLayout.from_json(loads(m["layout"], where), where)
    return {"kind": kind, "node": check_node(m["node"], f"{src}: node"), "role": m["role"],
            "layer": _int(m, "layer", src), "block": _int(m, "block", src),
            "K": kbits.from_meta(m["K"], f"{src}: header metadata K"), "codebook": m["codebook"], "layout": layout}


def expert_structure(header: Header, meta: dict) -> tuple[list[int], dict]:
    """Experts in file order and their per-linear constants; enforces the exact key set."""
    layout: ExpertLayout = meta["layout"]
    src, layer = header.source, meta["layer"]
    specs: dict[int, dict[str, dict[str, tuple]]] = {}
    for e in header.entries:
        parsed = layout.parse(e.name)
        if parsed is None:
            raise FqError(f"{src}: tensor {e.name!r} is not a routed-expert EXL3 tensor of this layout")
        lay, expert, proj, suffix = parsed
        if lay != layer:
            raise FqError(f"{src}: tensor {e.name!r} belongs to layer {lay}, the fragment is layer {layer}")
        specs.setdefault(expert, {}).setdefault(proj, {})[suffix] = (e.dtype, e.shape)
    if not specs:
        raise FqError(f"{src}: fragment holds no experts")
    linears = {}
    want_K = kbits.of_layout(meta["K"], layout.projections)
    for expert, projs in specs.items():
        for proj in layout.projections:
            where = f"{src}: expert {expert} {proj}"
            if proj not in projs:
                raise FqError(f"{where}: missing (every expert carries {', '.join(layout.projections)})")
            lin = derive_linear(projs[proj], where)
            if (lin.K, lin.codebook) != (want_K[proj], meta["codebook"]):
                raise FqError(f"{where}: tensors imply K={lin.K} codebook={lin.codebook}, header metadata says "
                              f"K={_k_of(meta['K'], proj, want_K)} codebook={meta['codebook']}")
            linears[(expert, proj)] = lin
    order = sorted(specs)
    # The exact order fq writes, so that each expert is one range and the file is reproducible.
    want = [k for ex in order for k in expert_keys(layout, layer, ex, meta["codebook"])]
    got = [e.name for e in header.entries]
    if got != want:
        pad = max(len(got), len(want))
        g, w = got + [None] * (pad - len(got)), want + [None] * (pad - len(want))
        i = next(i for i in range(pad) if g[i] != w[i])
        raise FqError(f"{src}: tensor #{i} in file order is {g[i]!r}, fq's layout puts {w[i]!r} there "
                      "(keys wrong or an expert not contiguous)")
    return order, linears


def _k_of(spec, proj: str, want_K: dict) -> str:
    """How messages state a projection's K under a fragment spec: ``2``, or ``2 for gate_proj (gate/up K2, down K3)``."""
    return str(want_K[proj]) if kbits.is_one(spec) else f"{want_K[proj]} for {proj} ({kbits.describe(spec)})"


def linear_structure(header: Header, meta: dict) -> tuple[list[str], dict]:
    """Linear names in file order and their constants; enforces fq's exact layout (each linear contiguous,
    names sorted, suffixes in codec order, K and codebook those of the header)."""
    src = header.source
    specs: dict[str, dict[str, tuple]] = {}
    for e in header.entries:
        name, _, suffix = e.name.rpartition(".")
        if not name or not _LINEAR_NAME.fullmatch(name):
            raise FqError(f"{src}: tensor {e.name!r} is not an EXL3 tensor NAME.SUFFIX of a linear")
        specs.setdefault(name, {})[suffix] = (e.dtype, e.shape)
    if not specs:
        raise FqError(f"{src}: linear fragment holds no linears")
    linears = {}
    for name, sp in specs.items():
        lin = derive_linear(sp, f"{src}: {name}")
        if (lin.K, lin.codebook) != (meta["K"], meta["codebook"]):
            raise FqError(f"{src}: {name}: tensors imply K={lin.K} codebook={lin.codebook}, header metadata says "
                          f"K={meta['K']} codebook={meta['codebook']}")
        linears[name] = lin
    order = sorted(specs)
    want = [f"{n}.{s}" for n in order for s in suffixes(meta["codebook"])]
    got = [e.name for e in header.entries]
    if got != want:
        i = next(i for i in range(max(len(got), len(want))) if i >= len(got) or i >= len(want) or got[i] != want[i])
        raise FqError(f"{src}: tensor #{i} in file order is {got[i] if i < len(got) else None!r}, fq's layout puts "
                      f"{want[i] if i < len(want) else None!r} there (names unsorted or a linear not contiguous)")
    return order, linears


def _scale_taps(header: Header, layout: ExpertLayout) -> list:
    """Stream taps that refuse a NaN/Inf in any suh/svh (fq.provenance.scales) during describe's one pass."""
    def tap(e):
        return lambda at, piece: check_scale(piece, f"{header.source}: tensor {e.name!r}", at)
    return [(e.start, e.length, tap(e)) for e in header.entries if layout.parse(e.name)[3] in SCALE_SUFFIXES]


def describe(fh: BinaryIO, name: str, source: str | None = None) -> ShardInfo:
    """Validate an open shard and digest it in one pass: file sha256, header sha256, per-expert or
    per-tensor ranges, and every expert scale finite (fq.provenance.scales). Does not consult any attestation."""
    src = source or name
    header = read_header(fh, src)
    meta = fragment_meta(header)
    if meta["kind"] == "expert":
        order, linears = expert_structure(header, meta)
        layout = meta["layout"]
        spans = [header.span(expert_keys(layout, meta["layer"], ex, meta["codebook"]), f"expert {ex}") for ex in order]
        whole, size, digests = sha256_stream(fh, spans, _scale_taps(header, layout))
        experts = tuple(ExpertRange(ex, off, n, d) for ex, (off, n), d in zip(order, spans, digests))
        return ShardInfo(name, whole, size, header, "expert", meta, experts=experts, linears=linears)
    if meta["kind"] == "linear":
        order, linears = linear_structure(header, meta)
        spans = [header.span([f"{n}.{s}" for s in suffixes(meta["codebook"])], n) for n in order]
        taps = [(e.start, e.length, (lambda e: lambda at, piece: check_scale(piece, f"{src}: tensor {e.name!r}", at))(e))
                for e in header.entries if e.name.rpartition(".")[2] in SCALE_SUFFIXES]
        whole, size, digests = sha256_stream(fh, spans, taps)
        tensors = tuple(TensorRange(n, off, ln, d) for n, (off, ln), d in zip(order, spans, digests))
        return ShardInfo(name, whole, size, header, "linear", meta, tensors=tensors, linears=linears)
    spans = [(e.start, e.length) for e in header.entries]
    whole, size, digests = sha256_stream(fh, spans)
    tensors = tuple(TensorRange(e.name, e.start, e.length, d) for e, d in zip(header.entries, digests))
    return ShardInfo(name, whole, size, header, "skeleton", meta, tensors=tensors)


def _as_raw(name: str, t) -> RawTensor:
    return t if isinstance(t, RawTensor) else RawTensor.of(name, t)


def write_fragment(path: str | os.PathLike, *, layout: ExpertLayout, node: str, role: str, layer: int, block: int,
                   K: kbits.FragmentK, codebook: str,
                   experts: Mapping[int, Mapping[str, Mapping[str, torch.Tensor]]]) -> ShardInfo:
    """Write one node's fragment of one block, atomically; returns its digests.

    ``experts[E][projection]`` is the codec's tensor set (``trellis, suh, svh[, mul1|mcg]``). ``K``: a fragment spec
    (``fq.core.kbits``: an int, or K per canonical projection gate/up/down; its JSON form too; a uniform mapping is
    its int, so the bytes are a fixed-K fragment's). Every set is checked against its projection's K and
    ``codebook`` before a byte is written; a set missing ``suh``/``svh`` is refused.
    """
    check_node(node)
    if role not in ROLES:
        raise FqError(f"fragment {node}: role {role!r}, expected base or stage")
    for label, v in (("layer", layer), ("block", block)):
        if type(v) is not int or v < 0:
            raise FqError(f"fragment {node}: {label} must be a non-negative integer, got {v!r}")
    K = kbits.fragment(K, f"fragment {node} layer {layer} block {block}: K")
    want_K = kbits.of_layout(K, layout.projections)
    if not experts:
        raise FqError(f"fragment {node} layer {layer} block {block}: no experts to write")
    raws: list[RawTensor] = []
    for ex in sorted(experts):
        if type(ex) is not int or ex < 0:
            raise FqError(f"fragment {node}: expert ids must be non-negative integers, got {ex!r}")
        projs = experts[ex]
        if set(projs) != set(layout.projections):
            raise FqError(f"fragment {node} expert {ex}: projections {sorted(projs)}, expected {list(layout.projections)}")
        for proj in layout.projections:
            tset = projs[proj]
            where = f"fragment {node} layer {layer} expert {ex} {proj}"
            raws.extend(_coded_set({s: _as_raw(layout.key(layer, ex, proj, s), t) for s, t in tset.items()},
                                   want_K[proj], codebook, where))
    meta = {"format": FORMAT, "kind": "expert", "node": node, "role": role, "layer": str(layer), "block": str(block),
            "K": kbits.to_meta(K), "codebook": codebook, "layout": json.dumps(layout.to_json(), separators=(",", ":"))}
    write_shard(path, raws, meta)
    return _describe_path(path)


def _coded_set(rs: dict, K: int, codebook: str, where: str) -> list:
    """One linear's codec tensor set (suffix -> RawTensor), checked to be K-bit ``codebook`` EXL3 with valid scales:
    its tensors in the order a fragment stores them."""
    marker = rs.get(codebook)
    value = int.from_bytes(marker.data, "little", signed=True) if marker and len(marker.data) == 4 else None
    lin = derive_linear({s: (r.dtype, r.shape) for s, r in rs.items()}, where, value)
    if (lin.K, lin.codebook) != (K, codebook):
        raise FqError(f"{where}: tensors are K={lin.K} {lin.codebook}, fragment declares K={K} {codebook}")
    for s in SCALE_SUFFIXES:
        check_scale(rs[s].data, f"{where} {s}")
    return [rs[s] for s in suffixes(codebook)]


def write_linears(path: str | os.PathLike, *, node: str, cls: str, layer: int | None, K: int, codebook: str,
                  linears: Mapping[str, Mapping[str, "torch.Tensor"]]) -> ShardInfo:
    """Write one linear node's fragment of one layer (None: the head), atomically; returns its digests.
    ``linears[name]`` is the codec's tensor set of the linear whose weight is ``{name}.weight`` in the source."""
    check_node(node)
    if cls not in LINEAR_CLASSES:
        raise FqError(f"linear fragment {node}: class {cls!r}, expected one of {', '.join(LINEAR_CLASSES)}")
    if (layer is None) != (cls == "head") or (layer is not None and (type(layer) is not int or layer < 0)):
        raise FqError(f"linear fragment {node}: layer {layer!r} for class {cls!r} (None for the head only)")
    if not linears:
        raise FqError(f"linear fragment {node} layer {layer}: no linears to write")
    raws: list[RawTensor] = []
    for name in sorted(linears):
        if not _LINEAR_NAME.fullmatch(name):
            raise FqError(f"linear fragment {node}: linear name {name!r} is not a dotted tensor prefix")
        raws.extend(_coded_set({s: _as_raw(f"{name}.{s}", t) for s, t in linears[name].items()}, K, codebook,
                               f"linear fragment {node} {name}"))
    meta = {"format": FORMAT, "kind": "linear", "node": node, "class": cls,
            "layer": "head" if layer is None else str(layer), "K": str(K), "codebook": codebook}
    write_shard(path, raws, meta)
    return _describe_path(path)


def write_skeleton(path: str | os.PathLike, *, tensors: Iterable, source_shard: str) -> ShardInfo:
    """Write the non-expert tensors of one source shard, verbatim, sorted by name, atomically."""
    raws = [t if isinstance(t, RawTensor) else _as_raw(*t) for t in tensors]
    raws.sort(key=lambda r: r.name)
    if not raws:
        raise FqError(f"skeleton of {source_shard}: no tensors (a shard with only experts has no skeleton)")
    write_shard(path, raws, {"format": FORMAT, "kind": "skeleton", "source_shard": source_shard})
    return _describe_path(path)


def _describe_path(path) -> ShardInfo:
    p = Path(path)
    with open(p, "rb") as fh:
        return describe(fh, p.name, str(p))


def skeleton_keys(source_keys: Iterable[str], layout: ExpertLayout) -> list[str]:
    """Keys a skeleton shard of a source shard holds: everything but routed-expert weights, sorted."""
    return sorted(k for k in source_keys if not layout.is_routed_weight(k))
