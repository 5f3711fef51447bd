"""``fq combine``: one verified adapter for one product and a chosen set of experts.

Order of trust (nothing is read before what vouches for it has been verified):

1. the plan (``fq.provenance.product.open_product``, the checks every consumer shares): signature under the pinned key,
   schema, chain, edges, expiry, its file name (the product asked for), version state, and the
   publication statement beside ROOT when present (the plan must be the one it lists);
2. narrowing: from the signed plan alone, the fragments and byte ranges holding the chosen experts —
   fragments without chosen experts are never opened;
3. per fragment used: its attestation (digest named by the plan, signature, same campaign identity,
   same node/layer/block/parent/ranges as the plan, node_digest equal to its chain entry's digest),
   then its safetensors header (digest attested, exact key set, geometry), then only the chosen
   experts' byte ranges, each hashed against the plan;
4. runtime constants (K, codebook) re-derived from the tensors (shapes, marker values), never copied, each linear's
   K its chain node's at that layer for its projection (``fq.core.kbits``);
   per (layer, expert, projection) every chain node has the same (in, out);
5. with ``base_dir`` (the checkpoint that will be loaded): its manifest digest must be the one the plan
   pins, and all of it is verified against that manifest (``fq.provenance.manifest.verify_base``: every file
   listed and re-hashed in one streamed pass, attested shards checked against their attestations, no
   strays); the base fragments' chosen ranges must be the plan's.
Every scale copied into the adapter is finite (``fq.provenance.scales.check_scale``).

Output: ``out`` (see ``fq.provenance.adapter``) and ``out.intoto.jsonl``: an in-toto Statement (predicate
``fq-adapter/1``) in a DSSE envelope, signed when ``sign_key`` is given, else with no signatures
(a record of exactly which plan and bytes it was built from).

    combine(plan_path, public_key, out, experts="all", base_dir=None, root=None, now=None,
            state=None, min_version=None, sign_key=None, base_option=None) -> Combined

Shared with ``fq.runtime`` (which loads a product into a model instead of writing an adapter), so that a
consumer that runs a product checks exactly what ``fq combine`` checks:

    narrow(plan, selection) -> (work, chosen)                       # step 2
    verify_fragments(product, key, work, chosen, base_dir=None) -> Verified   # steps 3-5, tensors in memory
    verify_adapter(path, product, geometry) -> Verified             # an adapter against its signed plan
"""
from __future__ import annotations

import datetime as dt
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic, kbits
from fq.core.canonical import loads, sha256_hex
from fq.core.safepath import open_regular, split_path
from fq.errors import FqError
from fq.model.experts import ExpertLayout, derive_linear, expert_keys, suffixes
from fq.model.shards import RawTensor, read_header, read_range
from fq.provenance.adapter import FORMAT as ADAPTER_FORMAT, _adapter_re, adapter_key, write_adapter
from fq.provenance.assembly import PlanState
from fq.provenance.attest import dsse
from fq.provenance.attest.fragment import range_mismatch, read_attestation
from fq.provenance.attest.statement import ADAPTER, statement
from fq.provenance.fragments import expert_structure, fragment_meta
from fq.provenance.complete import BaseShard, check_base, check_published_base
from fq.provenance.manifest import VerifiedBase, read_verified, verify_base
from fq.provenance.product import VerifiedProduct, open_product
from fq.provenance.scales import SCALE_SUFFIXES, check_scale
from fq.provenance.selection import ExpertSelection, parse_selection


@dataclass
class Combined:
    path: Path
    sha256: str
    attestation: Path
    experts: list[tuple[int, int]]
    stages: list[dict]
    fragments_opened: list[str] = field(default_factory=list)
    payload_bytes_read: int = 0


def narrow(plan: dict, sel: ExpertSelection) -> tuple[list[tuple[dict, list[dict]]], list[tuple[int, int]]]:
    """(fragment, chosen expert ranges) for every fragment holding a chosen expert; from the plan alone."""
    base = plan["chain"][0]["node"]
    in_base: dict[int, set[int]] = {}
    for f in plan["fragments"]:
        if f["node"] == base:
            in_base.setdefault(f["layer"], set()).update(e["expert"] for e in f["experts"])
    every, per_layer = sel.named()
    for layer, experts in sorted(per_layer.items()):
        if layer not in in_base:
            raise FqError(f"--experts: layer {layer} is not in product {plan['product']} (layers {sorted(in_base)})")
        missing = sorted(experts - in_base[layer])
        if missing:
            raise FqError(f"--experts: experts {missing} of layer {layer} are not in product {plan['product']}")
    if every is not None:
        for layer, have in sorted(in_base.items()):
            if every - have:
                raise FqError(f"--experts: experts {sorted(every - have)} are not in layer {layer} of {plan['product']}")
    chosen = sorted((layer, e) for layer, ex in in_base.items() for e in ex if sel.chosen(layer, e))
    keep = set(chosen)
    work = []
    for f in plan["fragments"]:
        rs = [e for e in f["experts"] if (f["layer"], e["expert"]) in keep]
        if rs:
            work.append((f, rs))
    return work, chosen


@dataclass
class Verified:
    """What the checks below verified, in memory: per (layer, expert, chain index, projection, suffix) the stage
    tensors of the chosen experts (``RawTensor`` named by ``fq.provenance.adapter.adapter_key``; bytes read once and
    hashed against the plan), each linear's (in, out) along its chain, and with a base directory the verified base."""
    layout: ExpertLayout
    work: list
    chosen: list[tuple[int, int]]
    residual: dict = field(default_factory=dict)
    geometry: dict = field(default_factory=dict)
    base: VerifiedBase | None = None
    fragments_opened: list[str] = field(default_factory=list)
    payload_bytes_read: int = 0


def verify_fragments(product: VerifiedProduct, public_key: Ed25519PublicKey, work: list[tuple[dict, list[dict]]],
                     chosen: list[tuple[int, int]], *, base_dir: str | os.PathLike | None = None,
                     base_option: str | None = None) -> Verified:
    """Steps 3-5 of the module docstring for the fragments ``work`` names (``narrow``), in the plan's order: what
    ``fq combine`` writes into an adapter, and what ``fq.runtime`` loads. With ``base_dir``, the base checkpoint
    is verified whole first and the base fragments' chosen ranges are checked against the plan; without it, the
    base's payload is not read (its geometry still comes from the attested header). ``base_option``: the
    command-line option that named ``base_dir`` (``--base``), which its errors then start with; None (the Python
    API, the runtime's own base directory): they name the directory only."""
    plan, root = product.predicate, product.root
    layout = ExpertLayout.from_json(plan["layout"], f"{product.plan.path}: layout")
    chain = plan["chain"]
    index = {n["node"]: i for i, n in enumerate(chain)}
    base_rel = plan["base"]["dir"] + "/"
    result = Verified(layout, work, chosen)
    if base_dir is not None:
        base = verify_base(base_dir, public_key, plan["campaign"], sha256=plan["base"]["manifest"]["sha256"],
                           option=base_option)
        result.base, manifest = base, base.manifest
        check_complete(product, base, Path(base_dir), public_key, base_option)
    elif (root / plan["base"]["dir"]).is_dir():  # the base in the plan's tree: checked as a model from its headers
        check_published_base(plan, root, public_key)
    geometry, residual = result.geometry, result.residual
    canonical = dict(zip(layout.projections, kbits.PROJECTIONS))
    for f, ranges in work:
        i = index[f["node"]]
        node = chain[i]
        src_root, src_name = root, f["name"]
        if i == 0 and base_dir is not None:
            src_root, src_name = Path(base_dir), f["name"][len(base_rel):]
            if manifest.files.get(src_name, (None,))[0] != f["sha256"]:
                raise FqError(f"{base_option + ' ' if base_option else ''}{base_dir}: {src_name} is not listed in "
                              "its manifest with the plan's sha256")
        where = f"{src_root}/{src_name}"
        att = read_attestation(src_root, src_name, public_key, plan["campaign"], sha256=f["attestation_sha256"])
        product.check_fragment(att, f, where)
        result.fragments_opened.append(where)
        with open_regular(src_root, src_name, where, size=f["size"], listed_by="the plan") as fh:
            header = read_header(fh, where)
            product.check_header(att, header, f, where)
            meta = fragment_meta(header)
            _, linears = expert_structure(header, meta)
            for e in ranges:
                ex = e["expert"]
                keys = expert_keys(layout, f["layer"], ex, meta["codebook"])
                if header.span(keys, f"expert {ex}") != (e["offset"], e["length"]):
                    raise FqError(f"{where}: expert {ex} is not at the byte range the plan names")
                for proj in layout.projections:
                    lin = linears[(ex, proj)]
                    g = geometry.setdefault((f["layer"], ex, proj), (lin.in_features, lin.out_features))
                    if g != (lin.in_features, lin.out_features):
                        raise FqError(f"{where}: expert {ex} {proj} is {lin.in_features}x{lin.out_features}, "
                                      f"its parent chain has {g[0]}x{g[1]}")
                if i == 0 and base_dir is None:
                    continue  # the base's payload is the consumer's own; only --base compares it
                if i == 0:  # --base: verify_base read the file once, whole; its digest of this range
                    got = next(r.sha256 for r in base.shards[src_name].info.experts if r.expert == ex)
                    result.payload_bytes_read += e["length"]
                    if got != e["sha256"]:
                        raise range_mismatch(att, ex, got, where)
                    continue
                data = read_range(fh, e["offset"], e["length"], where)
                result.payload_bytes_read += len(data)
                if sha256_hex(data) != e["sha256"]:
                    raise range_mismatch(att, ex, sha256_hex(data), where)
                for proj in layout.projections:
                    raws = {}
                    for s in suffixes(meta["codebook"]):
                        ent = header.entry(layout.key(f["layer"], ex, proj, s))
                        lo = ent.start - e["offset"]
                        raws[s] = RawTensor(adapter_key(layout, f["layer"], ex, proj, i, s), ent.dtype, ent.shape,
                                            data[lo: lo + ent.length])
                    check_stage_linear(raws, node, f["layer"], canonical[proj], f"{where}: expert {ex} {proj}")
                    for s, r in raws.items():
                        residual[(f["layer"], ex, i, proj, s)] = r
    return result


def check_stage_linear(raws: dict[str, RawTensor], node: dict, layer: int, projection: str, where: str) -> None:
    """One stage linear's tensors: K and codebook re-derived from them (shapes, marker value) must be the chain
    node's (its K at ``layer`` for the canonical ``projection``: gate, up or down), and every scale finite."""
    K = kbits.proj(kbits.node_at(node["K"], layer, f"{where}: chain node {node['node']} K"), projection)
    m = raws.get(node["codebook"])
    value = int.from_bytes(m.data, "little", signed=True) if m is not None else None
    lin = derive_linear({s: (r.dtype, r.shape) for s, r in raws.items()}, where, value)
    if (lin.K, lin.codebook) != (K, node["codebook"]):
        raise FqError(f"{where} tensors are K={lin.K} {lin.codebook}, the plan says K={K} {node['codebook']}")
    for s in SCALE_SUFFIXES:
        check_scale(raws[s].data, f"{where} {s}")


def verify_adapter(path: str | os.PathLike, product: VerifiedProduct, geometry: dict) -> Verified:
    """An adapter ``fq combine`` wrote, checked against the signed plan it was built from (``product``, opened by
    ``open_product``) before any of it is used: the adapter is a copy its holder made, so what vouches for its
    bytes is the plan. Its header metadata must name that plan (product, version, sha256, layout; stages equal to
    the chain's nodes). Every (layer, expert) it holds must carry exactly the chain's stages that cover that
    expert, each stage's tensors in the order a fragment lays them out (so a stage's bytes of one expert are the
    fragment's expert range byte for byte), and their sha256 must be the one the plan names for that range; then,
    per linear, what ``verify_fragments`` checks: K and codebook re-derived from the tensors, finite scales, (in,
    out) equal to the base's (``geometry``: ``Verified.geometry`` of the verified base fragments). An adapter
    narrowed to some experts holds only those; the others keep the base alone."""
    directory, name = split_path(path)
    where = str(path)
    plan = product.predicate
    chain = plan["chain"]
    layout = ExpertLayout.from_json(plan["layout"], f"{product.plan.path}: layout")
    stage_bytes = sum(f["size"] for f in plan["fragments"] if f["node"] != chain[0]["node"])
    with open_regular(directory, name, where) as fh:
        header = read_header(fh, where)
        if header.file_size - header.data_start > stage_bytes:  # before reading it whole (a planted sparse file)
            raise FqError(f"{where}: {header.file_size - header.data_start} bytes of tensors, more than the "
                          f"{stage_bytes} bytes of all the plan's stage fragments; not an adapter of this plan")
        fh.seek(0)
        data = fh.read()
    if len(data) != header.file_size:
        raise FqError(f"{where}: changed while it was read")
    meta = header.metadata
    want = {"format": ADAPTER_FORMAT, "plan_sha256": product.plan.sha256, "product": plan["product"],
            "version": str(plan["version"])}
    for k, v in want.items():
        if meta.get(k) != v:
            raise FqError(f"{where}: header metadata {k} is {meta.get(k)!r}; the plan it is checked against says {v!r}"
                          + (" (an adapter built from another plan)" if k == "plan_sha256" else ""))
    if loads(meta.get("layout", "null"), f"{where}: header metadata layout") != layout.to_json():
        raise FqError(f"{where}: header metadata layout is not the plan's")
    stages = loads(meta.get("stages", "null"), f"{where}: header metadata stages")
    chain_stages = {i: {"index": i, "node": n["node"], "K": n["K"], "codebook": n["codebook"]}
                    for i, n in enumerate(chain) if i > 0}
    if not isinstance(stages, list) or not stages or any(
            not isinstance(st, dict) or chain_stages.get(st.get("index")) != st for st in stages):
        raise FqError(f"{where}: header metadata stages {stages!r} are not stages of the plan's chain")
    # the plan's ranges of every stage: (layer, expert, chain index) -> expert range
    index = {n["node"]: i for i, n in enumerate(chain)}
    ranges = {(f["layer"], e["expert"], index[f["node"]]): e for f in plan["fragments"] if index[f["node"]] > 0
              for e in f["experts"]}
    rx = _adapter_re(layout)
    canonical = dict(zip(layout.projections, kbits.PROJECTIONS))
    groups: dict[tuple[int, int], list] = {}
    for e in header.entries:
        m = rx.fullmatch(e.name)
        if m is None:
            raise FqError(f"{where}: tensor {e.name!r} is not an adapter key of the plan's layout")
        groups.setdefault((int(m["layer"]), int(m["expert"])), []).append(e)
    result = Verified(layout, [], sorted(groups))
    for (layer, ex), entries in sorted(groups.items()):
        label = f"{where}: layer {layer} expert {ex}"
        if not all((layer, ex, proj) in geometry for proj in layout.projections):
            raise FqError(f"{label}: not an expert of product {plan['product']}'s base")
        need = sorted(i for (L, E, i) in ranges if (L, E) == (layer, ex))
        got = [e.name for e in entries]
        keys = [adapter_key(layout, layer, ex, proj, i, s) for i in need for proj in layout.projections
                for s in suffixes(chain[i]["codebook"])]
        if got != keys:
            nodes = [chain[i]["node"] for i in need]
            raise FqError(f"{label}: tensors {got[:4]}{'…' if len(got) > 4 else ''} are not the stages the plan's chain "
                          f"has for this expert ({', '.join(nodes) or 'none'}), in fragment order")
        for i in need:
            e = ranges[(layer, ex, i)]
            own = [adapter_key(layout, layer, ex, proj, i, s) for proj in layout.projections
                   for s in suffixes(chain[i]["codebook"])]
            off, n = header.span(own, f"layer {layer} expert {ex} stage {i}")
            piece = data[off: off + n]
            result.payload_bytes_read += n
            if n != e["length"] or sha256_hex(piece) != e["sha256"]:
                raise FqError(f"{label} stage {i} ({chain[i]['node']}): bytes differ from the range the plan names "
                              "(sha256 or length)")
            for proj in layout.projections:
                raws = {}
                for s in suffixes(chain[i]["codebook"]):
                    ent = header.entry(adapter_key(layout, layer, ex, proj, i, s))
                    raws[s] = RawTensor(ent.name, ent.dtype, ent.shape, data[ent.start: ent.end])
                lw = f"{label} {proj} stage {i}"
                check_stage_linear(raws, chain[i], layer, canonical[proj], lw)
                lin = derive_linear({s: (r.dtype, r.shape) for s, r in raws.items()}, lw)
                g = geometry.get((layer, ex, proj))
                if g != (lin.in_features, lin.out_features):
                    raise FqError(f"{lw}: is {lin.in_features}x{lin.out_features}, its base is {g[0]}x{g[1]}")
                for s, r in raws.items():
                    result.residual[(layer, ex, i, proj, s)] = r
    return result


def combine(plan_path: str | os.PathLike, public_key: Ed25519PublicKey, out: str | os.PathLike, *,
            experts: str | ExpertSelection = "all", base_dir: str | os.PathLike | None = None,
            root: str | os.PathLike | None = None, now: dt.datetime | None = None, state: PlanState | None = None,
            min_version: int | None = None, sign_key: Ed25519PrivateKey | None = None,
            base_option: str | None = None) -> Combined:
    """``base_option``: the command-line option that named ``base_dir`` (fq combine passes ``--base``)."""
    product = open_product(plan_path, public_key, root=root, now=now, state=state, min_version=min_version)
    product.refuse_stage_linears("fq combine's adapter")
    plan_obj, plan = product.plan, product.predicate
    chain = plan["chain"]
    index = {n["node"]: i for i, n in enumerate(chain)}
    if len(chain) < 2:
        raise FqError(f"{plan_path}: product {plan['product']} is a bare base; it has no residual to combine")
    sel = parse_selection(experts) if isinstance(experts, str) else experts
    work, chosen = narrow(plan, sel)
    if not any(index[f["node"]] > 0 for f, _ in work):
        raise FqError(f"--experts {sel.describe()}: no stage of {plan['product']} corrects any chosen expert")
    v = verify_fragments(product, public_key, work, chosen, base_dir=base_dir, base_option=base_option)
    layout, residual = v.layout, v.residual
    result = Combined(Path(out), "", Path(str(out) + ".intoto.jsonl"), chosen, [], v.fragments_opened,
                      v.payload_bytes_read)

    order = {p: n for n, p in enumerate(layout.projections)}
    sfx = {s: n for n, s in enumerate(("trellis", "suh", "svh", "mcg", "mul1"))}
    tensors = [residual[k] for k in sorted(residual, key=lambda k: (k[0], k[1], k[2], order[k[3]], sfx[k[4]]))]
    used = sorted({i for (_, _, i, _, _) in residual})
    stages = [{"index": i, "node": chain[i]["node"], "K": chain[i]["K"], "codebook": chain[i]["codebook"]} for i in used]
    meta = {"format": ADAPTER_FORMAT, "product": plan["product"], "version": str(plan["version"]),
            "plan_sha256": plan_obj.sha256, "stages": json.dumps(stages, separators=(",", ":")),
            "layout": json.dumps(layout.to_json(), separators=(",", ":"))}
    sha, spans = write_adapter(out, tensors=tensors, meta=meta, layout=layout)
    predicate = {"format": ADAPTER_FORMAT, "product": plan["product"], "version": plan["version"],
                 "plan_sha256": plan_obj.sha256, "campaign": plan["campaign"],
                 "base_manifest_sha256": plan["base"]["manifest"]["sha256"], "layout": layout.to_json(),
                 "stages": stages,
                 "experts": [{"layer": L, "expert": E, "offset": o, "length": n, "sha256": d} for L, E, o, n, d in spans],
                 "fragments": [{"name": f["name"], "sha256": f["sha256"]} for f, _ in work]}
    payload = statement([(Path(out).name, sha)], ADAPTER, predicate)
    envelope = dsse.sign(payload, sign_key) if sign_key is not None else dsse.unsigned(payload)
    atomic.write_bytes(result.attestation, dsse.envelope_line(envelope))
    product.record(state)
    result.sha256, result.stages = sha, stages
    return result



def check_complete(product: VerifiedProduct, base: VerifiedBase, base_dir: Path, public_key: Ed25519PublicKey,
                   base_option: str | None = None) -> None:
    """The verified base as one model (``fq.provenance.complete``: what ``fq verify`` checks of it too)."""
    files = base.manifest.files
    check_base(product.predicate, [BaseShard.from_attested(a) for a in base.shards.values()], files=files,
               read=lambda name: read_verified(base_dir, name, *files[name])[1],
               where=f"{base_option + ' ' if base_option else ''}{base_dir}", root=product.root, public_key=public_key)
