"""Encode jobs: node N's encoding of one block, or of every block of one layer (``encode.per_job``),
each block committed as fragment + attestation + metrics.

A stage reads its ancestors' *committed* fragments (verified under the campaign key, their node
digests checked against the recipe) and encodes the residual against exactly those bytes, so a
residual can never be pinned to a parent that was recomputed only in memory.

Before it reads or writes anything a job takes its locks (fq.workflow.locks): ``workers.lock`` shared
and the claim of every block it will write exclusively, all for the life of the process, and refuses
when anyone else -- an orphan of a killed Snakemake included -- holds one of them. Then it checks the
signer key and the encoder build against the ones bound at init (once per job), so a wrong key or a
rebuilt encoder fails in seconds. A block's three outputs are committed one by one, each atomically
(temp name, fsync, rename), as soon as the block is encoded: a job killed between them leaves the block
incomplete (fragment_needs_source and Snakemake's incomplete-output marker both see it) and the next
run redoes the job.

A layout with stored scales (Laguna's routed up_proj, fq.model.experts) is applied at the tensor sets, never to the
matrices: every encode (signed fragments, native comparisons, weight-only twins) codes the source's matrix, a stage's
parents are read back in the source's units (``load_sets``), and each encoded set is stored through
``ExpertLayout.stored`` (svh times 2^n); the metrics are the encoder's, in the source's units.

The encoder is called per batch, not per matrix (``batch_bytes``, BATCH_BYTES): consecutive experts of one block (never
two: a layer job commits each block as it is encoded) whose float32 source matrices add up to the budget; their
matrices of one K, codebook and input width go to one fq.codec.encode_ldlq_batch call (calibrated: gate and up share
the layer's input H, each down its expert's H) or fq.codec.encode_batch (weight-only), bases and stages alike (a
stage's matrices with their parent chains), which give each matrix the bytes it gets alone. A matrix the encoder
would code by chunks (wider than a chunk of its memory budget, fq.codec.chunked) is encoded alone, as before.
``batch_bytes=0`` encodes one matrix at a time (the same bytes; tests/test_encode_job.py compares them).

I/O overlaps the encoder: one reader thread verifies the next block's ancestors and reads the next
batch's source matrices (safetensors, bf16 -> float32) while the current batch encodes, and one writer
thread commits a finished block (write, sha256 + Ed25519 attestation, metrics) while the next batch
encodes. Blocks are committed in order, one at a time, by that one writer; an exception in either thread
fails the job with its original message (a failed read after the blocks before it are encoded and committed).
"""
from __future__ import annotations

import hashlib
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from fq.codec import encode as codec_encode
from fq.codec import chunked, encode_batch, encode_residual
from fq.codec.ldlq import encode_ldlq, encode_ldlq_batch
from fq.codec.scale_search import pipeline_device
from fq.codec.shape import padded_shape
from fq.codec.exact import tree_sum
from fq.core import atomic, canonical, kbits
from fq.errors import FqError
from fq.hessian import store
from fq.model.experts import ExpertLayout, suffixes
from fq.model.formats import ExpertSource, read_matrix
from fq.model.source import PROJECTIONS
from fq.provenance.attest import keys
from fq.provenance.attest.fragment import attest_fragment, check_node_digest, verify_shard
from fq.provenance.fragments import attestation_name, write_fragment
from fq.provenance.identity import encoder_identity
from fq.workflow import calibration, devices, locks
from fq.workflow.common import check_signer
from fq.workflow.init import encoder_differences
from fq.workflow.skeleton import source_statement

# An encode job's batch: consecutive experts of one block whose float32 source matrices add up to at most this;
# their matrices of one K, codebook and input width are encoded in one encode_ldlq_batch / encode_batch call (the
# same bytes as one at a time). The reader holds a second batch (the next, read ahead). CUDA: 14 GLM-5 experts
# (150 MB each), so a call codes 28 gate/up matrices sharing the layer's input H and one 14 down projections.
BATCH_BYTES = {"cpu": 256 << 20, "cuda": 2 << 30}

SEED_RULE = "int(sha256('fq-seed/{seed}/{node}/{layer}/{expert}/{proj}')[:8], 16)"


def matrix_seed(seed: int, node: str, layer: int, expert: int, proj: str) -> int:
    return int(hashlib.sha256(f"fq-seed/{seed}/{node}/{layer}/{expert}/{proj}".encode()).hexdigest()[:8], 16)


def check_encoder(doc: dict, device: str, ignore=()) -> dict:
    """This process's encoder identity must be the one bound at init (fail in seconds, not at finalize)."""
    mine = encoder_identity(device)
    problem = encoder_differences(doc["encoder"], mine, ignore)
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
    """{expert: {proj: tensor set}} of the given experts from a committed fragment (proj: gate/up/down), each set as
    it reconstructs the source's matrix (``layout.source``: a stage's residual is taken in the source's units, and
    stored at the layout's scale like its parents)."""
    out = {}
    with safe_open(str(path), "pt") as f:
        for e in experts:
            out[e] = {p: layout.source(lp, {s: f.get_tensor(layout.key(layer, e, lp, s)) for s in suffixes(codebook)})
                      for p, lp in zip(PROJECTIONS, layout.projections)}
    return out


def expert_sources(sources: dict) -> dict:
    """{expert: {proj: ExpertSource}} from an encode job's ``sources`` param (fq.model.formats)."""
    return {int(e): {p: ExpertSource.from_json(ref, f"sources[{e}][{p}]") for p, ref in projs.items()}
            for e, projs in sources.items()}


def read_source(sources: dict) -> dict:
    """{expert: {proj: float32 W}} from the staged shards (FP8 matrices dequantized with their block scales)."""
    handles: dict = {}
    try:
        return {e: {p: read_matrix(handles, ref, f"expert {e} {p}") for p, ref in projs.items()}
                for e, projs in expert_sources(sources).items()}
    finally:
        handles.clear()


def source_tensors(refs) -> list[dict]:
    """The source ranges an encode read (``refs``: ExpertSource), as a fragment's attestation names them: per
    tensor (weights and FP8 scales) its shard, dtype, shape and [start, end) byte range in the shard."""
    from fq.model.shards import read_header

    want: dict[str, set[str]] = {}
    for r in refs:
        want.setdefault(r.shard, set()).add(r.tensor)
        if r.scale is not None:
            want.setdefault(r.scale_shard, set()).add(r.scale)
    out = []
    for shard in sorted(want):
        with open(shard, "rb") as fh:
            header = read_header(fh, shard)
        for name in sorted(want[shard]):
            e = header.entry(name)
            out.append({"tensor": name, "shard": Path(shard).name, "dtype": e.dtype, "shape": list(e.shape),
                        "range": [e.start, e.end]})
    return out


@dataclass
class BlockJob:
    """One (node, layer, block) of an encode job: what to encode and where its outputs go.
    ``K``: the node's fragment spec at this layer (``fq.core.kbits``: an int, or K per projection gate/up/down, as
    JSON too; checked and normalised here), each matrix encoded at its projection's K;
    ``ancestors``: [{node, codebook, digest, path}] from the base to the parent, in chain order;
    ``sources``: {expert: {proj: [staged shard path, tensor name]}}."""

    node: str
    role: str
    K: kbits.FragmentK
    codebook: str
    node_digest: str
    layer: int
    block: int
    experts: list[int]
    sources: dict
    ancestors: list[dict]
    out_fragment: str
    out_metrics: str
    hessian: dict | None = None  # {path, binding} of the layer's Hessian (calibrated campaigns), else weight-only

    def __post_init__(self):
        self.K = kbits.fragment(self.K, f"encode {self.node} layer {self.layer} block {self.block}: K")

    @property
    def out_attestation(self) -> str:
        return str(Path(self.out_fragment).with_name(attestation_name(Path(self.out_fragment).name)))

    @property
    def name(self) -> str:
        return Path(self.out_fragment).stem

    @property
    def outputs(self) -> list[str]:
        return [self.out_fragment, self.out_attestation, self.out_metrics]


_END = object()


class _Prefetch:
    """Iterate ``items`` (a generator) one item ahead in a background thread. ``next`` re-raises the
    generator's exception as it was raised there; ``wait_s`` is the time the caller spent blocked."""

    def __init__(self, items):
        self._items = items
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="fq-read")
        self._next = self._pool.submit(next, items, _END)
        self.wait_s = 0.0

    def __iter__(self):
        return self

    def __next__(self):
        t = time.perf_counter()
        try:
            item = self._next.result()
        finally:
            self.wait_s += time.perf_counter() - t
        if item is _END:
            raise StopIteration
        self._next = self._pool.submit(next, self._items, _END)
        return item

    def dispose(self, d: dict) -> None:
        """Empty ``d`` in the reader thread: the last references to big host tensors go there, so their
        memory is returned to the system (munmap) off the encoding thread."""
        self._pool.submit(d.clear)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._items.close()  # the generator is idle now: run its finally (drops the open shards)


def _read_items(jobs: list[BlockJob], pub, doc: dict, layout: ExpertLayout, handles: dict):
    """Per block, its ancestors verified and loaded (parent = {name, sha256} of the last), then per expert
    (block index, expert, {proj: float32 W}, {proj: [ancestor tensor sets]}, parent)."""
    for i, b in enumerate(jobs):
        anc_sets, parent = [], None
        for anc in b.ancestors:
            path = Path(anc["path"])
            att = verify_shard(path.parent, path.name, pub, campaign=doc["identity"])
            check_node_digest(att, anc["digest"], f"ancestor {anc['node']} of {b.node}")
            anc_sets.append(load_sets(path, layout, b.layer, b.experts, anc["codebook"]))
            parent = {"name": path.name, "sha256": att.sha256}
        refs = expert_sources(b.sources)
        for e in b.experts:
            W = {p: read_matrix(handles, refs[e][p], f"layer {b.layer} expert {e} {p}") for p in PROJECTIONS}
            yield i, e, W, {p: [sets[e][p] for sets in anc_sets] for p in PROJECTIONS}, parent


def _read_blocks(jobs: list[BlockJob], pub, doc: dict, layout: ExpertLayout, batch_bytes: int = 0):
    """Reader thread: the items of ``_read_items`` in batches, lists of consecutive items of one block whose
    float32 matrices add up to at most ``batch_bytes`` (one expert at least; 0: one expert a batch). A batch never
    spans two blocks, so a layer job commits each block as soon as it is encoded (a job killed mid-layer keeps the
    blocks before). A read that
    fails yields the batch read before it first, then raises: the blocks before it are still encoded and committed."""
    handles: dict = {}
    batch, held = [], 0
    items = _read_items(jobs, pub, doc, layout, handles)
    try:
        while True:
            try:
                item = next(items, None)
            except BaseException:
                if batch:
                    yield batch
                raise
            if item is None:
                break
            size = sum(w.numel() * w.element_size() for w in item[2].values())
            if batch and (held + size > batch_bytes or item[0] != batch[-1][0]):
                yield batch
                batch, held = [], 0
            batch.append(item)
            held += size
        if batch:
            yield batch
    finally:
        items.close()
        handles.clear()


def quant_args_for(K: kbits.FragmentK, codebook: str, seed: int, bound: dict | None,
                   layout: ExpertLayout | None = None) -> dict:
    """The attested quant args: K (``kbits.to_json`` of the fragment spec: the int of a fixed-K encode), the objective,
    the layout's stored scales where it has any (the tensors are the encoding's with svh times 2^n: an input of the
    bytes as much as the rest), and for a calibrated encode the Hessian's file, sha256, token digest and capture mode
    (a re-encode is byte-identical given those bytes: fq.provenance.identity.determinism_scope)."""
    args = {"K": kbits.to_json(kbits.fragment(K)), "codebook": codebook, "seed": seed, "seed_rule": SEED_RULE,
            "scale_search": "gaussian-prior/3"}
    if layout is not None and layout.stored_scale_log2:
        args["stored_scale_log2"] = layout.scales_json()
    if bound is None:
        return dict(args, objective=store.OBJECTIVE_WEIGHT)
    return dict(args, objective=store.OBJECTIVE_LDLQ, hessian=calibration.quant_hessian(bound))


class _Hessians:
    """The bound Hessian of a job's layer, read once; H per projection (gate/up share the block input's, or with
    calibration.weighting affinity each expert's gate/up its own: ``LayerHessians.input_for``)."""

    def __init__(self, spec: dict | None, layer: int):
        self.h, self.bound, self._input = None, None, None
        if spec is not None:
            self.h, self.bound = calibration.bound_hessians(spec["path"], spec["binding"], layer,
                                                            spec.get("weighting", "none"))

    def for_matrix(self, expert: int, proj: str):
        if self.h is None:
            return None
        if proj == "down":
            return self.h.down(expert)
        if self.h.weighting == "affinity":
            return self.h.input_for(expert)
        if self._input is None:
            self._input = self.h.input()
        return self._input


def encode_matrix(w, chain: list, K: int, codebook: str, seed: int, dev, H, name: str):
    """(Encoded, sum of W² of the matrix itself): weight-only or LDLQ, base or residual over ``chain``."""
    if H is not None:
        enc = encode_ldlq(w, H, K, codebook, seed, dev, parents=chain or None, name=name)
    elif chain:
        enc = encode_residual(w, chain, K, codebook, seed, dev)
    else:
        return codec_encode(w, K, codebook, seed, dev), None
    return enc, _own_sum_sq(w, chain)


def _own_sum_sq(w, chain: list) -> float | None:
    """A stage's sum of W² of the matrix itself (None for a base: the Encoded's own sum_sq_w is W's)."""
    if not chain:
        return None
    # the residual's own error is the chain's: (parent + R_hat) - W = R_hat - R; only sum W^2 is new
    w64 = w.double()  # the encoder's pairwise sum: metrics and report do not depend on the CPU
    return float(tree_sum((w64 * w64).flatten()))


def _whole(w, dev) -> bool:
    """Whether the encoder codes ``w`` whole (a matrix wider than a chunk of the memory budget is coded by chunks,
    fq.codec.chunked, and only when it is encoded alone): only those are batched."""
    out_p, in_p = padded_shape(tuple(w.shape))
    return chunked.chunk_columns(in_p, out_p, pipeline_device(dev)) >= out_p


def encode_group(mats: list, K: int, codebook: str, dev) -> list:
    """Encode matrices of one K, codebook and input width together; per matrix (Encoded, own sum W² or None) as
    encode_matrix gives it alone, bit for bit (encode_ldlq_batch / encode_batch: each matrix of a batch gets what it
    would get alone). ``mats``: [(w, chain, seed, H, name)], H None for all (weight-only) or for none (LDLQ)."""
    if len(mats) == 1:
        w, chain, seed, H, name = mats[0]
        return [encode_matrix(w, chain, K, codebook, seed, dev, H, name)]
    ws = [m[0] for m in mats]
    parents = [m[1] or None for m in mats]
    if not any(parents):
        parents = None
    seeds = [m[2] for m in mats]
    if mats[0][3] is not None:
        encs = encode_ldlq_batch(ws, [m[3] for m in mats], K, codebook, seeds, dev, parents=parents,
                                 names=[m[4] for m in mats])
    else:
        encs = encode_batch(ws, K, codebook, seeds, dev, parents=parents)
    return [(enc, _own_sum_sq(m[0], m[1])) for enc, m in zip(encs, mats)]


def _groups(keys: list, batched: bool) -> list[list[int]]:
    """Indices of a batch's matrices grouped by key (K, width, ...; None: encoded alone), in order of first
    appearance; unbatched, one matrix a group."""
    if not batched:
        return [[j] for j in range(len(keys))]
    out: dict = {}
    for j, k in enumerate(keys):
        out.setdefault(("alone", j) if k is None else k, []).append(j)
    return list(out.values())


def _commit(b: BlockJob, tensors: dict, metrics: dict, parent: dict | None, *, doc: dict, priv, seed: int,
            layout: ExpertLayout, t0: float, stats: dict | None, bound: dict | None = None) -> dict:
    """Writer thread: fragment, attestation, metrics of one encoded block, each atomic, in this order."""
    t = time.perf_counter()
    info = write_fragment(b.out_fragment, layout=layout, node=b.node, role=b.role, layer=b.layer, block=b.block,
                          K=b.K, codebook=b.codebook, experts=tensors)
    t_frag = time.perf_counter()
    refs = [r for projs in expert_sources(b.sources).values() for r in projs.values()]
    shards = sorted({Path(s).name for r in refs for s in r.shards})
    quant_args = quant_args_for(b.K, b.codebook, seed, bound, layout)
    source = dict(source_statement(doc, shards), tensors=source_tensors(refs))
    att = attest_fragment(b.out_fragment, key=priv, campaign=doc["identity"], source=source, encoder=doc["encoder"],
                          quant_args=quant_args, node_digest=b.node_digest, parent=parent, info=info)
    t_att = time.perf_counter()
    summary = {"node": b.node, "layer": b.layer, "block": b.block, "K": kbits.to_json(b.K), "codebook": b.codebook,
               "fragment": Path(b.out_fragment).name, "sha256": att.sha256, "objective": quant_args["objective"],
               "experts": metrics}
    atomic.write_text(b.out_metrics, canonical.pretty(summary))
    if stats is not None:
        now = time.perf_counter()
        stats.update(committed_s=now - t0, commit_fragment_s=t_frag - t, commit_attest_s=t_att - t_frag,
                     commit_metrics_s=now - t_att)
    return summary


def _gap(timeline: dict, block: dict, t: float) -> None:
    """Timeline bookkeeping: the time since the previous encoder call returned (the GPU idles meanwhile)."""
    if "last_call_end" not in timeline:
        timeline["first_call"] = t
        return
    g = t - timeline["last_call_end"]
    block["gap_s"] = block.get("gap_s", 0.0) + g
    block["max_gap_s"] = max(block.get("max_gap_s", 0.0), g)


def encode_blocks(jobs: list[BlockJob], *, campaign_json: str, key_path: str, device: str, devices_list: list[int],
                  lock_dir: str, seed: int, layout: ExpertLayout, threads: int = 0,
                  timeline: dict | None = None, batch_bytes: int | None = None) -> list[dict]:
    """Encode ``jobs`` (one block, or every block of one (node, layer)) in one process; returns their metrics
    summaries. ``timeline``: if a dict, filled with where the time went (benchmarks/encode_job.py,
    benchmarks/gpu_pipeline.py): per block the seconds inside the encoder calls (``encode_s``: GPU busy on
    CUDA), between them (``gap_s``, ``max_gap_s``), waiting for the reader and the writer, and when it was
    encoded and committed; for the job ``setup_s``, ``claim_wait_s``, ``wall_s``, and as time.perf_counter()
    stamps (one clock for every process on Linux) ``start``, ``claimed``, ``first_call``, ``last_call_end``; an encoder
    call of a batch is charged to its blocks in proportion to their matrices in it. ``batch_bytes``: float32 source
    bytes of one batch (None: BATCH_BYTES of the device; 0: one matrix at a time, the same bytes)."""
    t0 = time.perf_counter()
    if timeline is not None:
        timeline["start"] = t0
    if not jobs:
        raise FqError("encode job with no blocks")
    for b in jobs:  # every claim before anything is read or written
        take_block(lock_dir, b.name, b.outputs, f"block {b.name} (node {b.node}, layer {b.layer}, block {b.block})")
    doc = canonical.load(campaign_json)
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    check_signer(doc, pub, key_path)
    devices.check(device, devices_list)
    check_encoder(doc, "cpu", ignore=() if device == "cpu" else ("device_arch",))  # the GPU's arch: after the claim
    if threads:
        torch.set_num_threads(threads)
    stats = [{"node": b.node, "layer": b.layer, "block": b.block, "matrices": 3 * len(b.experts), "encode_s": 0.0,
              "read_wait_s": 0.0, "write_wait_s": 0.0} for b in jobs] if timeline is not None else None

    label = f"{jobs[0].node} L{jobs[0].layer}" + (f" B{jobs[0].block}" if len(jobs) == 1 else f" ({len(jobs)} blocks)")
    bar = tqdm(total=sum(3 * len(b.experts) for b in jobs), desc=label, unit="matrix", file=sys.stderr,
               mininterval=2)
    if batch_bytes is None:
        batch_bytes = BATCH_BYTES["cpu" if device == "cpu" else "cuda"]
    # reads the first batch while we wait for a GPU, then each next batch while the current one encodes
    reader = _Prefetch(_read_blocks(jobs, pub, doc, layout, batch_bytes))
    writer = ThreadPoolExecutor(1, thread_name_prefix="fq-write")
    pending, summaries = None, []
    tensors: dict = {}  # per block index: {expert: {projection: stored tensor set}} until committed
    metrics: dict = {}
    left = {i: len(b.experts) for i, b in enumerate(jobs)}
    projections = dict(zip(PROJECTIONS, layout.projections))
    if len({(b.layer, canonical.dumps(b.hessian)) for b in jobs}) != 1:
        raise FqError("encode job: its blocks must be of one layer, with one Hessian")
    hess = _Hessians(jobs[0].hessian, jobs[0].layer)
    try:
        t_claim = time.perf_counter()
        dev = devices.claim(device, devices_list, lock_dir)
        t_claimed = time.perf_counter()
        if dev != "cpu":
            check_encoder(doc, dev)
        if timeline is not None:
            timeline.update(setup_s=time.perf_counter() - t0, claim_wait_s=t_claimed - t_claim, claimed=t_claimed,
                            device=dev, blocks=stats)
        waited = 0.0
        for batch in reader:
            if stats is not None:
                stats[batch[0][0]]["read_wait_s"] += reader.wait_s - waited
                waited = reader.wait_s
                for it in batch:
                    stats[it[0]].setdefault("start_s", time.perf_counter() - t0)
            mats, group_keys, where = [], [], []  # per matrix of the batch, in item and projection order
            for i, e, W, chains, parent in batch:
                b = jobs[i]
                for p in PROJECTIONS:
                    w, K = W[p], kbits.proj(b.K, p)
                    mats.append((w, chains[p], matrix_seed(seed, b.node, b.layer, e, p), hess.for_matrix(e, p),
                                 f"{b.node} layer {b.layer} expert {e} {p}"))
                    group_keys.append((K, b.codebook, w.shape[1]) if batch_bytes and _whole(w, dev) else None)
                    where.append((i, e, p, K, b.codebook))
            del w
            done = [None] * len(mats)
            for group in _groups(group_keys, bool(batch_bytes)):
                i0, _, _, K, cb = where[group[0]]
                t = time.perf_counter()
                if stats is not None:
                    _gap(timeline, stats[i0], t)
                results = encode_group([mats[j] for j in group], K, cb, dev)
                if stats is not None:
                    timeline["last_call_end"] = time.perf_counter()
                    for j in group:  # a batch's call is charged to its blocks by their matrices in it
                        stats[where[j][0]]["encode_s"] += (timeline["last_call_end"] - t) / len(group)
                for j, (enc, sum_sq_w) in zip(group, results):
                    m = {"sum_sq_w": enc.sum_sq_w if sum_sq_w is None else sum_sq_w, "sum_sq_err": enc.sum_sq_err,
                         "g_scale": enc.g_scale}
                    if enc.proxy_err is not None:
                        m["proxy_err"] = enc.proxy_err
                    p = where[j][2]
                    done[j] = (layout.stored(projections[p], enc.tensors), m)
                del results, enc
                bar.update(len(group))
                if pending is not None and pending.done():
                    pending.result()  # a failed commit fails the job now, with its own message
            del mats
            for (i, e, p, _, _), (stored, m) in zip(where, done):  # the fragment's order: item, then projection
                tensors.setdefault(i, {}).setdefault(e, {})[projections[p]] = stored
                metrics.setdefault(i, {}).setdefault(str(e), {})[p] = m
            del done
            for i, e, W, chains, parent in batch:
                reader.dispose(W)  # 150 MB of float32 an expert freed in the reader thread, not between two GPU calls
                left[i] -= 1
                if left[i]:
                    continue
                b = jobs[i]
                if stats is not None:
                    stats[i]["encoded_s"] = time.perf_counter() - t0
                if pending is not None:  # one block in the writer at a time: commits stay in block order
                    t = time.perf_counter()
                    summaries.append(pending.result())
                    if stats is not None:
                        stats[i]["write_wait_s"] += time.perf_counter() - t
                pending = writer.submit(_commit, b, tensors.pop(i), metrics.pop(i), parent, doc=doc, priv=priv,
                                        seed=seed, layout=layout, t0=t0, stats=stats[i] if stats is not None else None,
                                        bound=hess.bound)
            del batch, W, chains
        if pending is not None:
            t = time.perf_counter()
            summaries.append(pending.result())
            if timeline is not None:
                timeline["final_write_wait_s"] = time.perf_counter() - t
    except BaseException as e:
        writer.shutdown(wait=True)
        if pending is not None and pending.exception() not in (None, e):
            print(f"also failed: commit of {jobs[len(summaries)].name}: {pending.exception()}", file=sys.stderr)
        raise
    finally:
        bar.close()
        reader.close()
        writer.shutdown(wait=True)  # a commit under way finishes (it is a whole block) before the job exits
    if timeline is not None:
        timeline["wall_s"] = time.perf_counter() - t0
    return summaries


def encode_block(*, campaign_json: str, key_path: str, node: str, role: str, K: kbits.FragmentK, codebook: str,
                 node_digest: str,
                 layer: int, block: int, experts: list[int], sources: dict, ancestors: list[dict], out_fragment: str,
                 out_metrics: str, device: str, devices_list: list[int], lock_dir: str, seed: int, threads: int = 0,
                 layout: ExpertLayout, hessian: dict | None = None) -> dict:
    """One block as its own job (encode_blocks with one BlockJob); ``K`` a fragment spec (BlockJob.K)."""
    job = BlockJob(node=node, role=role, K=K, codebook=codebook, node_digest=node_digest, layer=layer, block=block,
                   experts=experts, sources=sources, ancestors=ancestors, out_fragment=out_fragment,
                   out_metrics=out_metrics, hessian=hessian)
    return encode_blocks([job], campaign_json=campaign_json, key_path=key_path, device=device,
                         devices_list=devices_list, lock_dir=lock_dir, seed=seed, threads=threads, layout=layout)[0]


def native_node(K: int, codebook: str) -> str:
    """The node name a one-pass comparison encode's tensors carry (``Campaign.native_tensors``)."""
    return f"native-K{K}-{codebook}"


def encode_native(*, K: int, codebook: str, layer: int, experts: list[int], sources: dict, out_metrics: str,
                  device: str, devices_list: list[int], lock_dir: str, seed: int, threads: int = 0,
                  out_tensors: str | None = None, layout: dict | None = None, block: int | None = None,
                  hessian: dict | None = None) -> dict:
    """A one-pass encode at K bits, for the report's comparison only: metrics, and with ``out_tensors`` the tensor
    sets (an unsigned fragment of node ``native_node(K, codebook)``, for fq eval: a comparison point measured at
    the model's output; nothing publishes it). The metrics file is written last: it says the job is done."""
    name = f"native-K{K}-{codebook}-{Path(out_metrics).stem}"
    outs = [out_metrics] + ([out_tensors] if out_tensors else [])
    take_block(lock_dir, name, outs, f"block {name} (one-pass K{K} {codebook}, layer {layer})")
    devices.check(device, devices_list)
    if threads:
        torch.set_num_threads(threads)
    W = read_source(sources)
    hess = _Hessians(hessian, layer)
    dev = devices.claim(device, devices_list, lock_dir)
    lay = ExpertLayout.from_json(layout) if layout is not None else None
    metrics, tensors = {}, {}
    for e in experts:
        for p in PROJECTIONS:
            w = W[e][p]
            enc, _ = encode_matrix(w, [], K, codebook, matrix_seed(seed, f"native-K{K}", layer, e, p), dev,
                                    hess.for_matrix(e, p), f"native K{K} layer {layer} expert {e} {p}")
            metrics.setdefault(str(e), {})[p] = {"sum_sq_w": enc.sum_sq_w, "sum_sq_err": enc.sum_sq_err}
            if enc.proxy_err is not None:
                metrics[str(e)][p]["proxy_err"] = enc.proxy_err
            if lay is not None:
                lp = dict(zip(PROJECTIONS, lay.projections))[p]
                tensors.setdefault(e, {})[lp] = lay.stored(lp, enc.tensors)
    if out_tensors:
        write_fragment(out_tensors, layout=lay, node=native_node(K, codebook), role="base", layer=layer, block=block,
                       K=K, codebook=codebook, experts=tensors)
    summary = {"native": True, "K": K, "codebook": codebook, "layer": layer,
               "objective": quant_args_for(K, codebook, seed, hess.bound)["objective"], "experts": metrics}
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary


def encode_weight_only(*, node: str, role: str, K: kbits.FragmentK, codebook: str, node_digest: str, layer: int,
                       block: int,
                       experts: list[int], sources: dict, ancestors: list[dict], out_tensors: str, out_metrics: str,
                       device: str, devices_list: list[int], lock_dir: str, seed: int, layout: dict,
                       threads: int = 0) -> dict:
    """The weight-only twin of node ``node``'s fragment of one block (calibration.compare_weight_only), for fq eval
    only: the same experts, K, codebook and seeds (``matrix_seed`` of the real node) as the calibrated encode, but
    no Hessian, and a stage's residual taken against its ancestors' *twins* (``ancestors``: [{node, codebook,
    path}] of the twin fragments, base first), so the whole chain is weight-only. Writes an unsigned fragment of
    node ``node`` (same layout and metadata as the real one; nothing publishes or attests it), then the metrics
    (written last: the job is done). ``K``: the node's fragment spec at ``layer`` (BlockJob.K)."""
    K = kbits.fragment(K, f"weight-only {node} layer {layer} block {block}: K")
    name = f"weight-only-{Path(out_tensors).stem}"
    outs = [out_tensors, out_metrics]
    take_block(lock_dir, name, outs, f"block {name} (weight-only twin of {node}, layer {layer}, block {block})")
    devices.check(device, devices_list)
    if threads:
        torch.set_num_threads(threads)
    lay = ExpertLayout.from_json(layout)
    W = read_source(sources)
    parents = [load_sets(Path(a["path"]), lay, layer, experts, a["codebook"]) for a in ancestors]
    dev = devices.claim(device, devices_list, lock_dir)
    projections = dict(zip(PROJECTIONS, lay.projections))
    metrics, tensors = {}, {}
    for e in experts:
        for p in PROJECTIONS:
            enc, sum_sq_w = encode_matrix(W[e][p], [sets[e][p] for sets in parents], kbits.proj(K, p), codebook,
                                           matrix_seed(seed, node, layer, e, p), dev, None,
                                           f"weight-only {node} layer {layer} expert {e} {p}")
            metrics.setdefault(str(e), {})[p] = {"sum_sq_w": enc.sum_sq_w if sum_sq_w is None else sum_sq_w,
                                                 "sum_sq_err": enc.sum_sq_err, "g_scale": enc.g_scale}
            tensors.setdefault(e, {})[projections[p]] = lay.stored(projections[p], enc.tensors)
            del enc
    write_fragment(out_tensors, layout=lay, node=node, role=role, layer=layer, block=block, K=K, codebook=codebook,
                   experts=tensors)
    summary = {"weight_only": True, "node": node, "node_digest": node_digest, "layer": layer, "block": block,
               "K": kbits.to_json(K),
               "codebook": codebook, "fragment": Path(out_tensors).name,
               "objective": quant_args_for(K, codebook, seed, None)["objective"], "experts": metrics}
    atomic.write_text(out_metrics, canonical.pretty(summary))
    return summary
