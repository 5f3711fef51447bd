"""Where the bytes of a load come from. A source's ``admit(plan, ranks)`` does all of its checking —
signatures, digests, dtypes, shapes — and returns the verified bytes each rank needs as ``Unit``s
(host memory), before the store allocates anything. A unit is what one device allocation holds: one
chain node's slices of one expert on one rank, one linear's slice on one rank, or one dense tensor.

- ``ProductSource(plan, key)``: a published product through its signed assembly (``fq combine``'s
  order of trust; base and stage fragments under ``ROOT``, routers from the base's skeleton shards).
  The attested digest unit is an expert's whole byte range, so a rank reads the whole ranges of the
  experts it owns (never another rank's experts) and cuts its slices in memory.
- ``ExportSource(dir, key)``: a TP export (``fq.tp.export``): each rank reads exactly the byte ranges
  of its own shards, each hashed against the export's attestations.
- ``TensorSource({name: tensor or [exl3 sets]})``: tensors already in memory (tests, engines that
  produced them); checks dtypes and shapes only.

A whole-model base's quantized non-expert linears (``fq.tp.linears``) are units too, one per linear and rank: from
the product, each linear fragment is read whole (its attested digest unit), checked against the plan and cut in
memory; from an export, a rank reads its ``linears-tpT`` shards' ranges, each slice and shape checked against its
plan and each range hashed against the shard's record.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.core.canonical import sha256_hex
from fq.core.safepath import open_regular, read_regular
from fq.errors import FqError
from fq.model.experts import ExpertLayout, derive_linear, expert_keys, suffixes
from fq.model.shards import RawTensor, read_header, read_range, tensors_in_range, torch_dtype
from fq.provenance.attest.fragment import check_header, range_mismatch, read_attestation
from fq.provenance.fragments import attestation_name, expert_structure, fragment_meta
from fq.provenance.complete import check_published_base
from fq.provenance.manifest import read_base_manifest
from fq.provenance.product import open_product
from fq.tp import records
from fq.tp.linears import linear_ranges, linear_specs, read_linear_fragment, read_linear_shard
from fq.tp.manifest import EXL3, HAD
from fq.tp.mesh import MeshPlan, Slice
from fq.tp.moe import MoeLayer, MoeSpec, router_name
from fq.tp.slicing import SUFFIX_ORDER, slice_dense, slice_exl3, sliced_shape

INDEX = "export.intoto.jsonl"
REPLICATED = "replicated.safetensors"


@dataclass(frozen=True)
class View:
    """One tensor inside a unit: the manifest entry it serves, its chain index (0 for dense weights)
    and EXL3 suffix (None for dense), dtype, shape and byte range within the unit."""

    entry: str
    part: int
    suffix: str | None
    dtype: str
    shape: tuple[int, ...]
    offset: int
    length: int


@dataclass(frozen=True)
class Unit:
    rank: int
    key: str  # what it is, for the journal and errors
    data: bytearray
    views: tuple[View, ...]


def pack(rank: int, key: str, items: list[tuple[str, int, str | None, RawTensor]]) -> Unit:
    """Lay tensors out back to back in the given order (fq's file order, so an export shard's expert
    range and the unit built from the unsliced fragment are the same bytes)."""
    data, views = bytearray(), []
    for entry, part, suffix, raw in items:
        views.append(View(entry, part, suffix, raw.dtype, tuple(raw.shape), len(data), len(raw.data)))
        data += raw.data
    return Unit(rank, key, data, tuple(views))


@dataclass
class Needs:
    """What the ranks being loaded need, from the plan alone (nothing read yet)."""

    experts: dict  # (layer, expert) -> rank -> proj -> (entry, slice)
    dense: dict  # source tensor name -> rank -> [(entry, slice)]
    linears: dict = field(default_factory=dict)  # a non-expert EXL3 weight's name -> rank -> (entry, slice)


def needs(plan: MeshPlan, ranks, layout: ExpertLayout) -> Needs:
    out = Needs({}, {})
    for r in ranks:
        for pl in plan.for_rank(r):
            if pl.alias:
                continue  # the store points it at the tie target's resident tensor
            e = plan.manifest.entry(pl.source)
            if e.dtype == EXL3 and e.expert is None:
                out.linears.setdefault(pl.source, {})[r] = (pl.entry, pl.slice)
                continue
            parsed = layout.parse(pl.source)
            if parsed is not None and parsed[3] == "weight":
                layer, expert, proj, _ = parsed
                slot = out.experts.setdefault((layer, expert), {}).setdefault(r, {})
                if proj in slot:
                    raise FqError(f"plan: rank {r} holds {layer}/{expert}/{proj} twice")
                slot[proj] = (pl.entry, pl.slice)
            else:
                out.dense.setdefault(pl.source, {}).setdefault(r, []).append((pl.entry, pl.slice))
    return out


def _expert_items(layout: ExpertLayout, layer: int, sets: dict, part: int, wanted: dict) -> list:
    """(entry, part, suffix, RawTensor) of one expert's wanted projections, sliced, in file order."""
    items = []
    for proj in layout.projections:
        if proj not in wanted:
            continue
        entry, sl = wanted[proj]
        cut = slice_exl3(sets[proj], sl, entry)
        for s in SUFFIX_ORDER:
            if s in cut:
                items.append((entry, part, s, RawTensor.of(entry, cut[s])))
    return items


def _dense_items(raw: RawTensor, wants: list) -> list[tuple[str, RawTensor]]:
    out = []
    for entry, sl in wants:
        if sl is None:
            out.append((entry, raw))  # byte-verbatim
        else:
            out.append((entry, RawTensor.of(entry, slice_dense(as_tensor(raw), sl, entry))))
    return out


def as_tensor(raw: RawTensor) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw.data), dtype=torch.uint8).view(torch_dtype(raw.dtype)).reshape(raw.shape)


# -- a published product ------------------------------------------------------------------------

class ProductSource:
    """A published product: ``ROOT/assemblies/PRODUCT.assembly.intoto.jsonl`` under a pinned key."""

    def __init__(self, plan_path: str | os.PathLike, public_key: Ed25519PublicKey, *, root=None, now=None,
                 state=None, min_version=None):
        self.plan_path, self.key = plan_path, public_key
        self._args = {"root": root, "now": now, "state": state, "min_version": min_version}
        self.product = open_product(plan_path, public_key, **self._args)  # the checks every consumer shares
        self.product.refuse_stage_linears("fq's TP export and store")
        self.assembly, self.root = self.product.plan, self.product.root
        self._check_complete()
        self.layout = ExpertLayout.from_json(self.predicate["layout"], f"{plan_path}: layout")
        self._spec = None

    @property
    def predicate(self) -> dict:
        return self.assembly.predicate

    def _check_complete(self) -> None:
        """The base as one model (``fq.provenance.complete``, what every consumer checks), from headers only."""
        check_published_base(self.predicate, self.root, self.key)

    def _reverify(self) -> None:
        """Admission starts from the signed plan again: a retry sees the files as they are now."""
        fresh = open_product(self.plan_path, self.key, **self._args).plan
        if fresh.sha256 != self.assembly.sha256:
            raise FqError(f"{self.plan_path}: the plan changed since this source was opened; open it again")

    def _fragment(self, f: dict, fh) -> tuple:
        """Attestation and header, as every consumer checks them (``fq.provenance.product``); returns (attestation,
        header, meta)."""
        where = f"{self.root}/{f['name']}"
        att = read_attestation(self.root, f["name"], self.key, self.predicate["campaign"], sha256=f["attestation_sha256"])
        self.product.check_fragment(att, f, where)
        header = read_header(fh, where)
        self.product.check_header(att, header, f, where)
        meta = fragment_meta(header)
        expert_structure(header, meta)
        return att, header, meta

    def spec(self) -> MoeSpec:
        """Geometry from the base fragments' headers and the routers' from the skeleton (no payload)."""
        if self._spec is None:
            base = self.predicate["chain"][0]["node"]
            layers: dict[int, dict] = {}
            for f in self.predicate["fragments"]:
                if f["node"] != base:
                    continue
                with open_regular(self.root, f["name"], f"{self.root}/{f['name']}") as fh:
                    _, header, meta = self._fragment(f, fh)
                    _, linears = expert_structure(header, meta)
                info = layers.setdefault(f["layer"], {"experts": [], "dims": None})
                for x in sorted({x for x, _ in linears}):
                    dims = tuple((linears[(x, p)].out_features, linears[(x, p)].in_features)
                                 for p in self.layout.projections)
                    if info["dims"] not in (None, dims):
                        raise FqError(f"{f['name']}: expert {x} is {dims} (out, in per projection), other experts "
                                      f"of layer {f['layer']} are {info['dims']}; TP planning needs one geometry "
                                      "per layer")
                    info["dims"] = dims
                    info["experts"].append(x)
            skeleton = self._skeleton()
            out = []
            for layer, info in sorted(layers.items()):
                rn = router_name(self.layout, layer)
                router = (rn, skeleton[rn]["dtype"], skeleton[rn]["shape"]) if rn in skeleton else None
                out.append(MoeLayer(layer, tuple(sorted(info["experts"])), info["dims"], router))
            heads, linears = linear_specs(self)
            self._spec = MoeSpec(self.layout, tuple(out), linears, heads)
        return self._spec

    def base_manifest(self):
        """(base directory, its base manifest), verified and checked to be the one the plan pins."""
        pred = self.predicate
        base_dir = self.root / pred["base"]["dir"]
        manifest = read_base_manifest(base_dir, self.key, pred["campaign"])
        if manifest.sha256 != pred["base"]["manifest"]["sha256"]:
            raise FqError(f"{base_dir}: base manifest sha256 {manifest.sha256[:16]}… is not the one the plan pins")
        return base_dir, manifest

    def _skeleton(self) -> dict:
        """Tensor name -> where it lives in the base's skeleton shards, everything checked against the
        base manifest the plan pins and each skeleton shard's attestation (headers only)."""
        pred = self.predicate
        base_rel = pred["base"]["dir"]
        base_dir, manifest = self.base_manifest()
        fragments = {f["name"][len(base_rel) + 1:] for f in pred["fragments"] if f["name"].startswith(base_rel + "/")}
        index = {}
        derived = {d["name"] for d in manifest.derived}  # gpt-oss's per-expert biases: the skeleton's fused ones serve
        for name, (digest, _) in sorted(manifest.files.items()):
            if not name.endswith(".safetensors") or name in fragments or name in derived:
                continue
            where = f"{base_dir}/{name}"
            att = read_attestation(base_dir, name, self.key, pred["campaign"])
            if att.predicate["kind"] != "skeleton":
                continue  # a base fragment of another product's plan: not a skeleton shard
            listed = manifest.files.get(attestation_name(name), (None,))[0]
            if att.attestation_sha256 != listed or att.sha256 != digest:
                raise FqError(f"{where}: shard or attestation is not the one the base manifest lists")
            with open_regular(base_dir, name, where) as fh:
                header = read_header(fh, where)
            check_header(att, header, where)
            for t in att.predicate["tensors"]:
                e = header.entry(t["name"])
                index[t["name"]] = {"shard": f"{base_rel}/{name}", "shard_sha256": digest,
                                    "attestation_sha256": att.attestation_sha256, "dtype": e.dtype,
                                    "shape": e.shape, "offset": t["offset"], "length": t["length"],
                                    "sha256": t["sha256"]}
        return index

    def read_dense(self, names) -> dict[str, tuple[RawTensor, dict]]:
        """Verified bytes of skeleton tensors: name -> (RawTensor, its skeleton entry)."""
        skeleton = self._skeleton()
        out = {}
        for name in names:
            if name not in skeleton:
                raise FqError(f"{self.plan_path}: the base skeleton has no tensor {name!r}")
            s = skeleton[name]
            directory, file = str(self.root), s["shard"]
            with open_regular(directory, file, f"{directory}/{file}") as fh:
                data = read_range(fh, s["offset"], s["length"], file)
            if sha256_hex(data) != s["sha256"]:
                raise FqError(f"{file}: bytes of tensor {name!r} do not match its attested sha256")
            out[name] = (RawTensor(name, s["dtype"], tuple(s["shape"]), data), s)
        return out

    def read_experts(self, wanted=None):
        """Yield (fragment, chain index, attestation, expert, {proj: tensor set}, range sha256) for the
        wanted (layer, expert) pairs (all when None), fragment by fragment in plan order; each expert's
        range is hashed against the plan before its tensors exist. Fragments without a wanted expert
        are never opened."""
        index = {n["node"]: i for i, n in enumerate(self.predicate["chain"])}
        for f in self.predicate["fragments"]:
            ranges = [e for e in f["experts"] if wanted is None or (f["layer"], e["expert"]) in wanted]
            if not ranges:
                continue
            where = f"{self.root}/{f['name']}"
            with open_regular(self.root, f["name"], where) as fh:
                att, header, meta = self._fragment(f, fh)
                for e in ranges:
                    x = e["expert"]
                    keys = expert_keys(self.layout, f["layer"], x, meta["codebook"])
                    if header.span(keys, f"expert {x}") != (e["offset"], e["length"]):
                        raise FqError(f"{where}: expert {x} is not at the byte range the plan names")
                    data = read_range(fh, e["offset"], e["length"], where)
                    digest = sha256_hex(data)
                    if digest != e["sha256"]:
                        raise range_mismatch(att, x, digest, where)
                    tensors = tensors_in_range(header, keys, e["offset"], data)
                    sets = {p: {s: tensors[self.layout.key(f["layer"], x, p, s)] for s in suffixes(meta["codebook"])}
                            for p in self.layout.projections}
                    yield f, index[f["node"]], att, x, sets, digest

    def admit(self, plan: MeshPlan, ranks) -> list[Unit]:
        self._reverify()
        need = needs(plan, ranks, self.layout)
        per_rank: dict[int, list[Unit]] = {r: [] for r in ranks}
        for name, (raw, _) in self.read_dense(sorted(need.dense)).items():
            for r, wants in sorted(need.dense[name].items()):
                for entry, cut in _dense_items(raw, wants):
                    per_rank[r].append(pack(r, f"rank {r} {entry}", [(entry, 0, None, cut)]))
        for f, part, _, x, sets, _ in self.read_experts(set(need.experts)):
            for r, wanted in sorted(need.experts[(f["layer"], x)].items()):
                items = _expert_items(self.layout, f["layer"], sets, part, wanted)
                per_rank[r].append(pack(r, f"rank {r} {f['node']} layer {f['layer']} expert {x}", items))
        if need.linears:
            self._admit_linears(need, per_rank)
        return [u for r in sorted(per_rank) for u in per_rank[r]]

    def _admit_linears(self, need: Needs, per_rank: dict) -> None:
        """Each linear fragment holding a needed linear, read whole and checked against the plan
        (``read_linear_fragment``), then cut per rank in memory: one unit per linear and rank."""
        holders = {lin.fragment for lin in self.spec().linears if f"{lin.name}.weight" in need.linears}
        for f in self.predicate["linears"]:
            if f["name"] not in holders:
                continue
            _, sets, _ = read_linear_fragment(self, f)
            for prefix in sorted(sets):
                for r, (entry, sl) in sorted(need.linears.get(f"{prefix}.weight", {}).items()):
                    cut = slice_exl3(sets[prefix], sl, f"{self.root}/{f['name']}: {prefix}")
                    items = [(entry, 0, s, RawTensor.of(entry, cut[s])) for s in SUFFIX_ORDER if s in cut]
                    per_rank[r].append(pack(r, f"rank {r} {f['node']} {prefix}", items))


# -- a TP export ---------------------------------------------------------------------------------

class ExportSource:
    """A directory written by ``fq tp-export``, under the exporter's pinned key.

    With ``product`` (a ``ProductSource``: the signed plan under the campaign key) the export is also bound
    to it: the index must name that plan's digest, and every rank shard's source fragment and unsliced
    expert digests must be the plan's — checked from the plan alone, no unsliced payload is read."""

    def __init__(self, directory: str | os.PathLike, public_key: Ed25519PublicKey,
                 product: "ProductSource | None" = None):
        self.dir, self.key, self.product = Path(directory), public_key, product
        self._opened: dict[str, tuple] = {}  # attestation sha256 -> (subjects, predicate): same bytes, same verdict
        self.index, self.index_sha256 = self._read_index()
        self.layout = ExpertLayout.from_json(self.index["spec"].get("layout"), f"{self.dir}/{INDEX}: spec.layout")

    def _read_index(self) -> tuple[dict, str]:
        where = f"{self.dir}/{INDEX}"
        data = read_regular(self.dir, INDEX, where)
        digest = sha256_hex(data)
        if digest not in self._opened:
            self._opened[digest] = records.open_record(data, self.key, where, records.EXPORT)
        subjects, pred = self._opened[digest]
        if subjects != [(f["name"], f["sha256"]) for f in pred["files"]]:
            raise FqError(f"{where}: subjects differ from the files the index lists")
        if self.product is not None and pred["plan_sha256"] != self.product.assembly.sha256:
            raise FqError(f"{where}: cut from plan {pred['plan_sha256'][:16]}…, not the pinned product plan "
                          f"{self.product.assembly.sha256[:16]}… ({self.product.plan_path})")
        return pred, digest

    def spec(self) -> MoeSpec:
        return MoeSpec.from_json(self.index["spec"], f"{self.dir}/{INDEX}: spec")

    def _shard(self, f: dict) -> dict:
        """The attestation of one listed shard: the digest the index names, signature, then every field
        that must agree with the index."""
        where = f"{self.dir}/{attestation_name(f['name'])}"
        data = read_regular(self.dir, attestation_name(f["name"]), where)
        digest = sha256_hex(data)
        if digest != f["attestation_sha256"]:
            raise FqError(f"{where}: not the attestation the export index names (digest differs)")
        if digest not in self._opened:  # bytes already verified under this key need no second signature check
            self._opened[digest] = records.open_record(data, self.key, where, records.SHARD)
        subjects, p = self._opened[digest]
        if subjects != [(f["name"].rsplit("/", 1)[-1], f["sha256"])]:
            raise FqError(f"{where}: attests another file than {f['name']} with the index's sha256")
        ix = self.index
        for k in ("product", "plan_sha256", "campaign"):
            if p[k] != ix[k]:
                raise FqError(f"{where}: {k} differs from the export index's")
        if p["kind"] != f["kind"]:
            raise FqError(f"{where}: a {p['kind']} shard, the index says {f['kind']}")
        if p["kind"] in ("expert", "linear") and (p["mesh"] != ix["mesh"] or p["coords"] != f["coords"] or
                                                  p["node"] != f["node"] or p["layer"] != f["layer"]):
            raise FqError(f"{where}: mesh, coordinates, node or layer differ from the export index's")
        if self.product is not None and p["kind"] == "expert":
            _bound_to_plan(p, self.product.predicate, where)
        if self.product is not None and p["kind"] == "linear":
            plan = {f["name"]: f for f in self.product.predicate.get("linears", ())}
            src = plan.get(p["source"]["name"])
            if src is None or (src["sha256"], src["attestation_sha256"]) != (p["source"]["sha256"],
                                                                             p["source"]["attestation_sha256"]):
                raise FqError(f"{where}: cut from {p['source']['name']} ({p['source']['sha256'][:16]}…), not a linear "
                              "fragment of the pinned product plan")
        return p

    def linear_sets(self, tp: int) -> dict[str, tuple[dict, Slice | None, tuple[int, int]]]:
        """A whole-model base's quantized linears for tp rank ``tp`` (``fq.tp.linears.read_linear_shard`` of each
        of its shards, after the shard's attestation is checked against the index)."""
        out: dict = {}
        for f in self.index["files"]:
            if f["kind"] == "linear" and f["coords"] == {"tp": tp}:
                for name, got in read_linear_shard(self.dir, f["name"], self._shard(f)).items():
                    if name in out:
                        raise FqError(f"{self.dir}/{f['name']}: linear {name} is in two shards of tp rank {tp}")
                    out[name] = got
        return out

    def admit(self, plan: MeshPlan, ranks) -> list[Unit]:
        if self.product is not None:
            self.product._reverify()
        self.index, self.index_sha256 = self._read_index()  # admission starts from the signed index again
        ix = self.index
        if plan.manifest.sha256 != ix["manifest_sha256"]:
            raise FqError(f"{self.dir}: cut for manifest {ix['manifest_sha256'][:16]}…, the plan's is "
                          f"{plan.manifest.sha256[:16]}…; plan moe_manifest(source.spec(), assign="
                          f"{ix['assign']!r}, tp={ix['mesh']['tp']}) instead")
        if (plan.mesh.tp, plan.mesh.ep) != (ix["mesh"]["tp"], ix["mesh"]["ep"]):
            raise FqError(f"{self.dir}: cut for tp={ix['mesh']['tp']} ep={ix['mesh']['ep']}, the plan is for "
                          f"tp={plan.mesh.tp} ep={plan.mesh.ep}; export again with those sizes")
        need = needs(plan, ranks, self.layout)
        chain = {n["node"]: i for i, n in enumerate(ix["chain"])}
        per_rank: dict[int, list[Unit]] = {r: [] for r in ranks}
        if need.dense:
            per_rank = self._admit_dense(need, per_rank)
        for r in sorted(ranks):
            co = plan.mesh.coords(r)
            coords = {"ep": co["ep"], "tp": co["tp"]}
            layers = set(plan.stage_of_rank(r).layers)
            for f in ix["files"]:
                if f["kind"] != "expert" or f["coords"] != coords or f["layer"] not in layers:
                    continue
                p = self._shard(f)
                wanted = {e["expert"]: e for e in p["experts"] if r in need.experts.get((p["layer"], e["expert"]), {})}
                if wanted:
                    per_rank[r] += self._read_shard(f, p, r, wanted, need, chain[p["node"]])
            for f in ix["files"]:
                if f["kind"] != "linear" or f["coords"] != {"tp": co["tp"]} or \
                        (f["layer"] is not None and f["layer"] not in layers):
                    continue
                p = self._shard(f)
                wanted = {lin["name"]: lin for lin in p["linears"]
                          if r in need.linears.get(f"{lin['name']}.weight", {})}
                if wanted:
                    per_rank[r] += self._read_linears(plan, f, p, r, wanted, need)
        return [u for r in sorted(per_rank) for u in per_rank[r]]

    def _read_linears(self, plan: MeshPlan, f: dict, p: dict, rank: int, wanted: dict, need: Needs) -> list[Unit]:
        """One unit per wanted linear of a linear rank shard: its record's slice and shape, and its tensors'
        geometry, checked against the rank's plan before its range is read and hashed. A linear is the base's own
        (chain part 0): products whose stages correct linears are refused on opening."""
        where = f"{self.dir}/{f['name']}"
        units = []
        with open_regular(self.dir, f["name"], where) as fh:
            header = records.attested_header(fh, p, where)
            for name, lin in sorted(wanted.items()):
                entry, sl = need.linears[f"{name}.weight"][rank]
                e = plan.manifest.entry(entry)
                if lin["slice"] != (sl.to_json() if sl else None):
                    raise FqError(f"{where}: linear {name} slice {lin['slice']}, rank {rank}'s plan needs "
                                  f"{sl.to_json() if sl else None} ({'whole' if sl is None else sl.describe()})")
                if tuple(-(-d // HAD) * HAD for d in lin["shape"]) != e.shape:
                    raise FqError(f"{where}: linear {name} shape {lin['shape']} (padded to {HAD}s), the plan declares "
                                  f"{list(e.shape)}")
                keys = [x.name for x in header.entries if x.name.rpartition(".")[0] == name]
                if not keys:
                    raise FqError(f"{where}: linear {name}, which its record lists, has no tensors in the shard")
                specs = {k.rpartition(".")[2]: (header.entry(k).dtype, header.entry(k).shape) for k in keys}
                got = derive_linear(specs, f"{where}: linear {name}")
                if (got.out_features, got.in_features) != sliced_shape(e.shape, sl):
                    raise FqError(f"{where}: linear {name} tensors are (out, in) = ({got.out_features}, "
                                  f"{got.in_features}), rank {rank}'s plan needs {sliced_shape(e.shape, sl)}")
            for lin, keys, data in linear_ranges(fh, header, p, where, set(wanted)):
                entry = need.linears[f"{lin['name']}.weight"][rank][0]
                views = tuple(View(entry, 0, k.rpartition(".")[2], header.entry(k).dtype, header.entry(k).shape,
                                   header.entry(k).start - lin["offset"], header.entry(k).length) for k in keys)
                units.append(Unit(rank, f"rank {rank} {p['node']} {lin['name']}", bytearray(data), views))
        return units

    def _read_shard(self, f: dict, p: dict, rank: int, wanted: dict, need: Needs, part: int) -> list[Unit]:
        where = f"{self.dir}/{f['name']}"
        units = []
        with open_regular(self.dir, f["name"], where) as fh:
            header = records.attested_header(fh, p, where)
            for x, e in sorted(wanted.items()):
                projs = need.experts[(p["layer"], x)][rank]
                for proj, (entry, sl) in projs.items():
                    if e["slices"].get(proj) != (sl.to_json() if sl else None):
                        raise FqError(f"{where}: expert {x} {proj} holds {e['slices'].get(proj)}, rank {rank}'s plan "
                                      f"needs {sl.to_json() if sl else 'the whole tensor'}")
                keys = expert_keys(self.layout, p["layer"], x, p["codebook"])
                if header.span(keys, f"expert {x}") != (e["offset"], e["length"]):
                    raise FqError(f"{where}: expert {x} is not at its attested byte range")
                data = read_range(fh, e["offset"], e["length"], where)
                if sha256_hex(data) != e["sha256"]:
                    raise FqError(f"{where}: bytes of expert {x} do not match the attested sha256 (payload altered)")
                views = []
                for proj in self.layout.projections:
                    if proj not in projs:
                        continue
                    for s in suffixes(p["codebook"]):
                        ent = header.entry(self.layout.key(p["layer"], x, proj, s))
                        views.append(View(projs[proj][0], part, s, ent.dtype, ent.shape, ent.start - e["offset"],
                                          ent.length))
                units.append(Unit(rank, f"rank {rank} {p['node']} layer {p['layer']} expert {x}", bytearray(data),
                                  tuple(views)))
        return units

    def _admit_dense(self, need: Needs, per_rank: dict) -> dict:
        f = next((f for f in self.index["files"] if f["kind"] == "replicated"), None)
        if f is None:
            raise FqError(f"{self.dir}: the plan needs {sorted(need.dense)}, the export has no {REPLICATED}")
        p = self._shard(f)
        tensors = {t["name"]: t for t in p["tensors"]}
        where = f"{self.dir}/{f['name']}"
        with open_regular(self.dir, f["name"], where) as fh:
            header = read_header(fh, where)
            if header.sha256 != p["shard"]["header_sha256"]:
                raise FqError(f"{where}: header differs from the attested one")
            for name in sorted(need.dense):
                if name not in tensors:
                    raise FqError(f"{where}: has no tensor {name!r}, which the plan places")
                t, ent = tensors[name], header.entry(name)
                if (ent.start, ent.length) != (t["offset"], t["length"]):
                    raise FqError(f"{where}: tensor {name!r} is not at its attested byte range")
                data = read_range(fh, t["offset"], t["length"], where)
                if sha256_hex(data) != t["sha256"]:
                    raise FqError(f"{where}: bytes of tensor {name!r} do not match the attested sha256")
                raw = RawTensor(name, ent.dtype, ent.shape, data)
                for r, wants in sorted(need.dense[name].items()):
                    for entry, cut in _dense_items(raw, wants):
                        per_rank[r].append(pack(r, f"rank {r} {entry}", [(entry, 0, None, cut)]))
        return per_rank


def _bound_to_plan(p: dict, plan: dict, where: str) -> None:
    """A rank shard's claims about its source against the signed product plan."""
    f = next((f for f in plan["fragments"] if f["name"] == p["source"]["name"]), None)
    if f is None or (f["sha256"], f["attestation_sha256"]) != (p["source"]["sha256"], p["source"]["attestation_sha256"]):
        raise FqError(f"{where}: names source fragment {p['source']['name']} with digests the pinned plan does not")
    unsliced = {e["expert"]: e["sha256"] for e in f["experts"]}
    for e in p["experts"]:
        if unsliced.get(e["expert"]) != e["source_sha256"]:
            raise FqError(f"{where}: expert {e['expert']} names an unsliced digest the pinned plan does not")


# -- tensors in memory -----------------------------------------------------------------------------

class TensorSource:
    """``{name: dense tensor}`` or ``{name: [exl3 set, ...]}`` (chain order) keyed by manifest entry name."""

    def __init__(self, tensors: dict):
        self.tensors = tensors

    def admit(self, plan: MeshPlan, ranks) -> list[Unit]:
        units = []
        for r in sorted(ranks):
            for pl in plan.for_rank(r):
                if pl.alias:
                    continue
                if pl.source not in self.tensors:
                    raise FqError(f"tensor source: no tensor for entry {pl.source!r}")
                t = self.tensors[pl.source]
                if plan.manifest.entry(pl.source).dtype == EXL3:
                    items = []
                    for part, tset in enumerate(t):
                        cut = slice_exl3(tset, pl.slice, pl.entry)
                        items += [(pl.entry, part, s, RawTensor.of(pl.entry, cut[s])) for s in
                                  ("trellis", "suh", "svh", "mul1", "mcg") if s in cut]
                else:
                    items = [(pl.entry, 0, None, RawTensor.of(pl.entry, slice_dense(t, pl.slice, pl.entry)))]
                units.append(pack(r, f"rank {r} {pl.entry}", items))
        return units
