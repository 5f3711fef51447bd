"""Linear jobs of whole-model bases: one linear node's encoding of one class of non-expert linears of one layer (or
of the head), committed as a linear fragment + attestation + metrics.

The weights are read from the committed skeleton shards -- verbatim copies of the source, verified under the
campaign key before a byte is used -- so a linear job needs no staged source shard and never holds a window open
(the head's job waits for the whole calibration chain). Each linear is encoded weight-only or, in a calibrated
campaign, with LDLQ against its input Hessian (``fq.hessian.linear_store``; linears that read one input share one
H). The attestation names every source tensor with the sha256 of its bytes (the skeleton attestation's, equal to
the source's), the Hessian file and digest the campaign bound, and the quant args. Locks, signer and encoder
checks are the expert jobs' (fq.workflow.encode).

A stage's residual on a class (recipe ``skeleton`` on a stage: a linear node with a parent) reads its ancestors'
*committed* linear fragments of the same layer (verified under the campaign key, kind ``linear``, their linear node
digests checked against the plan's), and encodes each linear's residual against exactly those bytes, as an expert
stage does (``fq.workflow.encode.encode_matrix``: LDLQ against the same bound Hessian, or weight-only); its
attestation names the parent fragment ({name, sha256}), whose own attestation names its parent, down to the base's.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from safetensors import safe_open

from fq.core import atomic, canonical
from fq.errors import FqError
from fq.model.experts import suffixes
from fq.model.formats import ExpertSource, read_matrix
from fq.provenance.attest import keys
from fq.provenance.attest.fragment import attest_linears, verify_shard
from fq.provenance.fragments import linear_filename, write_linears
from fq.workflow import calibration, devices
from fq.workflow.common import check_signer
from fq.workflow.encode import encode_matrix, check_encoder, quant_args_for, take_block
from fq.workflow.skeleton import source_statement

LINEAR_SEED_RULE = "int(sha256('fq-seed/{seed}/{node}/{linear}')[:8], 16)"


def linear_seed(seed: int, node: str, linear: str) -> int:
    return int(hashlib.sha256(f"fq-seed/{seed}/{node}/{linear}".encode()).hexdigest()[:8], 16)


def _verified_tensors(refs: dict[str, ExpertSource], pub, doc: dict) -> dict[str, dict]:
    """tensor -> its skeleton attestation entry, for every tensor the job reads, each skeleton shard verified whole."""
    out: dict[str, dict] = {}
    shards = sorted({r.shard for r in refs.values()} | {r.scale_shard for r in refs.values() if r.scale_shard})
    for shard in shards:
        p = Path(shard)
        att = verify_shard(p.parent, p.name, pub, campaign=doc["identity"])
        if att.predicate["kind"] != "skeleton":
            raise FqError(f"{p}: a linear job reads skeleton shards; this one is a {att.predicate['kind']} shard")
        for t in att.info.tensors:
            e = att.info.header.entry(t.name)
            out[t.name] = {"tensor": t.name, "shard": att.predicate["source_shard"], "dtype": e.dtype,
                           "shape": list(e.shape), "sha256": t.sha256}
    return out


def linear_ancestors(ancestors: list[dict], names, layer: int | None, pub, doc: dict) -> tuple[list[dict], dict | None]:
    """([{linear: tensor set}] of the committed ancestor fragments, base first; {name, sha256} of the last: the parent)
    of a stage's residual on a class. ``ancestors``: [{node, codebook, digest, path}] (linear nodes, base first)."""
    sets, parent = [], None
    for anc in ancestors:
        path = Path(anc["path"])
        att = verify_shard(path.parent, path.name, pub, campaign=doc["identity"])
        p = att.predicate
        where = f"ancestor {anc['node']} ({path})"
        if p["kind"] != "linear" or p["node"] != anc["node"] or p["layer"] != layer or path.name != linear_filename(
                anc["node"], layer):
            raise FqError(f"{where}: attests a {p['kind']} shard of node {p['node']} layer {p['layer']}, not linear node "
                          f"{anc['node']} {'head' if layer is None else f'layer {layer}'}")
        if p["node_digest"] != anc["digest"]:
            raise FqError(f"{where}: attests node_digest {p['node_digest'][:16]}…, the plan's linear node is "
                          f"{anc['digest'][:16]}…; re-encode it")
        mine = {}
        with safe_open(str(path), "pt") as f:
            have = set(f.keys())
            for name in names:
                want = [f"{name}.{s}" for s in suffixes(anc["codebook"])]
                if not set(want) <= have:
                    raise FqError(f"{where}: holds no EXL3 tensor set of {name}")
                mine[name] = {s: f.get_tensor(f"{name}.{s}") for s in suffixes(anc["codebook"])}
        sets.append(mine)
        parent = {"name": path.name, "sha256": att.sha256}
    return sets, parent


def encode_linear_job(*, campaign_json: str, key_path: str, node: str, cls: str, K: int, codebook: str,
                      node_digest: str, layer: int | None, sources: dict, out_fragment: str, out_metrics: str,
                      device: str, devices_list: list[int], lock_dir: str, seed: int, threads: int = 0,
                      hessian: dict | None = None, ancestors: list[dict] | None = None) -> dict:
    """Encode one linear job (``sources``: {linear: ExpertSource JSON} in the committed skeleton) and commit it.
    ``hessian``: {path, binding} of the layer's linear Hessians (calibrated campaigns), else weight-only.
    ``ancestors``: a stage's residual: [{node, codebook, digest, path}] of the linear fragments it corrects, base
    first (``linear_ancestors``); empty or None for a base's linear node."""
    outs = [out_fragment, str(Path(out_fragment).with_name(Path(out_fragment).name + ".intoto.jsonl")), out_metrics]
    where = f"{node} {'head' if layer is None else f'layer {layer}'}"
    take_block(lock_dir, Path(out_fragment).stem, outs, f"linear job {where}")
    doc = canonical.load(campaign_json)
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    check_signer(doc, pub, key_path)
    devices.check(device, devices_list)
    check_encoder(doc, "cpu", ignore=() if device == "cpu" else ("device_arch",))
    if threads:
        torch.set_num_threads(threads)
    refs = {name: ExpertSource.from_json(ref, f"sources[{name}]") for name, ref in sorted(sources.items())}
    attested = _verified_tensors(refs, pub, doc)
    chains, parent = linear_ancestors(ancestors or [], list(refs), layer, pub, doc)
    hess, bound = (None, None) if hessian is None else calibration.bound_linear_hessians(
        hessian["path"], hessian["binding"], layer)
    dev = devices.claim(device, devices_list, lock_dir)
    handles: dict = {}
    tensors, metrics = {}, {}
    try:
        for name, ref in refs.items():
            w = read_matrix(handles, ref, f"{where} {name}")
            s = linear_seed(seed, node, name)
            enc, sum_sq_w = encode_matrix(w, [sets[name] for sets in chains], K, codebook, s, dev,
                                           None if hess is None else hess.for_linear(name).float(), name)
            tensors[name] = enc.tensors
            metrics[name] = {"sum_sq_w": enc.sum_sq_w if sum_sq_w is None else sum_sq_w, "sum_sq_err": enc.sum_sq_err,
                             "g_scale": enc.g_scale, "shape": list(w.shape)}
            if enc.proxy_err is not None:
                metrics[name]["proxy_err"] = enc.proxy_err
            del enc, w
    finally:
        handles.clear()
    info = write_linears(out_fragment, node=node, cls=cls, layer=layer, K=K, codebook=codebook, linears=tensors)
    read = [attested[r.tensor] for r in refs.values()] + [attested[r.scale] for r in refs.values() if r.scale]
    source = dict(source_statement(doc, sorted({t["shard"] for t in read})), tensors=read)
    quant_args = dict(quant_args_for(K, codebook, seed, bound), seed_rule=LINEAR_SEED_RULE)
    att = attest_linears(out_fragment, key=priv, campaign=doc["identity"], source=source, encoder=doc["encoder"],
                         quant_args=quant_args, node_digest=node_digest, parent=parent, info=info)
    summary = {"linear_node": node, "class": cls, "layer": layer, "K": K, "codebook": codebook,
               "fragment": Path(out_fragment).name, "sha256": att.sha256, "objective": quant_args["objective"],
               "parent": parent, "linears": metrics}
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary
