"""The campaign's allocation jobs (budgeted bases, recipe ``bits``): sensitivity, then allocate.

- ``sensitivity_job``: every allocation unit of the source measured on the calibration text (``measure``, as
  ``fq allocate`` runs it: each unit's LDLQ-shaped error injected at a few K and the output's KL measured, the curve
  read at every candidate K; and each linear's Fisher quadratic form in the same direction, for the experts a
  budgeted stage buys), written as fq-allocation/1 without allocations. Streamed (fq.allocation.streamed): one
  decoder layer's weights in memory at a time, read from the source's shards as the calibration chain reads them;
  the same document as the in-memory measurement ``fq allocate`` runs.
- ``allocate_job``: the allocation at every budget the recipe names, solved from it (fq.allocation.solve: pure, the
  optimality certificate with each). Its output is the file the campaign's plan reads on the next run.

Both write canonical JSON atomically; the same inputs give the same bytes.
"""
from __future__ import annotations

import hashlib
import sys
from pathlib import Path

from fq.allocation.document import FORMAT, METHOD, SENSITIVITY
from fq.core import atomic, canonical


def measure(model_dir, text: str, *, codebook: str = "mul1", ks=None, rows: int = SENSITIVITY["rows"],
            columns: int = SENSITIVITY["columns"], samples: int = SENSITIVITY["samples"],
            seed: int = SENSITIVITY["seed"], progress=None, streamed: bool = False, stream_bytes: int | None = None,
            report=None, device: str = "cpu") -> dict:
    """Measure every allocation unit of the checkpoint at ``model_dir`` on ``text`` (rows x columns tokens), at
    candidate ``ks`` (default: every K of the codebook, fq.allocation.error_model.candidate_ks). ``streamed``: one
    decoder layer in memory at a time (fq.allocation.streamed; ``stream_bytes`` caps the injection streams,
    ``progress(what, done, total)`` per layer visit, ``report(fit["streamed"])`` once), else the whole model
    (transformers, on the CPU; ``progress(done, total)``); the same document either way. ``device``: where the
    streamed layers run."""
    import torch

    from fq.allocation.error_model import candidate_ks
    from fq.runtime.evaluate import tokenize
    from fq.runtime.quality import token_windows

    ks = candidate_ks(codebook) if ks is None else ks
    ids, tok_sha = tokenize(Path(model_dir), text)
    windows = token_windows(ids, columns, rows * columns)
    if streamed:
        from fq.allocation import streamed as streamed_mod

        extra = {} if stream_bytes is None else {"stream_bytes": stream_bytes}
        options, weights, sens, fit = streamed_mod.unit_options(model_dir, windows, list(ks), codebook,
                                                                samples=samples, seed=seed, progress=progress,
                                                                device=device, **extra)
        if report is not None:
            report(fit["streamed"])
    else:
        from transformers import AutoModelForCausalLM

        from fq.allocation.measure import unit_options

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        options, weights, sens, fit = unit_options(model, windows, list(ks), codebook, samples=samples, seed=seed,
                                                   progress=progress)
        del model
    return _document(model_dir, text, tok_sha, codebook, ks, rows, columns, samples, seed, options, weights, sens,
                     fit)


def _document(model_dir, text: str, tok_sha: str, codebook: str, ks, rows: int, columns: int, samples: int,
              seed: int, options: dict, weights: int, sens, fit: dict) -> dict:
    """The fq-allocation/1 document of a measurement, without allocations."""
    import torch

    from fq.allocation import units

    config = Path(model_dir, "config.json").read_bytes()
    # each routed expert's own quadratic forms (gate+up, down), per layer: what a budgeted stage ranks experts by
    experts: dict = {}
    for name, stat in sens.linears.items():
        unit = units.unit_of(name)
        if unit.kind in ("routed_gate_up", "routed_down"):
            e = units.expert_of(name)
            q = experts.setdefault(f"L{unit.layer}", {}).setdefault(str(e), {"gate_up": 0.0, "down": 0.0})
            q["gate_up" if unit.kind == "routed_gate_up" else "down"] += stat.quad[0] / (2 * sens.positions)
    return {"format": FORMAT, "codebook": codebook, "ks": sorted(ks),
            "model": {"config_sha256": hashlib.sha256(config).hexdigest(), "tokenizer_sha256": tok_sha},
            "calibration": {"text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(), "rows": rows,
                            "columns": columns, "positions": sens.positions, "samples": samples, "seed": seed},
            "method": METHOD,
            "weights": weights,
            "units": {u: {str(K): {"predicted_kl": kl, "bytes": by} for K, (kl, by) in o.items()}
                      for u, o in options.items()},
            "injected": {u: {str(K): kl for K, kl in p.items()} for u, p in fit["injected"].items()},
            "parts": {u: {str(K): list(v) for K, v in p.items()} for u, p in fit["parts"].items()},
            "efficiency": {str(K): c for K, c in fit["efficiency"].items()},
            "distortion": {str(K): v for K, v in fit["distortion"].items()},
            "experts": {L: dict(sorted(ex.items(), key=lambda kv: int(kv[0]))) for L, ex in
                        sorted(experts.items(), key=lambda kv: int(kv[0][1:]))},
            "allocations": [],
            "versions": {"torch": torch.__version__}}


def sensitivity_job(model_dir: str, text_path: str, out: str, *, codebook: str, rows: int, columns: int,
                    samples: int, seed: int, ks=None, threads: int = 1, stream_bytes: int | None = None,
                    device: str = "cpu", devices_list=(), lock_dir: str | None = None) -> None:
    """The campaign's measurement, streamed (fq.allocation.streamed: one decoder layer's weights in memory at a
    time, the injection streams under ``stream_bytes``), so that a source larger than this machine's memory is
    measured; a progress bar over the layer visits, and a log line per visit when stderr is not a terminal.
    ``device`` (the campaign's encode device): a GPU claimed as the calibration jobs claim one."""
    import torch
    from tqdm import tqdm

    from fq.workflow import devices

    torch.set_num_threads(max(1, threads))
    text = Path(text_path).read_text(encoding="utf-8")
    tty = sys.stderr.isatty()
    bar = tqdm(desc="sensitivity", unit="layer", file=sys.stderr, disable=not tty)  # a log file gets lines

    def progress(what, done, total):
        bar.total = total
        bar.update(1)
        if not tty:
            print(f"sensitivity: {done}/{total} {what}", file=sys.stderr, flush=True)

    def report(streamed):
        print(f"sensitivity: {streamed['layer_reads']} layer reads, injection in {streamed['passes']} "
              f"pass{'es' if streamed['passes'] != 1 else ''}", file=sys.stderr)

    dev = devices.claim(device, list(devices_list), lock_dir) if device != "cpu" else "cpu"
    doc = measure(Path(model_dir), text, codebook=codebook, ks=None if ks is None else tuple(ks), rows=rows,
                  columns=columns, samples=samples, seed=seed, progress=progress, streamed=True,
                  stream_bytes=stream_bytes, report=report, device=dev)
    bar.close()
    atomic.write_text(out, canonical.pretty(doc))
    print(f"{out}: {len(doc['units'])} units measured on {doc['calibration']['positions']} positions",
          file=sys.stderr)


def allocate_job(sensitivity: str, budgets, out: str) -> None:
    from fq.allocation import document

    doc = document.with_allocations(document.load(sensitivity), budgets)
    atomic.write_text(out, canonical.pretty(doc))
    for a in doc["allocations"]:
        print(f"{a['budget_bits']:g} bits: {a['bits']:.4f} bits stored, predicted KL {a['predicted_kl']:.6g} "
              f"(within {a['gap_bound']:.2g} of the optimum): "
              + ", ".join(f"{u} K{k}" for u, k in a["ks"].items()), file=sys.stderr)
