#!/usr/bin/env python3
"""CPU Viterbi speed per instruction set: tiles/s per K, 1 and 2 threads, each ISA the CPU runs.

    .venv/bin/python benchmarks/cpu_viterbi_isa.py [--isa avx512,avx2,generic] [--ks 1,2,3,4,8]
           [--threads 1,2] [--tiles 64] [--generic-tiles 8] [--reps 3] [--rounds 3]
           [--so LABEL=PATH ...] [--json OUT]

Each ISA runs in its own process with FQ_CPU_ISA set (the kernel picks its ISA once, at import). On a
machine with AVX-512, ``avx2`` is the proxy for a CPU without it (the same code an AVX2-only CPU runs).
Every (ISA, K, threads) is timed ``--reps`` times per round on the same Gaussian mul1 tiles, and the rounds
go through all configurations in turn, so load from other work spreads over all of them. Reported: the
median over all runs of wall-clock tiles/s, and of tiles per CPU-second of the process (user + system time
of all its threads), which moves less when other work shares the cores (with 1 thread: one core's speed).
``--so LABEL=PATH`` also times another build of the kernel (a copy of ``_trellis*.so``, e.g. one built from
an older commit; one that predates FQ_CPU_ISA runs whatever it dispatches to itself), under LABEL.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _kernel(so: str | None):
    if so:
        spec = importlib.util.spec_from_file_location("_trellis", so)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod
    sys.path.insert(0, str(ROOT))
    from fq.codec import _trellis

    return _trellis


def worker(args) -> dict:
    import numpy as np

    sys.path.insert(0, str(ROOT))
    from fq.codec.codebook import values_f32

    mod = _kernel(args.so)
    isa = mod.isa() if hasattr(mod, "isa") else None
    v = values_f32("mul1")
    rng = np.random.default_rng(1234)
    n = args.tiles
    x = rng.standard_normal((n, 256)).astype(np.float32)
    out = np.empty(x.shape, dtype=np.uint16)
    rows = []
    for K in args.ks:
        for th in args.threads:
            mod.viterbi(x[:2], K, v, out[:2], th)  # warm up
            wall, cpu = [], []
            for _ in range(args.reps):
                w0, c0 = time.perf_counter(), time.process_time()
                mod.viterbi(x, K, v, out, th)
                wall.append(n / (time.perf_counter() - w0))
                cpu.append(n / max(time.process_time() - c0, 1e-9))
            rows.append(dict(K=K, threads=th, tiles=n, reps=args.reps, tiles_per_s=statistics.median(wall),
                             tiles_per_cpu_s=statistics.median(cpu), wall_all=[round(r, 1) for r in wall],
                             cpu_all=[round(r, 1) for r in cpu]))
    return dict(isa=isa, rows=rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--isa", default=None, help="comma-separated; default: every ISA this CPU runs; 'none': no fq build")
    ap.add_argument("--ks", default="1,2,3,4,8")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--tiles", type=int, default=64)
    ap.add_argument("--generic-tiles", type=int, default=8, help="tiles for the (slow) generic ISA")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--so", action="append", default=[], metavar="LABEL=PATH", help="also time this build")
    ap.add_argument("--json")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--worker-so", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.ks = [int(k) for k in args.ks.split(",")]
    args.threads = [int(t) for t in args.threads.split(",")]
    if args.worker:
        args.so = args.worker_so
        print(json.dumps(worker(args)))
        return 0
    configs = []  # (label, FQ_CPU_ISA or None, so or None, tiles)
    isas = _kernel(None).isas() if args.isa is None else [i for i in args.isa.split(",") if i != "none"]
    for isa in isas:
        configs.append((isa, isa, None, args.generic_tiles if isa == "generic" else args.tiles))
    for spec in args.so:
        label, _, path = spec.partition("=")
        configs.append((label, None, path, args.generic_tiles if "generic" in label else args.tiles))
    runs = {c[0]: {} for c in configs}
    for rnd in range(args.rounds):
        for label, isa, so, tiles in configs:
            env = dict(os.environ)
            env.pop("FQ_CPU_ISA", None)
            if isa:
                env["FQ_CPU_ISA"] = isa
            cmd = [sys.executable, __file__, "--worker", "--ks", ",".join(map(str, args.ks)), "--threads",
                   ",".join(map(str, args.threads)), "--tiles", str(tiles), "--reps", str(args.reps)]
            if so:
                cmd += ["--worker-so", so]
            r = json.loads(subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout)
            for row in r["rows"]:
                acc = runs[label].setdefault((row["K"], row["threads"]), dict(wall=[], cpu=[], isa=r["isa"]))
                acc["wall"] += row["wall_all"]
                acc["cpu"] += row["cpu_all"]
        print(f"round {rnd + 1}/{args.rounds} done, load average {os.getloadavg()[0]:.2f}", file=sys.stderr, flush=True)
    results = []
    print(f"{'build/ISA':>16} {'K':>2} {'thr':>3} {'tiles/s':>8} {'tiles/cpu-s':>11}  runs")
    for label, *_ in configs:
        for (K, th), acc in runs[label].items():
            row = dict(label=label, isa=acc["isa"], K=K, threads=th, tiles_per_s=statistics.median(acc["wall"]),
                       tiles_per_cpu_s=statistics.median(acc["cpu"]), runs=len(acc["wall"]))
            results.append(row)
            print(f"{label:>16} {K:>2} {th:>3} {row['tiles_per_s']:8.1f} {row['tiles_per_cpu_s']:11.1f}  {row['runs']}")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(results=results, loadavg=load), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
