#!/usr/bin/env python3
"""Does the calibration chain serialize a campaign? The timeline of a calibrated demo campaign (issue 18).

    python3 benchmarks/calib_timeline.py --work DIR [--device cpu|cuda --devices 0,1] [--cores N]
           [--windows-on-disk 1,2] [--target published.verified] [--greedy] [--json OUT.json] [--png OUT.png]

Runs the demo campaign (config/config.yaml: calibrated, layers 1 and 2 are the MoE layers, windows "1,2") once per
``--windows-on-disk`` value W, without the native points, the weight-only twins and the eval (they add jobs, not
dependencies), with one signer key. Each job's interval comes from its Snakemake benchmark file: end = the file's
mtime (Snakemake writes it when the job ends), start = end − its wall seconds. Then, per MoE layer L with a
calibrated layer L+1: how long calibrating L+1 ran while an encode of layer L was running.

With W = 1 the window holding layer 2 is staged only after window 1 retired, so layer 2's calibration (which reads
layer 2's staged weights) waits for every encode of layer 1: no overlap, by the windows' design. With W >= 2 the next
window is staged while the first is encoded, and the chain runs ahead: calib(L+1) starts as soon as calib(L) is done,
beside layer L's encodes. On CUDA (``--device cuda``) with one GPU the calibration and the encodes still take turns
on that GPU (one job per GPU, fq.workflow.devices); with two GPUs they run on both at once. Exit status 1 if W >= 2
shows no overlap.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
KINDS = [  # benchmark file (relative to OUT/benchmarks) -> (kind, node, layer)
    (re.compile(r"calibration/layer(\d+)\.tsv"), lambda m: ("calibrate", "", int(m[1]))),
    (re.compile(r"calibration/(tokens|embed)\.tsv"), lambda m: ("calibrate", m[1], -1)),
    (re.compile(r"encode/(.+)-layer(\d+)(?:-block\d+)?\.tsv"), lambda m: ("encode", m[1], int(m[2]))),
    (re.compile(r"stage/(.+)\.tsv"), lambda m: ("stage", m[1], -1)),
    (re.compile(r"retire/window-(\d+)\.tsv"), lambda m: ("retire", m[1], -1)),
]


def jobs(bench: Path) -> list[dict]:
    out = []
    for f in sorted(bench.rglob("*.tsv")):
        rel = f.relative_to(bench).as_posix()
        lines = f.read_text().splitlines()
        if len(lines) < 2:
            continue
        wall = float(lines[-1].split("\t")[0])
        end = f.stat().st_mtime
        kind, node, layer = "other", rel, -1
        for pat, fn in KINDS:
            m = pat.fullmatch(rel)
            if m:
                kind, node, layer = fn(m)
                break
        out.append(dict(job=rel.removesuffix(".tsv"), kind=kind, node=node, layer=layer, start=end - wall, end=end))
    t0 = min(j["start"] for j in out)
    for j in out:
        j["start"], j["end"] = round(j["start"] - t0, 3), round(j["end"] - t0, 3)
    return sorted(out, key=lambda j: j["start"])


def union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def overlap(a: tuple[float, float], spans: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(a[1], b) - max(a[0], s)) for s, b in spans)


def run_campaign(work: Path, W: int, args, key: Path | None) -> tuple[list[dict], float]:
    d = work / f"w{W}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg.update(out=str(d / "campaign"), windows_on_disk=W, compare_native=False, eval=None,
               recipe=str(ROOT / cfg["recipe"]))
    cfg["calibration"]["compare_weight_only"] = False
    cfg["encode"].update(device=args.device, devices=[int(x) for x in args.devices.split(",")] if args.devices else [])
    if key is not None:
        cfg["signer_key"] = str(key)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(d), "--configfile",
           str(d / "config.yaml"), "--cores", str(args.cores), *[str(d / "campaign" / t) for t in args.target]]
    if args.greedy:
        cmd += ["--scheduler", "greedy"]
    if args.device == "cuda":
        cmd += ["--profile", str(ROOT / "profiles" / "local-gpu"), "--resources",
                f"gpu={2 * len(cfg['encode']['devices'])}"]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    t = time.perf_counter()
    with open(d / "snakemake.log", "w") as log:
        rc = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - t
    if rc:
        tail = (d / "snakemake.log").read_text(errors="replace")[-4000:]
        raise SystemExit(f"W={W}: snakemake exited {rc}; {d / 'snakemake.log'} ends:\n{tail}")
    return jobs(d / "campaign" / "benchmarks"), wall


def analyse(js: list[dict]) -> list[dict]:
    calib = {j["layer"]: (j["start"], j["end"]) for j in js if j["kind"] == "calibrate" and j["layer"] >= 0}
    rows = []
    for L in sorted(calib):
        if L + 1 not in calib:
            continue
        enc = [(j["start"], j["end"]) for j in js if j["kind"] == "encode" and j["layer"] == L]
        if not enc:
            continue  # a dense layer: nothing of it is encoded
        spans = union(enc)
        c = calib[L + 1]
        rows.append(dict(layer=L, encode_first_start=spans[0][0], encode_last_end=spans[-1][1],
                         calib_next=c, calib_next_s=round(c[1] - c[0], 3),
                         overlap_s=round(overlap(c, spans), 3),
                         calib_next_starts_before_last_encode_ends=c[0] < spans[-1][1]))
    return rows


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"calibrate": "tab:orange", "encode": "tab:blue", "stage": "tab:gray", "retire": "tab:green",
              "other": "lightgray"}
    fig, axes = plt.subplots(len(results), 1, figsize=(11, 2.2 + 0.22 * max(len(r["jobs"]) for r in results.values())),
                             squeeze=False)
    for ax, (W, r) in zip(axes[:, 0], results.items()):
        js = [j for j in r["jobs"] if j["kind"] != "other"]
        for y, j in enumerate(js):
            ax.barh(y, j["end"] - j["start"], left=j["start"], color=colors[j["kind"]], height=0.8)
        ax.set_yticks(range(len(js)), [j["job"] for j in js], fontsize=6)
        ax.invert_yaxis()
        ax.set_title(f"windows_on_disk {W}: wall {r['wall_s']:.0f} s", fontsize=9)
        ax.set_xlabel("s since the first job started")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    fig.legend(handles, list(colors), loc="upper right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", required=True)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--devices", default="", help="CUDA device indices, e.g. 0,1 (with --device cuda)")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--windows-on-disk", default="1,2")
    ap.add_argument("--target", action="append", default=[],
                    help="a file under OUT to build instead of the default target (e.g. published.verified: no report)")
    ap.add_argument("--greedy", action="store_true", help="Snakemake's greedy scheduler (no pulp needed)")
    ap.add_argument("--json")
    ap.add_argument("--png")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not args.devices:
        ap.error("--device cuda needs --devices")
    work = Path(args.work)
    results, key, ok = {}, None, True
    for W in (int(w) for w in args.windows_on_disk.split(",")):
        js, wall = run_campaign(work, W, args, key)
        key = key or work / f"w{W}" / "campaign" / "keys" / "signer.key"
        rows = analyse(js)
        results[W] = dict(wall_s=round(wall, 1), jobs=js, layers=rows)
        print(f"\nwindows_on_disk {W}: campaign {wall:.1f} s, {len(js)} jobs")
        for r in rows:
            print(f"  layer {r['layer']} encodes {r['encode_first_start']:.1f}-{r['encode_last_end']:.1f} s; "
                  f"calibrating layer {r['layer'] + 1} {r['calib_next'][0]:.1f}-{r['calib_next'][1]:.1f} s "
                  f"({r['calib_next_s']:.1f} s), {r['overlap_s']:.1f} s of it beside layer {r['layer']}'s encodes")
        if W >= 2 and not any(r["overlap_s"] > 0 for r in rows):
            ok = False
            print(f"  FAIL: with windows_on_disk {W} no calibration ran beside the previous layer's encodes")
    out = dict(device=args.device, devices=args.devices, cores=args.cores, results=results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.png:
        plot(results, args.png)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
