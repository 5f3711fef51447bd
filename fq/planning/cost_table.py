"""Measure a cost table (fq-cost-table/1) on the device at hand by timing the encoder.

Each entry is the median wall time of ``quantize(W, K, codebook, device=...)`` on a seeded
Gaussian matrix of a given (out, in) shape, after warm-up runs (kernel compilation, caches). On
CUDA the clock is read after a device synchronize, so queued work is counted. The default
shapes are GLM-5's expert matrices (gate/up 2048x6144, down 6144x2048); measure on the shapes
of the model you will price, or pricing scales per tile from other shapes.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Sequence

from fq.core.units import is_decimal
from fq.errors import FqError
from fq.planning.price import TABLE_FORMAT
from fq.planning.recipe import CODEBOOKS

DEFAULT_SHAPES = ((2048, 6144), (6144, 2048))


def measure(quantize: Callable, *, ks: Sequence[int], codebooks: Sequence[str], shapes: Sequence[tuple[int, int]],
            device: str, repeats: int = 3, warmup: int = 1, seed: int = 0,
            synchronize: Callable[[], None] | None = None, clock: Callable[[], float] = time.perf_counter) -> list[dict]:
    """Cost-table entries measured with ``quantize`` (fq.codec.quantize's signature)."""
    import torch

    if repeats < 1 or warmup < 0:
        raise FqError(f"cost table: repeats must be >= 1 and warmup >= 0 (got {repeats}, {warmup})")
    for K in ks:
        if not (isinstance(K, int) and 1 <= K <= 8):
            raise FqError(f"cost table: K {K!r} out of range (1..8)")
    for cb in codebooks:
        if cb not in CODEBOOKS:
            raise FqError(f"cost table: codebook {cb!r} is not one of {', '.join(CODEBOOKS)}")
    for out_f, in_f in shapes:
        if out_f % 128 or in_f % 128 or out_f <= 0 or in_f <= 0:
            raise FqError(f"cost table: shape {out_f}x{in_f} is not a multiple of 128 in both dims (a cost table is "
                          "keyed by the stored shape: a matrix's dims zero-padded to multiples of 128)")
    sync = synchronize or (lambda: None)
    entries = []
    for out_f, in_f in shapes:
        gen = torch.Generator().manual_seed(seed)
        W = torch.randn(out_f, in_f, generator=gen, dtype=torch.float32)
        for cb in codebooks:
            for K in ks:
                for _ in range(warmup):
                    quantize(W, K, codebook=cb, seed=seed, device=device)
                sync()
                samples = []
                for _ in range(repeats):
                    t0 = clock()
                    quantize(W, K, codebook=cb, seed=seed, device=device)
                    sync()
                    samples.append(clock() - t0)
                entries.append({"codebook": cb, "K": K, "shape": [out_f, in_f],
                                "seconds": round(statistics.median(samples), 6), "origin": "measured",
                                "basis": f"fq cost-table: median of {repeats} timed runs after {warmup} warm-up, "
                                         f"fq.codec.quantize on {device}",
                                "samples": [round(s, 6) for s in samples]})
    entries.sort(key=lambda e: (e["codebook"], e["K"], e["shape"]))
    return entries


def table_section(entries: list[dict], encoder: str, measured_with: dict) -> dict:
    return {"encoder": encoder, "model": "every entry measured whole by fq cost-table (no model)",
            "measured_with": measured_with, "entries": entries}


def merge_table(existing: dict | None, gpu: str, section: dict) -> dict:
    """A cost table holding ``section`` for ``gpu``, keeping the other GPU models of ``existing``."""
    doc = {"format": TABLE_FORMAT,
           "description": "Seconds per matrix pass by codebook, K and shape (torch (out, in)), per GPU model.",
           "gpus": {}}
    if existing is not None:
        doc.update({k: v for k, v in existing.items() if k != "gpus"})
        doc["gpus"] = dict(existing["gpus"])
    doc["gpus"][gpu] = section
    return doc


def parse_ks(spec: str) -> list[int]:
    from fq.core.layer_ranges import parse_ranges

    out = sorted({k for a, b in parse_ranges(spec, "--k", unit="K", example="1-4,8") for k in range(a, b + 1)})
    bad = [k for k in out if not 1 <= k <= 8]
    if bad:
        raise FqError(f"--k {spec!r}: K {bad[0]} out of range (1..8)")
    return out


def parse_shapes(spec: str) -> list[tuple[int, int]]:
    out = []
    for token in [t for t in spec.replace(" ", ",").split(",") if t]:
        parts = token.lower().split("x")
        if len(parts) != 2 or not all(is_decimal(p) for p in parts):
            raise FqError(f"--shape {spec!r}: {token!r} is not OUTxIN (e.g. 2048x6144)")
        out.append((int(parts[0]), int(parts[1])))
    if not out:
        raise FqError("--shape: empty; expected OUTxIN[,OUTxIN...]")
    return out
