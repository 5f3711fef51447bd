"""``fq tp-export``: cut a published product into per-rank shards by whole 128-aligned tiles.

Input: a published product, i.e. its signed assembly ``ROOT/assemblies/PRODUCT.assembly.intoto.jsonl``
verified under the campaign's pinned key exactly as ``fq combine`` verifies it (``fq.provenance.product.open_product``:
file name, version state, the publication statement beside ROOT) (every fragment's
attestation, header and expert byte ranges are checked before their tensors are used). The product's
routers come from the base's skeleton shards, checked against the base manifest the plan pins.

Output (written under a temporary name and renamed into place: a reader never sees half an export)::

    OUT/export.intoto.jsonl                       index (fq-tp-export/1): every shard, the plan digest,
                                                  the MoE spec, the manifest digest, tp and ep
    OUT/replicated.safetensors (+ .intoto.jsonl)  routers, byte-verbatim from the skeleton
    OUT/rank-epG-tpT/NODE-layerLLL-blockBBB.safetensors (+ .intoto.jsonl)
                                                  the experts of that fragment owned by ep rank G, cut for
                                                  tp rank T; same keys and per-expert layout as the fragment
    OUT/linears-tpT/NODE-layerLLL.safetensors (+ .intoto.jsonl)
                                                  a whole-model base's linear fragment cut for tp rank T
                                                  (fq.tp.linears), read by that tp rank of every ep group

Each rank shard's attestation (fq-tp-shard/1) names the unsliced fragment (name, sha256,
attestation digest) and, per expert, its range here, that range's sha256, the unsliced range's sha256
and the slice of each projection. Nothing is re-quantized: the trellis words, ``suh`` and ``svh`` are
the fragment's own bytes, cut along tile rows/columns (``fq.tp.slicing``). The same inputs and key
give byte-identical exports (Ed25519 is deterministic; no timestamps).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic, kbits
from fq.core.canonical import sha256_hex
from fq.errors import FqError
from fq.model.experts import expert_keys
from fq.model.shards import RawTensor, write_shard
from fq.provenance.fragments import attestation_name
from fq.tp import records
from fq.tp.linears import write_linears
from fq.tp.mesh import DeviceMesh, MeshPlan, plan
from fq.tp.moe import moe_manifest
from fq.tp.slicing import SUFFIX_ORDER, slice_exl3
from fq.tp.sources import INDEX, REPLICATED, ProductSource, needs

def rank_dir(ep: int, tp: int) -> str:
    return f"rank-ep{ep}-tp{tp}"


@dataclass(frozen=True)
class Exported:
    path: Path
    index_sha256: str
    files: int
    plan: MeshPlan  # the tp x ep plan (pp=1, epoch 0) the export was cut for
    assembly: object  # the verified product plan (fq.provenance.assembly.SignedPlan)
    bytes_per_rank: dict  # (ep, tp) -> bytes of its shards
    product: object = None  # the opened product (fq.provenance.product.VerifiedProduct): what a state file records


def tp_export(plan_path: str | os.PathLike, public_key: Ed25519PublicKey, out: str | os.PathLike, *, tp: int,
              ep: int = 1, assign: str = "contiguous", sign_key: Ed25519PrivateKey, root=None, now=None, state=None,
              min_version=None) -> Exported:
    if sign_key is None:
        raise FqError("tp-export: a signing key is required (loaders pin the exporter's public key)")
    src = ProductSource(plan_path, public_key, root=root, now=now, state=state, min_version=min_version)
    spec = src.spec()
    manifest = moe_manifest(spec, assign, tp)  # with a whole-model base's linears, as write_linears cuts them
    cut = plan(manifest, DeviceMesh(tp=tp, ep=ep))  # refuses non-128-aligned sizes, saying which work
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise FqError(f"--out {out}: exists; an export is written once (remove it or choose another path)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{out.name}.", dir=out.parent))
    try:
        files = _write(src, spec, manifest, cut, tmp, sign_key)
        pred = src.predicate
        index = {"format": records.EXPORT_FORMAT, "product": pred["product"], "version": pred["version"],
                 "plan_sha256": src.assembly.sha256, "campaign": pred["campaign"],
                 "base_manifest_sha256": pred["base"]["manifest"]["sha256"],
                 "chain": [{"node": n["node"], "K": n["K"], "codebook": n["codebook"]} for n in pred["chain"]],
                 "spec": spec.to_json(), "assign": assign, "mesh": {"tp": tp, "ep": ep},
                 "manifest_sha256": manifest.sha256, "files": files}
        line = records.sign([(f["name"], f["sha256"]) for f in files], records.EXPORT, index, sign_key)
        atomic.write_bytes(tmp / INDEX, line)
        os.chmod(tmp, 0o777 & ~_umask())
        os.rename(tmp, out)
        atomic.fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    per_rank: dict = {}
    for f in files:
        if f["coords"] is not None:  # a linear shard of tp rank t serves that rank of every ep group
            size = (out / f["name"]).stat().st_size
            for key in ([(f["coords"]["ep"], f["coords"]["tp"])] if "ep" in f["coords"] else
                        [(g, f["coords"]["tp"]) for g in range(ep)]):
                per_rank[key] = per_rank.get(key, 0) + size
    return Exported(out, sha256_hex(line), len(files), cut, src.assembly, per_rank, src.product)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write(src: ProductSource, spec, manifest, cut: MeshPlan, tmp: Path, key) -> list[dict]:
    pred = src.predicate
    layout = src.layout
    common = shard_common(src)
    need = needs(cut, range(cut.mesh.size), layout)
    files = []
    if need.dense:
        dense = src.read_dense(sorted(need.dense))
        raws = [raw for _, (raw, _) in sorted(dense.items())]
        write_shard(tmp / REPLICATED, raws, {"format": records.SHARD_FORMAT, "kind": "replicated"})
        sha, size, hsha, spans = records.written(tmp / REPLICATED, [[r.name] for r in raws])
        tensors = [{"name": raw.name, "offset": o, "length": n, "sha256": d,
                    "source": {"name": s["shard"], "sha256": s["shard_sha256"],
                               "attestation_sha256": s["attestation_sha256"]}}
                   for (raw, s), (o, n, d) in zip([dense[r.name] for r in raws], spans)]
        for t, (raw, s) in zip(tensors, [dense[r.name] for r in raws]):
            if t["sha256"] != s["sha256"]:
                raise FqError(f"{REPLICATED}: {raw.name} changed while being copied")
        predicate = {**common, "kind": "replicated", "shard": {"size": size, "header_sha256": hsha},
                     "tensors": tensors}
        files.append(attest_shard(tmp, REPLICATED, sha, predicate, key, "replicated", None, None, None))

    pending: dict = {}  # (ep, tp) -> [(expert, raws, keys, source sha, slices)] of the current fragment
    current = None

    def flush():
        if current is None:
            return
        f, part, att = current
        for (g, t), experts in sorted(pending.items()):
            name = f"{rank_dir(g, t)}/{f['name'].rsplit('/', 1)[-1]}"
            p = att.predicate
            meta = {"format": records.SHARD_FORMAT, "kind": "expert", "product": pred["product"], "node": p["node"],
                    "layer": str(p["layer"]), "block": str(p["block"]),
                    "K": kbits.to_meta(kbits.fragment(p["K"])), "codebook": p["codebook"],
                    "layout": json.dumps(layout.to_json(), separators=(",", ":")), "tp": str(cut.mesh.tp),
                    "ep": str(cut.mesh.ep), "coords": json.dumps({"ep": g, "tp": t}, separators=(",", ":"))}
            write_shard(tmp / name, [r for _, raws, _, _, _ in experts for r in raws], meta)
            sha, size, hsha, spans = records.written(tmp / name, [keys for _, _, keys, _, _ in experts])
            predicate = {**common, "kind": "expert", "mesh": {"tp": cut.mesh.tp, "ep": cut.mesh.ep},
                         "coords": {"ep": g, "tp": t}, "node": p["node"], "chain_index": part, "layer": p["layer"],
                         "block": p["block"], "K": p["K"], "codebook": p["codebook"], "layout": layout.to_json(),
                         "source": {"name": f["name"], "sha256": f["sha256"],
                                    "attestation_sha256": f["attestation_sha256"]},
                         "shard": {"size": size, "header_sha256": hsha},
                         "experts": [{"expert": x, "offset": o, "length": n, "sha256": d, "source_sha256": ssha,
                                      "slices": slices}
                                     for (x, _, _, ssha, slices), (o, n, d) in zip(experts, spans)]}
            files.append(attest_shard(tmp, name, sha, predicate, key, "expert", {"ep": g, "tp": t}, p["node"], p["layer"]))
        pending.clear()

    for f, part, att, x, sets, range_sha in src.read_experts(None):
        if current is None or current[0] is not f:
            flush()
            current = (f, part, att)
        for r, wanted in sorted(need.experts[(f["layer"], x)].items()):
            co = cut.mesh.coords(r)
            raws, slices = [], {}
            for proj in layout.projections:
                entry, sl = wanted[proj]
                piece = slice_exl3(sets[proj], sl, entry)
                slices[proj] = sl.to_json() if sl else None
                raws += [RawTensor.of(layout.key(f["layer"], x, proj, s), piece[s]) for s in SUFFIX_ORDER if s in piece]
            keys = expert_keys(layout, f["layer"], x, att.predicate["codebook"])
            pending.setdefault((co["ep"], co["tp"]), []).append((x, raws, keys, range_sha, slices))
    flush()
    files += write_linears(src, tmp, {"tp": cut.mesh.tp, "ep": cut.mesh.ep}, common, key, attest_shard)
    return files


def shard_common(src: ProductSource) -> dict:
    """The fields every rank shard's record of an export of ``src`` shares."""
    pred = src.predicate
    return {"format": records.SHARD_FORMAT, "product": pred["product"], "plan_sha256": src.assembly.sha256,
            "campaign": pred["campaign"]}


def attest_shard(tmp: Path, name: str, sha: str, predicate: dict, key, kind: str, coords, node, layer) -> dict:
    line = records.sign([(name.rsplit("/", 1)[-1], sha)], records.SHARD, predicate, key)
    atomic.write_bytes(tmp / attestation_name(name), line)
    return {"name": name, "sha256": sha, "attestation_sha256": sha256_hex(line), "kind": kind, "coords": coords,
            "node": node, "layer": layer}

