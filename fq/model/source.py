"""Source checkpoints: what a Hugging Face MoE checkpoint holds, from its metadata alone.

Reads ``config.json`` and ``model.safetensors.index.json`` (or a single shard's header), never a
tensor payload: a campaign is planned and priced before its source is downloaded, so shard sizes
come from the filesystem or from a listing (the hub's file metadata) passed as ``sizes``.

Model families (routed expert names, config keys, MoE layers) come from the registry ``fq.model.families``; source
formats (dense, FP8 with block scales, DeepSeek-V4's FP4 experts: read in place) from ``fq.model.formats``. Every
tensor under a family's routed-experts prefix is an expert matrix (its ``weight``, and for FP8 / FP4 its scale grid,
``weight_scale_inv`` or the family's ``scale_suffix``) or refused;
everything else is skeleton. Next-token-prediction layers past ``num_hidden_layers`` (the family's MTP key) carry
routed experts too and are encoded.
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

from fq.codec.shape import dims_problem, padded_shape
from fq.core import canonical
from fq.core.layer_ranges import format_layers
from fq.errors import FqError
from fq.model import families, formats
from fq.model.checkpoint import INDEX as INDEX_NAME, check_weight_map, open_file, read_meta
from fq.model.families import Family

PROJECTIONS = ("gate", "up", "down")
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def projection_shape(hidden: int, inter: int, proj: str) -> tuple[int, int]:
    """Torch Linear shape (out, in) of one routed-expert projection, from the hidden and intermediate sizes."""
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}[proj]


def config_expert_shapes(config: dict, where: str) -> dict[str, tuple[int, int]]:
    """{gate, up, down: (out, in)} of a routed expert as ``config`` (a source's config.json; ``where`` names it)
    makes it, the matrix's own shape (stored zero-padded: ``fq.codec.shape.padded_shape``)."""
    family = families.for_config(config, where)
    config = family.text_view(config, where)  # a vision-language wrapper: its language model's config
    hidden = families.base.read_int(config, ("hidden_size",), where, family.title)
    inter, _ = family.intermediate(config, where)
    return {p: projection_shape(hidden, inter, p) for p in PROJECTIONS}



@dataclass(frozen=True, eq=False)
class SourceModel:
    """What fq needs to know about a checkpoint to plan, price and encode it."""

    origin: str  # directory or hub repo, for messages
    revision: str  # hub commit, operator-given revision, or "local:sha256:<config+index digest>"
    family: str  # name of its fq.model.families entry
    model_type: str
    hidden_size: int
    moe_intermediate_size: int
    n_experts: int  # routed experts per MoE layer
    dtype: str
    num_hidden_layers: int
    moe_layers: tuple[int, ...]  # every layer with routed experts, ascending (next-token layers included)
    dense_layers: tuple[int, ...]  # layers below num_hidden_layers without routed experts
    mtp_layers: tuple[int, ...]  # the next-token-prediction layers among moe_layers
    weight_map: Mapping[str, str]  # tensor -> shard file, from the index
    shard_sizes: Mapping[str, int]  # shard file -> bytes
    config_sha256: str
    index_sha256: str
    expert_names: Mapping[tuple[int, int, str], str] = field(repr=False)  # (layer, expert, proj) -> tensor
    skeleton_tensors: tuple[str, ...] = field(repr=False)  # every non-routed-expert tensor, sorted
    source_format: formats.SourceFormat = formats.SourceFormat(formats.DENSE)
    expert_scales: Mapping[tuple[int, int, str], str] = field(default_factory=dict, repr=False)  # FP8: -> scale tensor
    exl3_problems: tuple[str, ...] = ()  # why exllamav3 1.6.5 would not load (or would misread) a base; () = it loads
    tied_embeddings: bool = False  # lm_head is the embedding matrix (config tie_word_embeddings)
    # the order of the checkpoint's fused expert tensors where its family reads two (FusedExperts.saved_order)
    fused_order: str | None = None
    config: Mapping = field(default_factory=dict, repr=False, compare=False)  # config.json as parsed

    @property
    def family_entry(self) -> Family:
        return families.by_name(self.family)

    # -- shapes and bytes ----------------------------------------------------------------------
    def expert_shape(self, proj: str) -> tuple[int, int]:
        """Torch Linear shape (out, in) of one projection of one expert."""
        return projection_shape(self.hidden_size, self.moe_intermediate_size, proj)

    def stored_shape(self, proj: str) -> tuple[int, int]:
        """(out, in) of one projection as EXL3 stores it: ``expert_shape`` zero-padded to multiples of 128
        (``fq.codec.shape``; the same shape when 128-aligned)."""
        return padded_shape(self.expert_shape(proj))

    @property
    def padded(self) -> bool:
        """Whether the experts are stored zero-padded (a dim not a multiple of 128)."""
        return any(self.stored_shape(p) != self.expert_shape(p) for p in PROJECTIONS)

    @property
    def expert_params(self) -> int:
        return sum(o * i for o, i in map(self.expert_shape, PROJECTIONS))

    @property
    def dtype_bytes(self) -> int:
        """Bytes per weight of a routed-expert matrix as stored (FP8: 1; its scales are counted apart)."""
        return self.source_format.weight_bytes or DTYPE_BYTES[self.dtype]

    def _scale_bytes(self, proj: str, per_scale: int) -> int:
        o, i = self.expert_shape(proj)
        fmt = self.source_format
        if fmt.kind == formats.MXFP4 or fmt.experts == formats.FP4:  # one e8m0 byte per 32 inputs
            return o * i // formats.MX_GROUP
        if fmt.block is not None:  # FP8: one scale per block
            b0, b1 = fmt.block
            return per_scale * (o // b0) * (i // b1)
        return 0

    def expert_matrix_bytes(self, proj: str) -> int:
        """Source bytes of one expert matrix: its weights and its scales (FP8: float32 per block, at most; MXFP4 and
        FP4: a byte per 32 weights)."""
        o, i = self.expert_shape(proj)
        return int(o * i * self.dtype_bytes) + self._scale_bytes(proj, 4)

    def expert_tensor(self, layer: int, expert: int, proj: str) -> str:
        try:
            return self.expert_names[(layer, expert, proj)]
        except KeyError:
            raise FqError(f"source {self.origin}: no routed expert tensor for layer {layer}, expert {expert}, "
                          f"projection {proj!r}") from None

    # -- shards --------------------------------------------------------------------------------
    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))

    def block_shards(self, layer: int, first_expert: int, count: int) -> tuple[str, ...]:
        """Shards holding any tensor of experts ``first_expert .. first_expert+count-1`` of ``layer``."""
        names = {s for e in range(first_expert, first_expert + count) for p in PROJECTIONS
                 for s in self.expert_source(layer, e, p).shards}
        return tuple(sorted(names))

    def expert_source(self, layer: int, expert: int, proj: str, staged=lambda shard: shard) -> formats.ExpertSource:
        """Where one expert matrix is read from; ``staged`` maps a shard name to its path."""
        tensor = self.expert_tensor(layer, expert, proj)
        scale = self.expert_scales.get((layer, expert, proj))
        shape = self.expert_shape(proj)
        spec = self.family_entry.fused_experts
        # a fused 3-D tensor (expert first): the expert's index, which matrix of it, and how the family lays it out
        fused = (expert, proj, self.fused_order or spec.order, spec.split) \
            if spec and tensor.endswith(_fused_names(spec)) else ()
        if scale is None:
            return formats.ExpertSource(staged(self.weight_map[tensor]), tensor, shape, None, None, None, *fused)
        return formats.ExpertSource(staged(self.weight_map[tensor]), tensor, shape, staged(self.weight_map[scale]),
                                    scale, self.source_format.expert_block, *fused)

    def layer_shards(self, layer: int) -> tuple[str, ...]:
        memo = self.__dict__.setdefault("_layer_shards", {})  # frozen dataclass: a private memo is fine
        if layer not in memo:
            memo[layer] = self.block_shards(layer, 0, self.n_experts)
        return memo[layer]

    @property
    def expert_shards(self) -> tuple[str, ...]:
        return tuple(sorted({self.weight_map[t] for t in (*self.expert_names.values(), *self.expert_scales.values())}))

    @property
    def skeleton_only_shards(self) -> tuple[str, ...]:
        """Shards holding no routed expert tensor (embeddings, dense layers, lm_head...): no layer's
        shard list names them, yet a base cannot be published without their tensors."""
        experts = set(self.expert_shards)
        return tuple(s for s in self.shards if s not in experts)

    def shard_expert_bytes(self, shard: str) -> int:
        return self._expert_bytes_by_shard.get(shard, 0)

    def shard_skeleton_bytes(self, shard: str) -> int:
        """Bytes of a shard that are not routed experts (an upper bound: includes the header)."""
        return self.shard_sizes[shard] - self.shard_expert_bytes(shard)

    @property
    def total_bytes(self) -> int:
        return sum(self.shard_sizes[s] for s in self.shards)

    @property
    def expert_bytes(self) -> int:
        return sum(map(self.expert_matrix_bytes, PROJECTIONS)) * self.n_experts * len(self.moe_layers)

    @property
    def skeleton_bytes(self) -> int:
        return self.total_bytes - self.expert_bytes

    @property
    def _expert_bytes_by_shard(self) -> dict[str, int]:
        cached = self.__dict__.get("_ebs")
        if cached is None:
            cached = {}
            for key, tensor in self.expert_names.items():
                o, i = self.expert_shape(key[2])
                shard = self.weight_map[tensor]
                cached[shard] = cached.get(shard, 0) + int(o * i * self.dtype_bytes)
                if key in self.expert_scales:
                    scale_shard = self.weight_map[self.expert_scales[key]]
                    cached[scale_shard] = cached.get(scale_shard, 0) + self._scale_bytes(key[2], 2)  # >= bf16 scales
            object.__setattr__(self, "_ebs", cached)  # frozen dataclass: a private memo is fine
        return cached

    def summary(self) -> dict:
        return {
            "origin": self.origin,
            "revision": self.revision,
            "family": self.family,
            "model_type": self.model_type,
            "hidden_size": self.hidden_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "n_experts": self.n_experts,
            "dtype": self.dtype,
            "source_format": self.source_format.to_json(),
            "exl3_architecture": None if self.exl3_problems else self.family_entry.exl3,  # None: no EXL3 runtime loads it
            "moe_layers": list(self.moe_layers),
            "dense_layers": list(self.dense_layers),
            "mtp_layers": list(self.mtp_layers),
            "shards": len(self.shards),
            "total_bytes": self.total_bytes,
            "config_sha256": self.config_sha256,
            "index_sha256": self.index_sha256,
        }


# -- loading ----------------------------------------------------------------------------------


def load_source(spec: str | Path, *, revision: str | None = None, sizes: Mapping[str, int] | None = None) -> SourceModel:
    """A SourceModel from a local directory (config.json + index, or one model.safetensors) or a
    hub repo id ``owner/name`` (metadata only, when the hub is reachable).

    ``sizes`` (shard file -> bytes) replaces the filesystem for shard sizes: a campaign prices
    before downloading, from the hub's listing or from metadata staged by ``init``.
    """
    path = Path(spec)
    if path.is_dir():
        meta = read_meta(path)  # fq.model.checkpoint: the one reader of a checkpoint directory
        index = {"weight_map": meta.weight_map}
        if meta.single_header is None:
            index_bytes = meta.index_bytes
            index = canonical.loads(index_bytes, str(path / INDEX_NAME))
            tensors = shard_tensors(path, meta.weight_map, str(path / INDEX_NAME))
        else:
            index_bytes = canonical.dumps(index)
            tensors = {e.name: (e.dtype, e.shape) for e in meta.single_header.entries}
        if sizes is None:
            sizes = _sizes_from_disk(path, index, str(path / INDEX_NAME))
        return parse_source(meta.config, index, sizes, origin=str(path), revision=revision,
                            config_bytes=meta.config_bytes, index_bytes=index_bytes, tensors=tensors)
    if re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*", str(spec)) and not path.exists():
        config_bytes, index_bytes, hub_sizes, commit = _hub_metadata(str(spec), revision)
        return parse_source(canonical.loads(config_bytes, f"{spec}/config.json"),
                            canonical.loads(index_bytes, f"{spec}/{INDEX_NAME}"), sizes if sizes is not None else hub_sizes,
                            origin=str(spec), revision=commit, config_bytes=config_bytes, index_bytes=index_bytes)
    raise FqError(f"{spec}: not a directory (expected a checkpoint directory with config.json and {INDEX_NAME}, "
                  f"or a hub repo id owner/name)")


def load_sizes(path: str | Path) -> dict[str, int]:
    """Shard sizes from a listing file: ``{"name": bytes}``, ``{"files": {"name": {"size": bytes}}}``
    or the hub's ``[{"path": name, "size": bytes}, ...]``."""
    path = Path(path)
    doc = canonical.load(path)
    if isinstance(doc, dict) and "files" in doc:
        doc = doc["files"]
        pairs = doc.items() if isinstance(doc, dict) else None
        if pairs is None:
            raise FqError(f"{path}: 'files' must be an object name -> {{\"size\": bytes}}")
        items = [(k, v.get("size") if isinstance(v, dict) else None) for k, v in pairs]
    elif isinstance(doc, dict):
        items = list(doc.items())
    elif isinstance(doc, list):
        items = []
        for i, e in enumerate(doc):
            if not isinstance(e, dict) or "path" not in e or "size" not in e:
                raise FqError(f"{path}: [{i}]: expected an object with 'path' and 'size'")
            items.append((e["path"], e["size"]))
    else:
        raise FqError(f"{path}: expected a JSON object name -> bytes, or a list of {{path, size}}")
    out: dict[str, int] = {}
    for name, size in items:
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            raise FqError(f"{path}: size of {name!r}: expected a non-negative integer number of bytes, got {size!r}")
        out[name] = size
    return out


def parse_source(config: dict, index: dict, sizes: Mapping[str, int], *, origin: str, revision: str | None = None,
                 config_bytes: bytes | None = None, index_bytes: bytes | None = None,
                 tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None = None) -> SourceModel:
    """Pure: derive a SourceModel from parsed config + index and shard sizes. ``tensors``: tensor -> (safetensors
    dtype, shape) from the shards' headers where they were read (``load_source`` of a local directory), to check
    the config's counts and dims against; None: metadata only (the index and a sizes listing).

    Every count the config claims is checked against what the index (and ``tensors``) hold before anything
    proportional to it is built: a config is a document anyone who publishes a checkpoint writes, and a layer or
    expert count of 10^9 must be refused by name, not exhaust memory."""
    cfg = f"{origin}/config.json"
    idx = f"{origin}/{INDEX_NAME}"
    if not isinstance(config, dict):
        raise FqError(f"{cfg}: expected a JSON object")
    weight_map = check_weight_map(index, idx)
    family = families.for_config(config, cfg)
    if family.unread:
        raise FqError(f"{cfg}: {family.architectures[0]} ({family.title}) checkpoints are not read yet: "
                      f"{family.unread}")
    family.unread_layout(weight_map, idx)
    fmt = formats.source_format(config, cfg)
    top, config = config, family.text_view(config, cfg)  # a vision-language wrapper: its language model's config
    n_layers = families.base.read_int(config, ("num_hidden_layers",), cfg, family.title)
    hidden = families.base.read_int(config, ("hidden_size",), cfg, family.title)
    inter, inter_key = family.intermediate(config, cfg)
    n_experts = family.n_experts(config, cfg)
    family.top_k(config, cfg)  # 1 <= top-k <= n_experts
    _check_layer_count(weight_map, family, n_layers, cfg, idx)
    if fmt.kind == formats.MXFP4 and not (family.fused_experts and family.fused_experts.mxfp4):
        raise FqError(f"{cfg}: quantization_config.quant_method 'mxfp4': fq reads MXFP4 as gpt-oss publishes it (fused "
                      f"expert tensors), not for a {family.architectures[0]} checkpoint")
    shard_sizes = _shard_sizes(weight_map, sizes, origin)
    dtype = config.get("torch_dtype", config.get("dtype"))
    fused = bool(family.fused_experts) and _is_fused(weight_map, family)
    if fused:
        _check_fused_count(weight_map, family, fmt, config, n_experts, hidden, (inter_key, inter), dtype, shard_sizes,
                           tensors, cfg, origin)
        experts, scales, skeleton = _classify_fused(weight_map, family, fmt, n_experts, idx)
        fused_order = fused_tensor_order(weight_map, family, tensors, hidden, inter, origin)
    else:
        experts, scales, skeleton = _classify(weight_map, family, fmt, idx)
        _check_expert_count(experts, n_experts, family.experts_key(config), cfg, idx)
        fused_order = None
    if not experts:
        raise FqError(f"{idx}: no routed expert tensors found: a {family.architectures[0]} checkpoint names them "
                      f"{family.layout.key('{L}', '{E}', family.layout.projections[0], 'weight')} and the like")
    if dtype not in DTYPE_BYTES:
        raise FqError(f"{cfg}: torch_dtype: expected one of {', '.join(DTYPE_BYTES)}, got {dtype!r}")

    found = sorted({layer for layer, _, _ in experts})
    moe_layers, mtp_layers = _check_layers(found, family.moe_layers(config, n_layers, cfg), n_layers,
                                           family.mtp_layers(config, cfg), cfg, idx)
    _check_complete(experts, moe_layers, n_experts, idx)

    for dim_key, dim in ((inter_key, inter), ("hidden_size", hidden)):
        problem = dims_problem(dim)
        if problem:  # a dim that is a multiple of 16 but not of 128 is stored zero-padded (fq.codec.shape)
            raise FqError(f"{cfg}: {dim_key}={dim}: {problem}; the routed expert matrices "
                          f"({experts[(moe_layers[0], 0, 'gate')]} and the like) cannot be encoded")
    if fmt.expert_block is not None:
        for proj in PROJECTIONS:
            formats.scale_grid(projection_shape(hidden, inter, proj), fmt.expert_block,
                               experts[(moe_layers[0], 0, proj)], cfg)
    if tensors is not None and not fused:
        _check_expert_shapes(experts, weight_map, tensors, hidden, (inter_key, inter), fmt, cfg, origin)

    if config_bytes is None:
        config_bytes = canonical.dumps(top)
    if index_bytes is None:
        index_bytes = canonical.dumps(index)
    config_sha, index_sha = canonical.sha256_hex(config_bytes), canonical.sha256_hex(index_bytes)
    if revision is None:
        revision = "local:sha256:" + canonical.sha256_hex(f"{config_sha}\n{index_sha}\n".encode())
    elif not isinstance(revision, str) or not revision.strip() or any(c.isspace() for c in revision):
        raise FqError(f"revision: expected a non-empty commit or tag without whitespace, got {revision!r}")
    moe_set = set(moe_layers)
    model = SourceModel(
        origin=origin, revision=revision, family=family.name, model_type=str(top.get("model_type", "")),
        hidden_size=hidden, moe_intermediate_size=inter, n_experts=n_experts, dtype=dtype,
        num_hidden_layers=n_layers, moe_layers=tuple(moe_layers),
        dense_layers=tuple(l for l in range(n_layers) if l not in moe_set), mtp_layers=tuple(mtp_layers),
        weight_map=dict(weight_map), shard_sizes=shard_sizes, config_sha256=config_sha, index_sha256=index_sha,
        expert_names=experts, skeleton_tensors=tuple(skeleton), source_format=fmt, expert_scales=scales,
        exl3_problems=tuple(family.exl3_problems(config, [l for l in moe_layers if l < n_layers], n_layers)),
        tied_embeddings=bool(config.get("tie_word_embeddings", top.get("tie_word_embeddings", False))),
        fused_order=fused_order, config=top,
    )
    for shard in model.shards:
        if model.shard_skeleton_bytes(shard) < 0:
            raise FqError(f"{origin}: shard {shard} is {shard_sizes[shard]} bytes, less than the "
                          f"{model.shard_expert_bytes(shard)} bytes of routed expert tensors the index puts in it "
                          f"({dtype}, dims from {cfg}): wrong sizes listing or wrong config")
    return model


# -- helpers ------------------------------------------------------------------------------------


def _read_shard_header(path: Path):
    """A shard's header, read and validated by fq's own reader (``fq.model.shards.read_header``: a length, dtype,
    shape or offset that lies is refused naming the file), never a payload."""
    from fq.model.shards import read_header

    with open_file(path.parent, path.name) as fh:
        return read_header(fh, str(path))


def shard_tensors(path: Path, weight_map: Mapping[str, str], idx: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor -> (safetensors dtype, shape) of every shard of the index that is on disk in ``path``, each header read
    with fq's reader at plan time (a shard whose header lies fails here, by name, not in the first job that reads
    it), and the index checked against the headers: every tensor it maps to a shard is in that shard, and no shard
    holds a tensor the index maps to another. Shards not on disk (a plan from a sizes listing) are skipped; a tensor
    a shard holds and the index does not name is not read by anything, and allowed."""
    names: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        names.setdefault(shard, []).append(name)
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for shard in sorted(names):
        p = path / shard
        if not p.exists():  # a plan from a sizes listing; a FIFO or a directory is refused by open_file
            continue
        for e in _read_shard_header(p).entries:
            owner = weight_map.get(e.name)
            if owner is not None and owner != shard:
                raise FqError(f"{p}: holds tensor {e.name!r}, which {idx} maps to {owner}; the index must name the "
                              f"shard each tensor is in")
            out[e.name] = (e.dtype, e.shape)
    for shard in sorted(names):
        if not (path / shard).exists():
            continue
        missing = sorted(n for n in names[shard] if n not in out)
        if missing:
            more = f" ({len(missing)} such tensors)" if len(missing) > 1 else ""
            raise FqError(f"{idx}: weight_map[{missing[0]!r}] names {shard}, but {path / shard} holds no such tensor"
                          f"{more}; the index must name the shard each tensor is in")
    return out


def _sizes_from_disk(path: Path, index: dict, idx: str) -> dict[str, int]:
    out = {}
    for shard in sorted(set(check_weight_map(index, idx).values())):
        try:
            out[shard] = (path / shard).stat().st_size
        except FileNotFoundError:
            raise FqError(f"{path / shard}: shard named by the index is not on disk; pass its size in a listing "
                          f"(--sizes FILE) to plan before downloading") from None
    return out


def _shard_sizes(weight_map: Mapping[str, str], sizes: Mapping[str, int], origin: str) -> dict[str, int]:
    out = {}
    for shard in sorted(set(weight_map.values())):
        if shard not in sizes:
            raise FqError(f"{origin}: no size for shard {shard} (the sizes listing must name every shard of the index)")
        size = sizes[shard]
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise FqError(f"{origin}: size of shard {shard}: expected a positive integer number of bytes, got {size!r}")
        out[shard] = size
    return out


def _fused_names(spec) -> tuple[str, ...]:
    """The names a family's fused expert tensors end with (``.gate_up_proj``, and MXFP4's ``_blocks``)."""
    return tuple(f".{n}{s}" for n in (spec.gate_up, spec.down) for s in ("", "_blocks"))


def _is_fused(weight_map: Mapping[str, str], family: Family) -> bool:
    """Whether a checkpoint of a family that fuses its experts stores them fused: always for gpt-oss; Qwen3.5 is
    published fused and saved by transformers one matrix per expert (``FusedExperts.per_expert_too``)."""
    spec = family.fused_experts
    if not spec.per_expert_too:
        return True
    pattern = family.layout.experts_pattern()
    return any((m := pattern.fullmatch(n)) and m["rest"] in (spec.gate_up, spec.down) for n in weight_map)


def fused_tensor_order(weight_map: Mapping[str, str], family: Family,
                 tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None, hidden: int, inter: int,
                 origin: str) -> str | None:
    """The order of a checkpoint's fused dense expert tensors where its family reads two (``FusedExperts.saved_order``:
    Qwen3-VL-MoE as published, (E, in, out), or as transformers 5.x saves it, (E, out, in)), from the shard headers:
    every layer's gate_up and down together (a square gate_up, hidden = 2·I, does not tell; down then does). Without
    the headers (a plan from a listing), the published order; the encode job checks each slice's shape."""
    spec = family.fused_experts
    if spec.saved_order is None or tensors is None:
        return None
    pattern = family.layout.experts_pattern()
    want = {spec.gate_up: (2 * inter, hidden), spec.down: (hidden, inter)}  # (out, in)
    found = set()
    for name in sorted(weight_map):
        m = pattern.fullmatch(name)
        if m is None or m["rest"] not in want or name not in tensors:
            continue
        shape, (o, i) = tuple(tensors[name][1][1:]), want[m["rest"]]
        orders = {order for order, dims in (("out_in", (o, i)), ("in_out", (i, o))) if shape == dims}
        if not orders:
            raise FqError(f"{origin}/{weight_map[name]}: tensor {name!r} is {list(tensors[name][1])}; the config makes "
                          f"each expert's slice ({o}, {i}) (out, in) or ({i}, {o}) (in, out)")
        found.add((m["layer"], frozenset(orders)))
    per_layer: dict[str, set[str]] = {}
    for layer, orders in found:
        per_layer[layer] = per_layer.get(layer, {"in_out", "out_in"}) & orders
    told = {next(iter(o)) for o in per_layer.values() if len(o) == 1}
    if len(told) > 1 or any(not o for o in per_layer.values()):
        raise FqError(f"{origin}: the fused routed-expert tensors mix (E, in, out) and (E, out, in) layers; a "
                      f"{family.architectures[0]} checkpoint holds one or the other")
    return told.pop() if told else spec.order


def _classify_fused(weight_map: Mapping[str, str], family: Family, fmt: formats.SourceFormat, n_experts: int,
                    idx: str):
    """``_classify`` for a checkpoint that fuses each layer's experts into 3-D tensors (expert first, laid out as
    the family's ``FusedExperts`` says): ``{prefix}gate_up_proj`` and ``{prefix}down_proj`` (dense) or, for
    gpt-oss, their MXFP4 ``_blocks`` / ``_scales``; every expert's matrices point into them
    (``SourceModel.expert_source`` slices them); gpt-oss's ``_bias`` tensors are skeleton."""
    spec = family.fused_experts
    gate_up, down = spec.gate_up, spec.down
    pattern = family.layout.experts_pattern()
    if fmt.kind == formats.FP8:
        raise FqError(f"{idx}: a {family.architectures[0]} checkpoint whose routed experts are fused 3-D tensors in "
                      f"FP8: fq reads fused experts dense{' or in MXFP4' if spec.mxfp4 else ''}, FP8 per expert")
    packed = fmt.kind == formats.MXFP4
    want = {f"{gate_up}_blocks", f"{gate_up}_scales", f"{down}_blocks", f"{down}_scales"} if packed else {gate_up, down}
    kept = {f"{gate_up}_bias", f"{down}_bias"} if spec.biases else set()
    layers: dict[int, set[str]] = {}
    skeleton: list[str] = []
    for name in sorted(weight_map):
        m = pattern.fullmatch(name)
        if m is None:
            skeleton.append(name)
        elif m["rest"] in kept:
            skeleton.append(name)
        elif m["rest"] in want:
            layers.setdefault(int(m["layer"]), set()).add(m["rest"])
        else:
            raise FqError(f"{idx}: tensor {name!r} is under the routed experts but is not one of "
                          f"{', '.join(sorted(want | kept))} (a {family.architectures[0]} checkpoint"
                          f"{' in MXFP4' if packed else ''} fuses each layer's experts into these)")
    experts: dict[tuple[int, int, str], str] = {}
    scales: dict[tuple[int, int, str], str] = {}
    for layer, have in sorted(layers.items()):
        if have != want:
            raise FqError(f"{idx}: layer {layer}'s routed experts lack {', '.join(sorted(want - have))}")
        prefix = family.layout.experts_prefix(layer)
        for e in range(n_experts):
            for proj, fused in (("gate", gate_up), ("up", gate_up), ("down", down)):
                experts[(layer, e, proj)] = prefix + (f"{fused}_blocks" if packed else fused)
                if packed:
                    scales[(layer, e, proj)] = prefix + f"{fused}_scales"
    return experts, scales, skeleton


def _classify(weight_map: Mapping[str, str], family: Family, fmt: formats.SourceFormat, idx: str):
    """(experts {(layer, expert, proj): weight}, their FP8 / FP4 scale grids (the family's ``scale_suffix``) {same
    key: scale tensor}, skeleton names)."""
    layout = family.layout
    proj_of = dict(zip(layout.projections, PROJECTIONS))
    experts: dict[tuple[int, int, str], str] = {}
    scales: dict[tuple[int, int, str], str] = {}
    skeleton: list[str] = []
    prefix = layout.prefix.split("{expert}")[0]
    under_experts = layout.experts_pattern()
    for name in sorted(weight_map):
        parsed = layout.parse(name)
        if parsed is None:
            m = under_experts.fullmatch(name)
            if m and m["rest"] not in family.experts_skeleton:
                # A fused 3-D tensor, a bias, or names of another layout would silently become skeleton: refuse.
                raise FqError(f"{idx}: tensor {name!r} is under the routed experts ({prefix}) but is not one expert's "
                              f"{'/'.join(layout.projections)} matrix; a {family.architectures[0]} checkpoint stores "
                              f"each expert's projections as {layout.key('{L}', '{E}', layout.projections[0], 'weight')}")
            skeleton.append(name)
            continue
        layer, expert, proj, suffix = parsed
        key = (layer, expert, proj_of[proj])
        if suffix == "weight":
            experts[key] = name
        elif suffix == family.scale_suffix and fmt.kind == formats.FP8:
            scales[key] = name
        else:
            want = f"weight or {family.scale_suffix}" if fmt.kind == formats.FP8 else "weight (the config has no " \
                "FP8 quantization_config)"
            raise FqError(f"{idx}: tensor {name!r}: an expert matrix's tensors are {want}, not {suffix!r}")
    strays = sorted(set(scales) - set(experts))
    if strays:
        raise FqError(f"{idx}: tensor {scales[strays[0]]!r} scales no weight in the index")
    if fmt.kind == formats.FP8:
        unscaled = sorted(set(experts) - set(scales))
        if unscaled:  # the authors quantize every routed expert; a checkpoint that does not is not what it says
            raise FqError(f"{idx}: tensor {experts[unscaled[0]]!r} has no {family.scale_suffix} ({len(unscaled)} "
                          f"expert matrices without one), but the config's quantization_config is fp8")
    return experts, scales, skeleton


_LAYER_NUMBER = r"(0|[1-9][0-9]{0,8})\."


def _check_layer_count(weight_map: Mapping[str, str], family: Family, n_layers: int, cfg: str, idx: str) -> None:
    """``num_hidden_layers`` against the decoder layers the index names tensors of (every decoder layer has some:
    its norms at least), before anything is built per layer."""
    pattern = re.compile(re.escape(family.layout.layers) + _LAYER_NUMBER)
    held = {int(m[1]) for m in map(pattern.match, weight_map) if m}
    if n_layers > len(held):
        where = f"layer(s) {format_layers(sorted(held))} under {family.layout.layers}" if held else \
            f"none under {family.layout.layers}"
        raise FqError(f"{cfg}: field 'num_hidden_layers': {n_layers} decoder layers, but {idx} names tensors of "
                      f"{len(held)} ({where}); a config must not claim more layers than its checkpoint holds")


def _check_expert_count(experts: Mapping[tuple[int, int, str], str], n_experts: int, key: str, cfg: str,
                        idx: str) -> None:
    """The routed-expert count against the expert numbers the index names (one matrix per expert), before anything
    is built per expert: more experts than any layer's tensors name is a config that lies."""
    held = max((e for _, e, _ in experts), default=-1) + 1
    if experts and n_experts > held:
        raise FqError(f"{cfg}: field {key!r}: {n_experts} routed experts per MoE layer, but {idx} names experts 0.."
                      f"{held - 1} at most ({held}); a config must not claim more experts than its checkpoint holds")


def _check_fused_count(weight_map: Mapping[str, str], family: Family, fmt: formats.SourceFormat, config: dict,
                       n_experts: int, hidden: int, inter: tuple[str, int], dtype, sizes: Mapping[str, int],
                       tensors: Mapping[str, tuple[str, tuple[int, ...]]] | None, cfg: str, origin: str) -> None:
    """The routed-expert count of a checkpoint whose experts are fused 3-D tensors (expert first), which the index
    cannot count: against each fused tensor's first dimension where the shard headers were read, else against the
    bytes the sizes give each shard (every expert's matrices take at least half a byte per weight). Refused before
    anything is built per expert."""
    key = family.experts_key(config)
    spec = family.fused_experts
    pattern = family.layout.experts_pattern()
    names = sorted(n for n in weight_map if (m := pattern.fullmatch(n)) and m["rest"] in (
        spec.gate_up, spec.down, f"{spec.gate_up}_blocks", f"{spec.down}_blocks"))
    if tensors is not None:
        for name in names:
            if name in tensors:
                shape = tensors[name][1]
                if not shape or shape[0] != n_experts:
                    raise FqError(f"{cfg}: field {key!r}: {n_experts} routed experts per MoE layer, but "
                                  f"{origin}/{weight_map[name]}: tensor {name!r} is {list(shape)}, "
                                  f"{shape[0] if shape else 0} experts (its first dimension)")
        if all(name in tensors for name in names):
            return
    inter_key, inter_size = inter
    for dim_key, dim in ((inter_key, inter_size), ("hidden_size", hidden)):  # the bound below needs honest dims
        problem = dims_problem(dim)
        if problem:
            shown = names[0] if names else "the fused expert tensors"
            raise FqError(f"{cfg}: {dim_key}={dim}: {problem}; the routed expert matrices ({shown} and the like) "
                          f"cannot be encoded")
    # bytes per weight as stored, at least (MXFP4: half a byte; an unknown dtype, refused later: the smallest)
    per_weight = fmt.weight_bytes or DTYPE_BYTES.get(dtype, min(DTYPE_BYTES.values()))
    need: dict[str, float] = {}
    for name in names:
        matrices = 2 if pattern.fullmatch(name)["rest"].startswith(spec.gate_up) else 1
        need[weight_map[name]] = need.get(weight_map[name], 0) + n_experts * matrices * hidden * inter_size * per_weight
    for shard, bytes_ in sorted(need.items()):
        if bytes_ > sizes[shard]:
            raise FqError(f"{cfg}: field {key!r}: {n_experts} routed experts per MoE layer (hidden_size={hidden}, "
                          f"{inter_key}={inter_size}) need at least {int(bytes_)} bytes of fused expert tensors in "
                          f"{shard}, which is {sizes[shard]} bytes; a config must not claim more experts than its "
                          f"checkpoint holds")


def _check_expert_shapes(experts: Mapping[tuple[int, int, str], str], weight_map: Mapping[str, str],
                         tensors: Mapping[str, tuple[str, tuple[int, ...]]], hidden: int, inter: tuple[str, int],
                         fmt: formats.SourceFormat, cfg: str, origin: str) -> None:
    """Each routed expert matrix's shape, as its shard's header states it, against the (out, in) the config's dims
    make (what an encode job reads it as; FP4: (out, in/2), two e2m1 values a byte): a config that lies about them is
    refused at plan time, not in a job."""
    inter_key, inter_size = inter
    fp4 = fmt.experts == formats.FP4
    for (layer, expert, proj), name in sorted(experts.items()):
        if name not in tensors:  # its shard is not on disk (planned from a sizes listing)
            continue
        want = projection_shape(hidden, inter_size, proj)
        stored = (want[0], want[1] // 2) if fp4 else want
        shape = tuple(tensors[name][1])
        if shape != stored:
            packed = f", stored {list(stored)} (FP4: two e2m1 values a byte)" if fp4 else ""
            raise FqError(f"{origin}/{weight_map[name]}: tensor {name!r} is {list(shape)}, but {cfg} makes a routed "
                          f"expert's {proj} projection {list(want)} (out, in){packed} from hidden_size={hidden} and "
                          f"{inter_key}={inter_size}")


def _check_layers(found: list[int], expected: list[int], n_layers: int, mtp_allowed: int, cfg: str, idx: str):
    main = [l for l in found if l < n_layers]
    beyond = [l for l in found if l >= n_layers]
    problems = []
    missing = sorted(set(expected) - set(main))
    unexpected = sorted(set(main) - set(expected))
    if missing:
        problems.append(f"the config makes layer(s) {format_layers(missing)} MoE but the index has no routed experts there")
    if unexpected:
        problems.append(f"the index has routed experts in layer(s) {format_layers(unexpected)}, which the config makes dense")
    bad_mtp = [l for l in beyond if l >= n_layers + mtp_allowed]
    if bad_mtp:
        problems.append(f"routed experts in layer(s) {format_layers(bad_mtp)} beyond num_hidden_layers={n_layers}"
                        f" + num_nextn_predict_layers={mtp_allowed}")
    if problems:
        raise FqError(f"{idx} disagrees with {cfg}: " + "; ".join(problems))
    return sorted(found), beyond


def _check_complete(experts: dict, moe_layers: list[int], n_experts: int, idx: str) -> None:
    extra = sorted(k for k in experts if k[1] >= n_experts)
    if extra:
        layer, e, proj = extra[0]
        raise FqError(f"{idx}: tensor {experts[extra[0]]!r} has expert index {e}, but the config has {n_experts} experts "
                      f"per layer ({len(extra)} such tensors)")
    # every key is of a layer in moe_layers and an expert below n_experts: the missing ones are counted, and the
    # first few found by a walk that passes at most len(experts) present ones (never a list of every expected one)
    n_missing = len(moe_layers) * n_experts * len(PROJECTIONS) - len(experts)
    if n_missing:
        expected = ((l, e, p) for l in moe_layers for e in range(n_experts) for p in PROJECTIONS)
        first = list(itertools.islice((k for k in expected if k not in experts), 5))
        shown = ", ".join(f"layer {l} expert {e} {p}" for l, e, p in first)
        raise FqError(f"{idx}: {n_missing} routed expert matrices missing from the index (first: {shown}); every "
                      f"MoE layer needs gate, up and down of experts 0..{n_experts - 1}")


def _hub_metadata(repo: str, revision: str | None) -> tuple[bytes, bytes, dict[str, int], str]:
    """config.json, the index, shard sizes and the resolved commit of a hub repo (no payloads)."""
    offline = (f"{repo}: not a local directory, and the Hugging Face hub is not available offline; put config.json "
               f"and {INDEX_NAME} in a directory and pass that (with --sizes for shard sizes)")
    try:
        from huggingface_hub import HfApi, hf_hub_download
        from huggingface_hub import constants as hf_constants
    except ImportError:
        raise FqError(offline + " (huggingface_hub is not installed)") from None
    if hf_constants.HF_HUB_OFFLINE:
        raise FqError(offline + " (HF_HUB_OFFLINE is set)")
    try:
        info = HfApi().model_info(repo, revision=revision, files_metadata=True)
        commit = info.sha
        config = Path(hf_hub_download(repo, "config.json", revision=commit)).read_bytes()
        index = Path(hf_hub_download(repo, INDEX_NAME, revision=commit)).read_bytes()
        sizes = {s.rfilename: s.size for s in (info.siblings or []) if s.size is not None}
    except Exception as e:  # network, auth, missing repo: one line, not a traceback
        raise FqError(f"{offline} ({type(e).__name__}: {e})") from None
    return config, index, sizes, commit
