"""A whole-model base's quantized non-expert linears in a TP export: each cut by whole 128-aligned tiles.

Per tp rank ``t`` of ``tp``, one shard per linear fragment, ``linears-tp{t}/NAME``, holding every linear of the
fragment, cut as Megatron-style tensor parallelism runs it, or whole where it cannot be cut:

- attention (one layer together): q/k/v (MHA, GQA) and MLA's q_b/kv_b (or q without a LoRA) split by output
  channels, o_proj by input channels, when the query heads (and the key/value heads) divide by tp and every cut
  dimension is a multiple of tp x 128; MLA's low-rank q_a/kv_a (a norm follows them) stay whole;
- shared experts and dense MLPs (one module together): gate/up by output, down by input, when the intermediate
  size is a multiple of tp x 128;
- lm_head by output (vocabulary) channels, when the vocabulary is a multiple of tp x 128.

Anything else, or a dimension that does not divide, is stored whole in every rank's shard (``slice`` null): a
loader computes it replicated. Nothing is re-quantized: the trellis words, ``suh`` and ``svh`` are the fragment's
own, cut along tile rows/columns (``fq.tp.slicing``).

``split_dims`` is the one rule: tp-export cuts by it (``write_linears``) and the manifest declares by it
(``linear_manifest``: ``SplitOutput``, ``SplitInput`` reducing into one declared all-reduce per row-split linear, or
``Replicate``), so fq's store (``fq.tp.store``) loads exactly the pieces the export holds. Its geometry
(``LinearSpec``) comes from the plan's linear fragments' attestations and headers, never from payload.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from fq.core.canonical import loads, sha256_hex
from fq.core.safepath import open_regular
from fq.errors import FqError
from fq.model.shards import RawTensor, read_header, read_range, tensors_in_range, write_shard
from fq.provenance.attest.fragment import check_header, read_attestation
from fq.provenance.exl3config import CONFIG, SOURCE_CONFIG
from fq.provenance.fragments import fragment_meta, linear_structure
from fq.provenance.manifest import read_verified
from fq.tp import records
from fq.tp.manifest import EXL3, HAD, Collective, Replicate, SplitInput, SplitOutput, WeightEntry
from fq.tp.mesh import Slice, tp_slice
from fq.tp.slicing import SUFFIX_ORDER, slice_exl3

OUT_SPLIT = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
IN_SPLIT = ("o_proj", "down_proj")


def linear_dir(tp: int) -> str:
    return f"linears-tp{tp}"


def _leaf(prefix: str) -> str:
    return prefix.rsplit(".", 1)[-1]


def _divides(n: int, tp: int) -> bool:
    return n % (tp * HAD) == 0


def split_dims(cls: str, shapes: dict[str, tuple[int, int]], config: dict, tp: int) -> dict[str, int | None]:
    """prefix -> the dimension its tp ranks split (0: output channels, 1: input channels) or None (kept whole), for
    one fragment's linears of class ``cls`` (true, unpadded (out, in) shapes). A layer's attention, or an MLP, is
    split together or not at all: its partial products only add up when every one of its linears is cut alike."""
    if tp == 1:
        return {p: None for p in shapes}
    dims = {p: (0 if _leaf(p) in OUT_SPLIT else 1 if _leaf(p) in IN_SPLIT else None) for p in shapes}
    if cls == "head":
        return {p: (0 if _divides(s[0], tp) else None) for p, s in shapes.items()}
    groups: dict[str, list[str]] = {}
    for p in shapes:
        groups.setdefault(p.rsplit(".", 1)[0], []).append(p)
    out = {}
    for module, members in groups.items():
        cut = [p for p in members if dims[p] is not None]
        ok = bool(cut) and all(_divides(shapes[p][dims[p]], tp) for p in cut)
        if cls == "attention":
            heads = config.get("num_attention_heads")
            kv = config.get("num_key_value_heads") or heads
            has_kv = any(_leaf(p) in ("k_proj", "v_proj") for p in members)
            ok = ok and isinstance(heads, int) and heads % tp == 0 and (not has_kv or kv % tp == 0)
        out.update({p: (dims[p] if ok else None) for p in members})
    return out


@dataclass(frozen=True)
class LinearSpec:
    """One quantized non-expert linear of a whole-model base, as the manifest declares it."""

    name: str  # the checkpoint prefix: its weight is f"{name}.weight"
    cls: str  # attention, shared, dense or head
    layer: int | None  # None: the head
    fragment: str  # the plan's linear fragment holding it (ROOT-relative); split_dims decides per fragment
    shape: tuple[int, int]  # the source weight's (out, in): what split_dims reads
    stored: tuple[int, int]  # the (out, in) its EXL3 tensors imply (padded to multiples of 128)

    def to_json(self) -> dict:
        return {"name": self.name, "class": self.cls, "layer": self.layer, "fragment": self.fragment,
                "shape": list(self.shape), "stored": list(self.stored)}

    @classmethod
    def from_json(cls, obj: dict) -> "LinearSpec":
        return cls(obj["name"], obj["class"], obj["layer"], obj["fragment"], tuple(obj["shape"]), tuple(obj["stored"]))


def _heads_config(heads: tuple) -> dict:
    return {"num_attention_heads": heads[0], "num_key_value_heads": heads[1]}


def linear_dims(linears: tuple[LinearSpec, ...], heads: tuple, tp: int) -> dict[str, int | None]:
    """name -> the dimension tp ranks split (0 out, 1 in) or None (whole): ``split_dims`` per fragment. ``heads``:
    (num_attention_heads, num_key_value_heads) of the base's config."""
    by_fragment: dict[str, list[LinearSpec]] = {}
    for lin in linears:
        by_fragment.setdefault(lin.fragment, []).append(lin)
    out: dict[str, int | None] = {}
    for lins in by_fragment.values():
        out.update(split_dims(lins[0].cls, {lin.name: lin.shape for lin in lins}, _heads_config(heads), tp))
    return out


def reduce_name(name: str) -> str:
    """The all-reduce that sums a row-split linear's partial outputs (one per linear: attention's o_proj, an MLP's
    down_proj)."""
    return f"{name}_reduce"


def linear_manifest(linears: tuple[LinearSpec, ...], heads: tuple, tp: int) -> tuple[list, list]:
    """(entries, collectives) declaring each linear at ``tp`` as tp-export cuts it: ``SplitOutput()``,
    ``SplitInput`` into its own declared all-reduce over tp, or ``Replicate()`` where it is kept whole."""
    dims = linear_dims(linears, heads, tp)
    entries, collectives = [], []
    for lin in linears:
        dim = dims[lin.name]
        if dim is not None and lin.stored[dim] != lin.shape[dim]:  # split_dims cuts only 128-multiples: never padded
            raise FqError(f"{lin.fragment}: {lin.name} would be cut along its padded dimension {dim}")
        if dim == 1:
            collectives.append(Collective(reduce_name(lin.name), lin.layer, ("tp",)))
            policy = SplitInput(reduce_name(lin.name))
        else:
            policy = SplitOutput() if dim == 0 else Replicate()
        entries.append(WeightEntry(f"{lin.name}.weight", lin.layer, None, lin.stored, EXL3, lin.cls, policy))
    return entries, collectives


def linear_specs(src) -> tuple[tuple, tuple[LinearSpec, ...]]:
    """(heads, every linear of ``src``'s plan): geometry from each linear fragment's verified attestation (the source
    weight's shape) and header (the stored one), checked against the plan entry; no payload read."""
    if not src.predicate.get("linears"):
        return (None, None), ()
    config = _base_config(src)
    heads = (config.get("num_attention_heads"), config.get("num_key_value_heads"))
    out = []
    for f in src.predicate["linears"]:
        where = f"{src.root}/{f['name']}"
        att = read_attestation(src.root, f["name"], src.key, src.predicate["campaign"], sha256=f["attestation_sha256"])
        src.product.check_linear(att, f, where)
        with open_regular(src.root, f["name"], where) as fh:
            header = read_header(fh, where)
        src.product.check_header(att, header, f, where)
        _, lins = linear_structure(header, fragment_meta(header))
        shapes = _source_shapes(att)
        for name in sorted(lins):
            if name not in shapes:
                raise FqError(f"{where}: linear {name}: its attestation names no source weight {name}.weight")
            out.append(LinearSpec(name, f["class"], f["layer"], f["name"], shapes[name],
                                  (lins[name].out_features, lins[name].in_features)))
    return heads, tuple(out)


def _source_shapes(att) -> dict[str, tuple[int, int]]:
    """prefix -> (out, in) of the source weights a linear fragment's attestation names."""
    return {t["tensor"].removesuffix(".weight"): tuple(t["shape"]) for t in att.predicate["source"]["tensors"]}


def _base_config(src) -> dict:
    """The base's model config (its source's, verbatim, where kept), checked against the base manifest."""
    base_dir, manifest = src.base_manifest()
    name = SOURCE_CONFIG if SOURCE_CONFIG in manifest.files else CONFIG
    _, data = read_verified(base_dir, name, *manifest.files[name])
    config = loads(data, f"{base_dir}/{name}")
    return config.get("text_config", config) if isinstance(config.get("text_config"), dict) else config


def read_linear_fragment(src, f: dict) -> tuple[object, dict, dict]:
    """(attestation, {prefix: tensor set}, {prefix: (out, in)}) of one of the plan's linear fragments, its
    attestation and bytes checked against the plan entry ``f`` before any tensor exists."""
    root = src.root
    where = f"{root}/{f['name']}"
    att = read_attestation(root, f["name"], src.key, src.predicate["campaign"], sha256=f["attestation_sha256"])
    src.product.check_linear(att, f, where)
    with open_regular(root, f["name"], where) as fh:
        header = read_header(fh, where)
        check_header(att, header, where)
        data = read_range(fh, 0, header.file_size, where)
    if sha256_hex(data) != f["sha256"]:
        raise FqError(f"{where}: bytes do not match the sha256 the plan names")
    shapes = _source_shapes(att)
    tensors = tensors_in_range(header, [e.name for e in header.entries], 0, data)
    sets: dict = {}
    for name, t in tensors.items():
        prefix, _, suffix = name.rpartition(".")
        if prefix not in shapes:
            raise FqError(f"{where}: tensor {name} belongs to no linear its attestation names")
        sets.setdefault(prefix, {})[suffix] = t
    return att, sets, shapes


def write_linears(src, tmp: Path, mesh: dict, common: dict, key, attest) -> list[dict]:
    """Every linear fragment of the product's plan, cut for each of the mesh's tp ranks (every ep group reads the
    same ones); ``attest(tmp, name, sha, predicate, key, kind, coords, node, layer)`` signs one shard and returns its
    index entry."""
    tp = mesh["tp"]
    linears = src.predicate.get("linears", ())
    if not linears:
        return []
    spec = src.spec()
    dims = linear_dims(spec.linears, spec.heads, tp)  # what the manifest declares at this tp, too
    files = []
    for f in linears:
        att, sets, shapes = read_linear_fragment(src, f)
        p = att.predicate
        for t in range(tp):
            name = f"{linear_dir(t)}/{f['name'].rsplit('/', 1)[-1]}"
            raws, groups, slices = [], [], []
            for prefix in sorted(sets):
                dim = dims[prefix]
                sl = None if dim is None else tp_slice(shapes[prefix][dim], dim, t, tp)
                piece = slice_exl3(sets[prefix], sl, f"{f['name']}: {prefix}")
                keys = [f"{prefix}.{s}" for s in SUFFIX_ORDER if s in piece]
                raws += [RawTensor.of(k, piece[k.rsplit(".", 1)[1]]) for k in keys]
                groups.append(keys)
                slices.append((prefix, sl))
            meta = {"format": records.SHARD_FORMAT, "kind": "linear", "product": common["product"], "node": p["node"],
                    "class": p["class"], "K": str(p["K"]), "codebook": p["codebook"], "tp": str(tp), "coords": str(t)}
            write_shard(tmp / name, raws, meta)
            sha, size, hsha, spans = records.written(tmp / name, groups)
            predicate = {**common, "kind": "linear", "mesh": dict(mesh), "coords": {"tp": t}, "node": p["node"],
                         "class": p["class"], "layer": p["layer"], "K": p["K"], "codebook": p["codebook"],
                         "source": {"name": f["name"], "sha256": f["sha256"],
                                    "attestation_sha256": f["attestation_sha256"]},
                         "shard": {"size": size, "header_sha256": hsha},
                         "linears": [{"name": prefix, "shape": list(shapes[prefix]), "offset": o, "length": n,
                                      "sha256": d, "slice": sl.to_json() if sl else None}
                                     for (prefix, sl), (o, n, d) in zip(slices, spans)]}
            files.append(attest(tmp, name, sha, predicate, key, "linear", {"tp": t}, p["node"], p["layer"]))
    return files


def linear_ranges(fh, header, p: dict, where: str, names=None):
    """(record entry, its header keys, its bytes) of each linear of a verified linear record ``p`` (those named in
    ``names`` when given) in an open shard whose ``header`` is the attested one: the range checked against the header
    and the bytes against the attested sha256 before any tensor exists."""
    for lin in p["linears"]:
        if names is not None and lin["name"] not in names:
            continue
        keys = [e.name for e in header.entries if e.name.rpartition(".")[0] == lin["name"]]
        if not keys or header.span(keys, lin["name"]) != (lin["offset"], lin["length"]):
            raise FqError(f"{where}: linear {lin['name']} is not at its attested byte range")
        data = read_range(fh, lin["offset"], lin["length"], where)
        if sha256_hex(data) != lin["sha256"]:
            raise FqError(f"{where}: bytes of linear {lin['name']} do not match the attested sha256 (payload altered)")
        yield lin, keys, data


def read_linear_shard(directory: Path, name: str, p: dict) -> dict[str, tuple[dict, Slice | None, tuple[int, int]]]:
    """One linear rank shard whose record ``p`` is verified: prefix -> (its EXL3 tensor set, the slice of the unsliced
    (out, in) it holds or None for whole, that (out, in)); the header, size and each linear's bytes checked against
    the record before its tensors exist."""
    where = f"{directory}/{name}"
    out = {}
    with open_regular(directory, name, where) as fh:
        header = records.attested_header(fh, p, where)
        for lin, keys, data in linear_ranges(fh, header, p, where):
            tensors = tensors_in_range(header, keys, lin["offset"], data)
            sl = Slice(**lin["slice"]) if lin["slice"] else None
            out[lin["name"]] = ({k.rpartition(".")[2]: t for k, t in tensors.items()}, sl, tuple(lin["shape"]))
    return out
