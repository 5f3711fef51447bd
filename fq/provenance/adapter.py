"""The adapter ``fq combine`` writes: one safetensors file per product holding the residual tensors
of the chosen experts (inference engines take one adapter per request).

Keys: ``{expert prefix}.{projection}.stage{i}.{trellis|suh|svh|mul1|mcg}``, ``i`` = the node's index in
the product chain (the base is 0 and is not in the adapter). Layout: by layer, expert, stage,
projection, suffix, so each (layer, expert) is one contiguous byte range. Header metadata (strings):
``format=fq-adapter/1, product, version, plan_sha256, stages`` (JSON: index, node, K, codebook —
re-derived from the fragments' tensors; K the chain node's ``fq.core.kbits`` node spec as JSON, one K or K per layer
and projection), ``layout`` (JSON).

    write_adapter(path, tensors=[RawTensor], meta=) -> (sha256, [(layer, expert, offset, length, sha256)])
    read_adapter(path) -> Adapter   # .linears[(layer, expert, proj)] = [(stage index, {suffix: tensor})]
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import torch

from fq.codec import validate_tensors
from fq.core import kbits
from fq.core.canonical import loads
from fq.core.safepath import open_regular, sha256_stream, split_path
from fq.errors import FqError
from fq.model.experts import ExpertLayout, derive_linear
from fq.model.shards import RawTensor, read_header, tensors_in_range, write_shard

FORMAT = "fq-adapter/1"


def adapter_key(layout: ExpertLayout, layer: int, expert: int, proj: str, stage: int, suffix: str) -> str:
    return f"{layout.expert_prefix(layer, expert)}.{proj}.stage{stage}.{suffix}"


def _adapter_re(layout: ExpertLayout) -> re.Pattern:
    pattern = re.escape(layout.prefix).replace(r"\{layer\}", r"(?P<layer>0|[1-9][0-9]{0,8})") \
        .replace(r"\{expert\}", r"(?P<expert>0|[1-9][0-9]{0,8})")
    projs = "|".join(re.escape(p) for p in layout.projections)
    return re.compile(rf"{pattern}\.(?P<proj>{projs})\.stage(?P<stage>[1-9][0-9]{{0,8}})\.(?P<suffix>[A-Za-z0-9_]+)")


def write_adapter(path: str | os.PathLike, *, tensors: list[RawTensor], meta: dict[str, str],
                  layout: ExpertLayout) -> tuple[str, list[tuple[int, int, int, int, str]]]:
    """Write ``tensors`` (already in adapter order) atomically; returns file sha256 and per-expert ranges."""
    write_shard(path, tensors, meta)
    directory, name = split_path(path)
    rx = _adapter_re(layout)
    with open_regular(directory, name, str(path)) as fh:
        header = read_header(fh, str(path))
        groups: dict[tuple[int, int], list[str]] = {}
        for e in header.entries:
            m = rx.fullmatch(e.name)
            groups.setdefault((int(m["layer"]), int(m["expert"])), []).append(e.name)
        keys = sorted(groups)
        spans = [header.span(groups[k], f"layer {k[0]} expert {k[1]}") for k in keys]
        whole, _, digests = sha256_stream(fh, spans)
    return whole, [(k[0], k[1], off, n, d) for k, (off, n), d in zip(keys, spans, digests)]


@dataclass(frozen=True)
class Adapter:
    meta: dict
    stages: list[dict]
    layout: ExpertLayout
    linears: dict  # (layer, expert, proj) -> [(stage index, {suffix: tensor})], stages ascending

    def chain(self, layer: int, expert: int, proj: str, base: dict) -> list[dict]:
        """The tensor sets whose reconstructions sum to the product's weight: the base's set, then the stages', each
        as it reconstructs the source's matrix (``ExpertLayout.source``: a stored scale undone)."""
        stages = [tset for _, tset in self.linears.get((layer, expert, proj), [])]
        return [self.layout.source(proj, t) for t in [base] + stages]


def read_adapter(path: str | os.PathLike) -> Adapter:
    """Load an adapter, checking its keys and that every linear's tensors imply its stage's K/codebook."""
    directory, name = split_path(path)
    with open_regular(directory, name, str(path)) as fh:
        header = read_header(fh, str(path))
        fh.seek(0)
        data = fh.read()
    meta = header.metadata
    if meta.get("format") != FORMAT:
        raise FqError(f"{path}: header metadata format is {meta.get('format')!r}, expected {FORMAT!r}")
    if "stages" not in meta or "layout" not in meta:
        raise FqError(f"{path}: header metadata needs JSON 'stages' and 'layout'")
    stages = loads(meta["stages"], f"{path}: header metadata stages")
    layout = ExpertLayout.from_json(loads(meta["layout"], f"{path}: header metadata layout"), f"{path}: layout")
    if not isinstance(stages, list) or not all(isinstance(s, dict) and {"index", "K", "codebook"} <= set(s)
                                               for s in stages):
        raise FqError(f"{path}: header metadata 'stages' must be a list of {{index, node, K, codebook}}")
    by_index = {s["index"]: s for s in stages}
    node_K = {i: kbits.node(s["K"], f"{path}: header metadata stages[{i}] K") for i, s in by_index.items()}
    canonical = dict(zip(layout.projections, kbits.PROJECTIONS))
    rx = _adapter_re(layout)
    tensors = tensors_in_range(header, [e.name for e in header.entries], 0, data)
    grouped: dict[tuple[int, int, str, int], dict[str, torch.Tensor]] = {}
    for e in header.entries:
        m = rx.fullmatch(e.name)
        if m is None or int(m["stage"]) not in by_index:
            raise FqError(f"{path}: tensor {e.name!r} is not an adapter key of this layout and stage list")
        k = (int(m["layer"]), int(m["expert"]), m["proj"], int(m["stage"]))
        grouped.setdefault(k, {})[m["suffix"]] = tensors[e.name]
    linears: dict = {}
    for (layer, expert, proj, stage), tset in sorted(grouped.items()):
        where = f"{path}: layer {layer} expert {expert} {proj} stage {stage}"
        specs = {s: (header.entry(adapter_key(layout, layer, expert, proj, stage, s)).dtype, tuple(t.shape))
                 for s, t in tset.items()}
        marker = next((t for s, t in tset.items() if s in ("mul1", "mcg")), None)
        lin = derive_linear(specs, where, int(marker.item()) if marker is not None else None)
        K = kbits.proj(kbits.at_layer(node_K[stage], layer, f"{where}: header metadata K"), canonical[proj])
        if (lin.K, lin.codebook) != (K, by_index[stage]["codebook"]):
            raise FqError(f"{where}: tensors are K={lin.K} {lin.codebook}, metadata says otherwise")
        validate_tensors(tset, where, K=lin.K, codebook=lin.codebook)
        linears.setdefault((layer, expert, proj), []).append((stage, tset))
    return Adapter(dict(meta), stages, layout, linears)
