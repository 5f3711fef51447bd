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
"""
from __future__ import annotations

from pathlib import Path

from fq.core.canonical import loads, sha256_hex
from fq.core.safepath import open_regular
from fq.errors import FqError
from fq.model.shards import RawTensor, read_header, read_range, tensors_in_range, write_shard
from fq.provenance.attest.fragment import check_header, read_attestation
from fq.provenance.exl3config import CONFIG, SOURCE_CONFIG
from fq.provenance.manifest import read_verified
from fq.tp import records
from fq.tp.manifest import HAD
from fq.tp.mesh import Slice
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


def _shard_slice(dim: int | None, shape: tuple[int, int], t: int, tp: int) -> Slice | None:
    """Rank ``t``'s equal share of dimension ``dim`` of (out, in) ``shape``; None: the whole linear."""
    if dim is None:
        return None
    step = shape[dim] // tp
    return Slice(dim, t * step, (t + 1) * step)


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
    shapes = {t["tensor"].removesuffix(".weight"): tuple(t["shape"]) for t in att.predicate["source"]["tensors"]}
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
    config = _base_config(src)
    files = []
    for f in linears:
        att, sets, shapes = read_linear_fragment(src, f)
        dims = split_dims(f["class"], shapes, config, tp)
        p = att.predicate
        for t in range(tp):
            name = f"{linear_dir(t)}/{f['name'].rsplit('/', 1)[-1]}"
            raws, groups, slices = [], [], []
            for prefix in sorted(sets):
                sl = _shard_slice(dims[prefix], shapes[prefix], t, tp)
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


def read_linear_shard(directory: Path, name: str, p: dict) -> dict[str, tuple[dict, Slice | None, tuple[int, int]]]:
    """One linear rank shard whose record ``p`` is verified: prefix -> (its EXL3 tensor set, the slice of the unsliced
    (out, in) it holds or None for whole, that (out, in)); the header, size and each linear's bytes checked against
    the record before its tensors exist."""
    where = f"{directory}/{name}"
    out = {}
    with open_regular(directory, name, where) as fh:
        header = records.attested_header(fh, p, where)
        for lin in p["linears"]:
            keys = [e.name for e in header.entries if e.name.rpartition(".")[0] == lin["name"]]
            if not keys or header.span(keys, lin["name"]) != (lin["offset"], lin["length"]):
                raise FqError(f"{where}: linear {lin['name']} is not at its attested byte range")
            data = read_range(fh, lin["offset"], lin["length"], where)
            if sha256_hex(data) != lin["sha256"]:
                raise FqError(f"{where}: bytes of linear {lin['name']} do not match the attested sha256 (payload "
                              "altered)")
            tensors = tensors_in_range(header, keys, lin["offset"], data)
            sl = Slice(**lin["slice"]) if lin["slice"] else None
            out[lin["name"]] = ({k.rpartition(".")[2]: t for k, t in tensors.items()}, sl, tuple(lin["shape"]))
    return out
