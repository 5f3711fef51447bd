"""The rehearsal's measurements as tables (docs/benchmarks.md, "Rehearsal at GLM-5's size"), from what
benchmarks/rehearsal_device.sh's collect step brought back (rehearsal.tar.xz, unpacked into DIR):

    python3 benchmarks/rehearsal_report.py DIR [--json OUT.json]

- per job: Snakemake's benchmark file (wall, max RSS, CPU seconds), the GPU wait its log reports (``fq: claimed cuda:0
  after N s waiting``) and, for encode jobs, the matrices and seconds per matrix of its progress bar;
- per job class (the Snakemake script a CUDA process ran: calib_layer, encode, ...): the GPU memory peak and the time
  on the GPU (first to last sample of its processes in nvidia-smi's per-process samples);
- the GPU busy share from the first GPU process's first sample to the last one's last: the mean utilisation and the
  share of one-second samples with any utilisation;
- the disk peak over the first sample (the source and the campaign's files; the image's own use is the first sample).
Jobs stopped at a call's deadline have no benchmark file; they are counted in the call they completed in.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime as dt
import json
import re
from pathlib import Path


def _t(stamp: str) -> float:
    return dt.datetime.strptime(stamp.strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()


def jobs(d: Path) -> list[dict]:
    out = []
    for f in sorted((d / "benchmarks").rglob("*.tsv")):
        head, row = f.read_text().splitlines()[:2]
        rec = dict(zip(head.split("\t"), row.split("\t")))
        rel = Path(str(f.relative_to(d / "benchmarks")).removesuffix(".tsv"))  # names hold dots (k2.w4-layer001)
        log = d / "logs" / f"{rel}.log"
        text = log.read_text(errors="replace").replace("\r", "\n") if log.is_file() else ""
        waits = [float(x) for x in re.findall(r"claimed cuda:\d+ after ([\d.]+) s waiting", text)]
        bars = re.findall(r"(\d+)/(\d+) \[(\d+):(\d+)<", text)
        job = {"job": str(rel), "class": str(rel.parts[0]) if len(rel.parts) > 1 else str(rel),
               "wall_s": float(rec["s"]), "max_rss_mb": float(rec["max_rss"]), "cpu_s": float(rec["cpu_time"]),
               "gpu_wait_s": waits[0] if waits else None}
        if bars:
            done, total, m, s = (int(x) for x in bars[-1])
            # the bar starts before the claim: its seconds less the wait are the encodes'
            on_gpu = 60 * m + s - (waits[0] if waits else 0.0)
            job.update(matrices=total, encode_s=on_gpu, s_per_matrix=round(on_gpu / max(done, 1), 3))
        out.append(job)
    return out


def gpu_processes(d: Path) -> dict:
    scripts = {}
    for line in (d / "pids.tsv").read_text().splitlines():
        pid, cmd = line.split("\t", 1)
        m = re.search(r"\.(\w+)\.py", cmd)
        scripts[pid] = m.group(1) if m else cmd.split()[0]
    span, peak = {}, collections.defaultdict(float)
    with open(d / "smi_apps.csv") as fh:
        for r in csv.reader(fh):
            if len(r) < 3 or not r[2].strip().isdigit():
                continue
            t, pid, mib = _t(r[0]), r[1].strip(), float(r[2])
            a, b = span.get(pid, (t, t))
            span[pid] = (min(a, t), max(b, t))
            peak[pid] = max(peak[pid], mib)
    return {pid: {"script": scripts.get(pid, "?"), "first": a, "last": b, "peak_mib": peak[pid]}
            for pid, (a, b) in span.items()}


def busy(d: Path, procs: dict) -> dict:
    if not procs:
        return {}
    lo, hi = min(p["first"] for p in procs.values()), max(p["last"] for p in procs.values())
    with open(d / "smi_gpu.csv") as fh:
        util = [(_t(r[0]), float(r[1])) for r in csv.reader(fh) if len(r) >= 4]
    inside = [u for t, u in util if lo <= t <= hi]
    return {"window_s": round(hi - lo, 1), "samples": len(inside),
            "mean_utilization_pct": round(sum(inside) / max(len(inside), 1), 1),
            "share_busy_pct": round(100 * sum(u > 0 for u in inside) / max(len(inside), 1), 1)}


def disk_peak(d: Path) -> dict:
    rows = [tuple(int(x) for x in line.split()) for line in (d / "disk.log").read_text().splitlines() if line.strip()]
    return {"first_bytes": rows[0][1], "peak_bytes": max(b for _, b in rows),
            "peak_over_first_bytes": max(b for _, b in rows) - rows[0][1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("dir", type=Path)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    js, procs = jobs(a.dir), gpu_processes(a.dir)
    by_class = collections.defaultdict(lambda: {"processes": 0, "gpu_s": 0.0, "peak_mib": 0.0})
    for q in procs.values():
        c = by_class[q["script"]]
        c["processes"] += 1
        c["gpu_s"] = round(c["gpu_s"] + q["last"] - q["first"], 1)
        c["peak_mib"] = max(c["peak_mib"], q["peak_mib"])
    doc = {"jobs": js, "gpu_by_script": dict(sorted(by_class.items())), "gpu_busy": busy(a.dir, procs),
           "disk": disk_peak(a.dir)}
    print("| job | wall s | GPU wait s | max RSS GB | CPU s | s/matrix |\n| --- | ---: | ---: | ---: | ---: | ---: |")
    for j in js:
        w = "" if j["gpu_wait_s"] is None else f"{j['gpu_wait_s']:.0f}"
        print(f"| {j['job']} | {j['wall_s']:.0f} | {w} | {j['max_rss_mb'] / 1000:.1f} | {j['cpu_s']:.0f} | "
              f"{j.get('s_per_matrix', '')} |")
    print("\n| script | CUDA processes | on the GPU s | GPU memory peak GiB |\n| --- | ---: | ---: | ---: |")
    for s, c in sorted(by_class.items()):
        print(f"| {s} | {c['processes']} | {c['gpu_s']:.0f} | {c['peak_mib'] / 1024:.1f} |")
    print(f"\nGPU busy: {doc['gpu_busy']}\ndisk: {doc['disk']}")
    if a.json:
        a.json.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
