#!/usr/bin/env python3
"""fq price's calibration chain against a rehearsal run's measured jobs (issue 43), and the rates that fit them.

    python3 benchmarks/calib_price_fit.py DIR [--calibration 250x2048] [--recipe recipes/rehearsal-glm5.json] [--fit]

DIR is what benchmarks/rehearsal_device.sh's collect step brought back (benchmarks/rehearsal_report.py reads the same).
The source is rebuilt as metadata from plan.json's dims (fq.model.rehearsal.write_metadata: config.json, the index,
sizes.json) and must have the run's revision (the same config and index), else the script stops. Per chain job
(embed, every layer, head): its counted FLOPs and bytes (fq.planning.calibration_cost.price_chain), its measured wall
less its wait for the GPU lock against the priced wall, and for the jobs with a CUDA process (nvidia-smi's per-process
samples, matched to the jobs in chain order) its time on the GPU against the priced GPU seconds. ``--fit``: the read,
write and FLOP rates that fit those walls and GPU times best (least squares of the relative errors, the setup held at
``--setup-s``: a run of a few jobs cannot tell it from the IO), and the table again at them.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import rehearsal_report as report  # noqa: E402

from fq.errors import FqError  # noqa: E402

CUDA_SCRIPTS = {"layer": "calib_layer", "head": "calib_head"}


def measured(d: Path) -> dict:
    """chain job name (as ChainJob.name) -> {"wall_s": wall less the GPU wait, "gpu_s": time on the GPU or None}."""
    out = {}
    for j in report.jobs(d):
        if not j["job"].startswith("calibration/") or j["job"] == "calibration/tokens":
            continue
        leaf = j["job"].removeprefix("calibration/")
        name = f"layer {int(leaf.removeprefix('layer'))}" if leaf.startswith("layer") else leaf
        out[name] = {"wall_s": j["wall_s"] - (j["gpu_wait_s"] or 0.0), "gpu_s": None}
    procs = sorted(report.gpu_processes(d).values(), key=lambda p: p["first"]) if (d / "pids.tsv").is_file() else []
    for kind, script in CUDA_SCRIPTS.items():
        names = sorted((n for n in out if n.startswith(kind)), key=lambda n: int(n.split()[-1]) if " " in n else 0)
        spans = [p["last"] - p["first"] for p in procs if p["script"] == script]
        if len(spans) == len(names):  # one CUDA process a job, in chain order (a killed job's breaks the match)
            for n, s in zip(names, spans):
                out[n]["gpu_s"] = s
    return out


def source_of(d: Path, where: Path):
    """The run's source as metadata (plan.json's dims at GLM-5's widths), checked against its revision."""
    from fq.model import rehearsal
    from fq.model.source import load_sizes, load_source

    src = json.loads((d / "plan.json").read_text())["source"]
    dims = replace(rehearsal.GLM5, experts=src["n_experts"], dense_layers=len(src["dense_layers"]),
                   moe_layers=len(src["moe_layers"]))
    dims = replace(dims, top_k=min(dims.top_k, dims.experts))
    rehearsal.write_metadata(where, dims)
    source = load_source(where, sizes=load_sizes(where / "sizes.json"))
    if source.revision != src["revision"]:
        raise FqError(f"{d}/plan.json: source revision {src['revision']}, but GLM-5's widths at {dims.experts} "
                      f"experts, {dims.dense_layers} + {dims.moe_layers} layers make {source.revision}: not a "
                      "full-width rehearsal (or another shard size)")
    return source


def table(chain, got: dict) -> list[str]:
    lines = ["| job | PFLOP | read GB | written GB | measured wall s | priced s | error | on the GPU s | "
             "priced GPU s |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for j in chain.jobs:
        m = got.get(j.name, {})
        wall, gpu = m.get("wall_s"), m.get("gpu_s")
        err = f"{100 * (j.seconds / wall - 1):+.0f}%" if wall else ""
        lines.append(f"| {j.name} | {j.flops / 1e15:.3f} | {j.read_bytes / 1e9:.1f} | {j.written_bytes / 1e9:.1f} | "
                     f"{'' if wall is None else f'{wall:.0f}'} | {j.seconds:.0f} | {err} | "
                     f"{'' if gpu is None else f'{gpu:.0f}'} | {j.gpu_seconds:.0f} |")
    return lines


def fit(chain, got: dict, setup_s: float) -> dict:
    """read_mb_s, write_mb_s, tflops minimizing the relative errors of the walls (less setup) and GPU times."""
    import numpy as np

    rows, ys = [], []
    for j in chain.jobs:
        m = got.get(j.name)
        if m is None:
            continue
        rows.append([j.read_bytes / m["wall_s"], j.written_bytes / m["wall_s"], j.flops / m["wall_s"]])
        ys.append(1 - setup_s / m["wall_s"])
        if m["gpu_s"] and j.kind != "head":  # the head's seconds on the GPU are its CUDA start, not its work
            rows.append([0.0, j.written_bytes / m["gpu_s"], j.flops / m["gpu_s"]])
            ys.append(1.0)
    (r, w, f), *_ = np.linalg.lstsq(np.array(rows), np.array(ys), rcond=None)
    return {"read_mb_s": 1e-6 / r, "write_mb_s": 1e-6 / w, "tflops": 1e-12 / f, "setup_s": setup_s}


def main(argv=None) -> int:
    from fq.planning.calibration_cost import DEFAULT_SETUP_S, price_calibration, price_chain
    from fq.planning.recipe import load_recipe

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--calibration", default="250x2048", metavar="ROWSxCOLS")
    p.add_argument("--recipe", type=Path, default=ROOT / "recipes" / "rehearsal-glm5.json")
    p.add_argument("--fit", action="store_true", help="also fit the read, write and FLOP rates")
    p.add_argument("--setup-s", type=float, default=DEFAULT_SETUP_S, help="the setup held in the fit")
    a = p.parse_args(argv)
    rows, _, cols = a.calibration.partition("x")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            source = source_of(a.dir, Path(tmp))
            recipe = load_recipe(a.recipe)
            chain = price_chain(price_calibration(source, int(rows), int(cols)), source, recipe)
            got = measured(a.dir)
            print("at the defaults:")
            print("\n".join(table(chain, got)))
            if a.fit:
                rates = fit(chain, got, a.setup_s)
                print("\nfitted: " + ", ".join(f"{k} {v:.1f}" for k, v in rates.items()))
                chain = price_chain(price_calibration(source, int(rows), int(cols), **rates), source, recipe)
                print("\n".join(table(chain, got)))
    except FqError as e:
        print(f"calib_price_fit: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
