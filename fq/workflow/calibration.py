"""The campaign's calibration chain (config ``calibration:``): tokens → embeddings → the source model layer by layer,
each calibrated MoE layer writing its Hessian file, which the layer's encode jobs read.

One job per step, each a file target (rules/calibrate.smk):
- ``tokens_job``: the calibration text (sha256-checked) tokenized with the source's tokenizer, or a token file,
  cut into rows × columns → ``calibration/tokens.safetensors``;
- ``embed_job``: the tokens' embeddings → ``calibration/hidden-embed.safetensors`` (temp);
- ``layer_job``: hidden states through one decoder layer of the source (transformers' own module, weights read
  from the staged shards, each shard's sha256 the one init recorded) → the next hidden states (temp) and, for a
  calibrated MoE layer, ``calibration/hessian-layerLLL.safetensors`` (``fq.hessian``).

**The binding.** A Hessian is an input of every fragment of its layer, as the source bytes are. The first capture
of a layer writes ``calibration/hessian-layerLLL.bound.json`` (its sha256, the token digest, the capture mode,
and the router-affinity weighting where the campaign sets one: ``calibration.weighting``, fq.hessian.affinity);
a later capture of that layer (a resume that lost the file, another machine) must give the same bytes or it is
refused, and nothing replaces the bound file. An encode job refuses a Hessian file whose sha256 is not the bound
one, and names that sha256 in every fragment's attestation (``quant_args.hessian``); finalize refuses a fragment
whose attested Hessian is not the layer's bound one. So a campaign never mixes fragments of one layer encoded
against two different Hessians, on whatever machines its jobs ran.
"""
from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path

from fq.core import atomic, canonical
from fq.errors import FqError
from fq.workflow import devices
from fq.workflow.common import recorded_shards

BINDING_FORMAT = "fq-hessian-binding/1"


def tokens_job(*, out: str, rows: int, cols: int, sha256: str | None, text: str | None = None,
               tokens: str | None = None, tokenizer_dir: str | None = None) -> dict:
    from fq.hessian import calibration

    if tokens:
        cal = calibration.from_tokens(tokens, rows, cols, sha256=sha256)
    else:
        if sha256 is None:  # the demo's own split: whatever the demo_model rule wrote is what is bound
            from fq.core.safepath import sha256_file

            sha256 = sha256_file(text)
        cal = calibration.from_text(text, sha256, tokenizer_dir, rows, cols)
    calibration.save_tokens(out, cal)
    return {"digest": cal.digest, "rows": cal.rows, "cols": cal.cols}


def _checkpoint(source_dir: str, staging: str):
    """The source checkpoint's config and weight map, its shards read from the staging directory."""
    from fq.hessian import layer as layer_mod

    return dataclasses.replace(layer_mod.read_checkpoint(source_dir), dir=Path(staging))


def embed_job(*, campaign_json: str, source_dir: str, staging: str, tokens: str, out_hidden: str, out_record: str,
              rows: int, cols: int) -> None:
    from fq.hessian import calibration, capture

    t0 = time.perf_counter()
    cal = calibration.from_tokens(tokens, rows, cols)
    digest = capture.capture_embed(_checkpoint(source_dir, staging), cal, out_hidden,
                                   sha256=recorded_shards(campaign_json))
    atomic.write_text(out_record, canonical.pretty({"step": "embed", "calibration": cal.digest,
                                                    "hidden_sha256": digest,
                                                    "seconds": round(time.perf_counter() - t0, 3)}))


def read_binding(path: str | os.PathLike) -> dict | None:
    p = Path(path)
    if not p.exists():
        return None
    doc = canonical.load(p)
    if not isinstance(doc, dict) or doc.get("format") != BINDING_FORMAT or not isinstance(doc.get("sha256"), str):
        raise FqError(f"{p}: not a {BINDING_FORMAT} record (format, sha256)")
    return doc


def _bind(tmp: str, out: str, binding: str, sha256: str, what: str, fields: dict) -> None:
    """Move a captured file from ``tmp`` to ``out`` if it is the bound one (or the first: then bind it)."""
    bound = read_binding(binding)
    if bound is not None and bound["sha256"] != sha256:
        raise FqError(f"{out}: this capture gave sha256 {sha256}, but the campaign bound {what} to {bound['sha256']} "
                      f"({binding}) and may have encoded fragments against it; to re-calibrate, delete its "
                      f"fragments and {binding}")
    os.replace(tmp, out)
    atomic.fsync_dir(Path(out).parent)
    if bound is None:
        atomic.write_text(binding, canonical.pretty({"format": BINDING_FORMAT, "file": Path(out).name,
                                                     "sha256": sha256, **fields}))


def _late_claim(device: str, devices_list: list[int], lock_dir: str):
    """"cpu", or the GPU claim as a callable the capture calls once its inputs are read (``capture._device``): the
    request is checked now, the GPU taken only when there is work for it."""
    if device == "cpu":
        return "cpu"
    devices.check(device, devices_list)
    return lambda: devices.claim(device, devices_list, lock_dir)


def _capture_name(out: str | None) -> str | None:
    return None if out is None else str(Path(out).with_name(f".capture-{Path(out).name}"))


def layer_job(*, campaign_json: str, source_dir: str, staging: str, layer: int, hidden_in: str, out_hidden: str,
              out_record: str, out_hessian: str | None, binding: str | None, capture: str, device: str,
              devices_list: list[int], lock_dir: str, threads: int = 1, linears=(), out_linears: str | None = None,
              linear_binding: str | None = None, weighting: str = "none") -> dict:
    """One decoder layer of the chain; a calibrated MoE layer's Hessian (and, for a whole-model base, the layer's
    linear Hessians: ``linears``) go to a temporary name first, and replace their outputs only when they are the
    bound ones (or the first). ``capture``: the config's capture mode, all-experts or routed-only; ``weighting``:
    its calibration.weighting (the expert Hessians only; the linears' are never weighted)."""
    from fq.hessian import capture as capture_mod

    t0 = time.perf_counter()
    dev = _late_claim(device, devices_list, lock_dir)
    tmp, tmp_lin = _capture_name(out_hessian), _capture_name(out_linears)
    try:
        result = capture_mod.capture_layer(_checkpoint(source_dir, staging), layer, hidden_in, out_hidden, tmp,
                                       sha256=recorded_shards(campaign_json),
                                       routed_only=capture == "routed-only", device=dev, threads=threads,
                                       linears=tuple(linears), out_linears=tmp_lin, weighting=weighting)
        record = {"step": "layer", "layer": layer, "hidden_sha256": result.hidden_sha256,
                  "hessian_sha256": result.hessian_sha256 or None, "source_shards": result.source_shards}
        if out_hessian is not None:
            from fq.hessian import store

            h = store.read_hessians(tmp, expect_sha256=result.hessian_sha256)
            _bind(tmp, out_hessian, binding, result.hessian_sha256, f"layer {layer}'s Hessian",
                  {"layer": layer, "calibration": h.meta.get("calibration"), "capture": capture,
                   **weighted(h.weighting)})
            tmp = None
        if out_linears is not None:
            record["linears_sha256"] = result.linears_sha256
            _bind(tmp_lin, out_linears, linear_binding, result.linears_sha256, f"layer {layer}'s linear Hessians",
                  {"layer": layer, "calibration": _calibration_digest(hidden_in), "capture": capture})
            tmp_lin = None
        record["seconds"] = round(time.perf_counter() - t0, 3)
        atomic.write_text(out_record, canonical.pretty(record))
        return record
    finally:
        for t in (tmp, tmp_lin):
            if t is not None and Path(t).exists():
                os.unlink(t)


def _calibration_digest(hidden: str) -> str:
    """The token digest a hidden-state file was made from (its metadata)."""
    from fq.model.shards import read_header

    with open(hidden, "rb") as fh:
        return read_header(fh, hidden).metadata["calibration"]


def head_job(*, campaign_json: str, key_path: str, source_dir: str, skeleton: list[str], hidden_in: str,
             out_linears: str, out_record: str, binding: str, capture: str, device: str, devices_list: list[int],
             lock_dir: str, threads: int = 1) -> dict:
    """The head's input Hessian: the last decoder layer's output through the final norm (``capture.capture_head``).
    The norm is read from the committed skeleton (``skeleton``: its shards, each verified under the campaign key
    first): the source shard holding it may have retired with its window long before the chain ends."""
    from fq.hessian import capture as capture_mod
    from fq.provenance.attest import keys
    from fq.provenance.attest.fragment import verify_shard

    t0 = time.perf_counter()
    doc = canonical.load(campaign_json)
    pub = keys.load_private(key_path).public_key()
    dirs = {str(Path(s).parent) for s in skeleton}
    if len(dirs) != 1:
        raise FqError(f"head calibration: skeleton shards {skeleton} are not in one directory")
    for s in skeleton:
        verify_shard(Path(s).parent, Path(s).name, pub, campaign=doc["identity"])
    dev = _late_claim(device, devices_list, lock_dir)
    tmp = _capture_name(out_linears)
    try:
        sha = capture_mod.capture_head(_checkpoint(source_dir, dirs.pop()), hidden_in, tmp, device=dev, threads=threads)
        _bind(tmp, out_linears, binding, sha, "the head's Hessian",
              {"layer": None, "calibration": _calibration_digest(hidden_in), "capture": capture})
        tmp = None
        record = {"step": "head", "linears_sha256": sha, "seconds": round(time.perf_counter() - t0, 3)}
        atomic.write_text(out_record, canonical.pretty(record))
        return record
    finally:
        if tmp is not None and Path(tmp).exists():
            os.unlink(tmp)


def check_weighting(bound: dict, weighting: str, binding: str, layer: int) -> None:
    """The bound Hessian was captured with the campaign's calibration.weighting: a campaign whose setting changed
    after its capture does not encode (or publish) against the other weighting's Hessian."""
    had = bound.get("weighting", "none")
    if had != weighting:
        raise FqError(f"{binding}: layer {layer}'s Hessian was captured with calibration.weighting {had}, the campaign "
                      f"now says {weighting}; to re-calibrate, delete the layer's fragments, its Hessian file and "
                      f"{binding}")


def bound_hessians(path: str, binding: str, layer: int, weighting: str = "none"):
    """The layer's Hessian file, read only if its sha256 is the one the campaign bound (encode jobs) and it was
    captured with ``weighting``."""
    from fq.hessian import store

    bound = read_binding(binding)
    if bound is None:
        raise FqError(f"{binding}: layer {layer} has no bound Hessian (its calibration job has not run)")
    check_weighting(bound, weighting, binding, layer)
    h = store.read_hessians(path, expect_sha256=bound["sha256"])
    if h.layer != layer:
        raise FqError(f"{path}: a Hessian of layer {h.layer}, expected layer {layer}")
    return h, bound


def bound_linear_hessians(path: str, binding: str, layer: int | None):
    """A layer's (None: the head's) linear Hessians, read only if the file's sha256 is the bound one (linear jobs)."""
    from fq.hessian import linear_store

    bound = read_binding(binding)
    what = "the head" if layer is None else f"layer {layer}"
    if bound is None:
        raise FqError(f"{binding}: {what} has no bound linear Hessians (its calibration job has not run)")
    return linear_store.read_linear_hessians(path, expect_sha256=bound["sha256"]), bound


def weighted(weighting: str) -> dict:
    """``{"weighting": ...}`` for a weighted Hessian, {} for an unweighted one: a binding and an attestation name the
    weighting only where there is one, so that theirs are the bytes they were before the option."""
    return {} if weighting == "none" else {"weighting": weighting}


def quant_hessian(bound: dict) -> dict:
    """What a fragment's attestation says of the Hessian it was encoded against (``quant_args.hessian``)."""
    return {"file": bound["file"], "sha256": bound["sha256"], "calibration": bound["calibration"],
            "capture": bound["capture"], **weighted(bound.get("weighting", "none"))}
