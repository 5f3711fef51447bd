"""One encode job: node N's encoding of one block, committed as fragment + attestation + metrics.

A stage reads its ancestors' *committed* fragments (verified under the campaign key, their node
digests checked against the recipe) and encodes the residual against exactly those bytes, so a
residual can never be pinned to a parent that was recomputed only in memory.

Before it reads or writes anything a job takes its locks (fq.workflow.locks): ``workers.lock`` shared
and the block's claim exclusively, both for the life of the process, and refuses the block when
anyone else -- an orphan of a killed Snakemake included -- holds the claim. Then it checks the signer
key and the encoder build against the ones bound at init, so a wrong key or a rebuilt encoder fails
in seconds. The three outputs are committed one by one, each atomically (temp name, fsync, rename):
a job killed between them leaves the block incomplete (fragment_needs_source and Snakemake's
incomplete-output marker both see it) and the next run redoes the whole block.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from fq import atomic, canonical
from fq.attest import keys
from fq.attest.fragment import attest_fragment, check_node_digest, verify_shard
from fq.codec import encode as codec_encode
from fq.codec import encode_residual
from fq.errors import FqError
from fq.experts import ExpertLayout, suffixes
from fq.fragments import attestation_name, write_fragment
from fq.identity import encoder_identity
from fq.source import PROJECTIONS
from fq.workflow import devices, locks
from fq.workflow.init import check_signer, encoder_differences
from fq.workflow.skeleton import source_statement

SEED_RULE = "int(sha256('fq-seed/{seed}/{node}/{layer}/{expert}/{proj}')[:8], 16)"


def matrix_seed(seed: int, node: str, layer: int, expert: int, proj: str) -> int:
    return int(hashlib.sha256(f"fq-seed/{seed}/{node}/{layer}/{expert}/{proj}".encode()).hexdigest()[:8], 16)


def check_encoder(doc: dict, device: str) -> dict:
    """This process's encoder identity must be the one bound at init (fail in seconds, not at finalize)."""
    mine = encoder_identity(device)
    problem = encoder_differences(doc["encoder"], mine)
    if problem:
        raise FqError(f"{problem}; encode with the bound build or start a new campaign")
    return mine


def take_block(lock_dir: str, claim: str, outputs: list[str], what: str) -> None:
    """This job's locks (claim ``claim``), then the leftovers of an interrupted write of its own outputs
    (dead: we hold the claim, so nobody else can be writing them)."""
    locks.hold_worker(lock_dir, claim, what)
    for out in outputs:
        for p in locks.remove_dead_temps(Path(out).parent, [Path(out).name]):
            print(f"removed {p}: leftover of an interrupted write of this block", file=sys.stderr)


def load_sets(path: Path, layout: ExpertLayout, layer: int, experts, codebook: str) -> dict:
    """{expert: {proj: tensor set}} of the given experts from a committed fragment (proj: gate/up/down)."""
    out = {}
    with safe_open(str(path), "pt") as f:
        for e in experts:
            out[e] = {p: {s: f.get_tensor(layout.key(layer, e, lp, s)) for s in suffixes(codebook)}
                      for p, lp in zip(PROJECTIONS, layout.projections)}
    return out


def read_source(sources: dict) -> dict:
    """{expert: {proj: float32 W}} from the staged shards ({expert: {proj: [path, tensor name]}})."""
    handles = {}
    out = {}
    try:
        for e, projs in sources.items():
            out[int(e)] = {}
            for p, (path, name) in projs.items():
                if path not in handles:
                    if not Path(path).is_file():
                        raise FqError(f"{path}: source shard is not staged (its window retired and the job was forced?); "
                                      f"delete the fragment instead of forcing it, so Snakemake stages the shard again")
                    handles[path] = safe_open(path, "pt")
                out[int(e)][p] = handles[path].get_tensor(name).to(torch.float32)
    finally:
        handles.clear()
    return out


def encode_block(*, campaign_json: str, key_path: str, node: str, role: str, K: int, codebook: str, node_digest: str,
                 layer: int, block: int, experts: list[int], sources: dict, ancestors: list[dict], out_fragment: str,
                 out_metrics: str, device: str, devices_list: list[int], lock_dir: str, seed: int, threads: int = 0,
                 layout: ExpertLayout) -> dict:
    """``ancestors``: [{node, codebook, digest, path}] from the base to the parent, in chain order."""
    att_path = str(Path(out_fragment).with_name(attestation_name(Path(out_fragment).name)))
    name = Path(out_fragment).stem
    take_block(lock_dir, name, [out_fragment, att_path, out_metrics], f"block {name} (node {node}, layer {layer}, "
               f"block {block})")
    doc = canonical.load(campaign_json)
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    check_signer(doc, pub, key_path)
    dev = devices.claim(device, devices_list, lock_dir)
    check_encoder(doc, dev if dev == "cpu" else "cuda")
    if threads:
        torch.set_num_threads(threads)

    chains = {e: {p: [] for p in PROJECTIONS} for e in experts}
    parent = None
    for anc in ancestors:
        path = Path(anc["path"])
        att = verify_shard(path.parent, path.name, pub, campaign=doc["identity"])
        check_node_digest(att, anc["digest"], f"ancestor {anc['node']} of {node}")
        sets = load_sets(path, layout, layer, experts, anc["codebook"])
        for e in experts:
            for p in PROJECTIONS:
                chains[e][p].append(sets[e][p])
        parent = {"name": path.name, "sha256": att.sha256}

    W = read_source(sources)
    tensors, metrics = {}, {}
    jobs = [(e, p) for e in experts for p in PROJECTIONS]
    for e, p in tqdm(jobs, desc=f"{node} L{layer} B{block}", unit="matrix", file=sys.stderr, mininterval=2):
        s = matrix_seed(seed, node, layer, e, p)
        w = W[e][p]
        if chains[e][p]:
            enc = encode_residual(w, chains[e][p], K, codebook, s, dev)
            # the residual's own error is the chain's: (parent + R_hat) - W = R_hat - R; only sum W^2 is new
            sum_sq_w = float(w.double().square().sum())
        else:
            enc = codec_encode(w, K, codebook, s, dev)
            sum_sq_w = enc.sum_sq_w
        tensors.setdefault(e, {})[dict(zip(PROJECTIONS, layout.projections))[p]] = enc.tensors
        metrics.setdefault(str(e), {})[p] = {"sum_sq_w": sum_sq_w, "sum_sq_err": enc.sum_sq_err,
                                             "g_scale": enc.g_scale}

    write_fragment(out_fragment, layout=layout, node=node, role=role, layer=layer, block=block, K=K,
                   codebook=codebook, experts=tensors)
    shards = sorted({path for projs in sources.values() for path, _ in projs.values()})
    quant_args = {"K": K, "codebook": codebook, "seed": seed, "seed_rule": SEED_RULE,
                  "objective": "weight-only MSE, no Hessian", "scale_search": "gaussian-prior/3"}
    att = attest_fragment(out_fragment, key=priv, campaign=doc["identity"],
                          source=source_statement(doc, [Path(s).name for s in shards]), encoder=doc["encoder"],
                          quant_args=quant_args, node_digest=node_digest, parent=parent)
    summary = {"node": node, "layer": layer, "block": block, "K": K, "codebook": codebook, "fragment": Path(out_fragment).name,
               "sha256": att.sha256, "experts": metrics}
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary


def encode_native(*, K: int, codebook: str, layer: int, experts: list[int], sources: dict, out_metrics: str,
                  device: str, devices_list: list[int], lock_dir: str, seed: int, threads: int = 0) -> dict:
    """A one-pass encode at K bits, for the report's comparison only: metrics, no fragment."""
    name = f"native-K{K}-{codebook}-{Path(out_metrics).stem}"
    take_block(lock_dir, name, [out_metrics], f"block {name} (one-pass K{K} {codebook}, layer {layer})")
    dev = devices.claim(device, devices_list, lock_dir)
    if threads:
        torch.set_num_threads(threads)
    W = read_source(sources)
    metrics = {}
    for e in experts:
        for p in PROJECTIONS:
            w = W[e][p]
            enc = codec_encode(w, K, codebook, matrix_seed(seed, f"native-K{K}", layer, e, p), dev)
            metrics.setdefault(str(e), {})[p] = {"sum_sq_w": enc.sum_sq_w, "sum_sq_err": enc.sum_sq_err}
    summary = {"native": True, "K": K, "codebook": codebook, "layer": layer, "experts": metrics}
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary
