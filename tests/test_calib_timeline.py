"""benchmarks/calib_timeline.py's reading of a campaign's Snakemake benchmark files (its campaigns themselves run on a
machine with time to spare: docs/benchmarks.md has the runs)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calib_timeline as tl  # noqa: E402

HEAD = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"


def bench(root: Path, rel: str, end: float, wall: float) -> None:
    f = root / rel
    f.parent.mkdir(parents=True, exist_ok=True)
    f.write_text(HEAD + f"{wall}\t0:00:01\t1\t1\t1\t1\t0\t0\t0\t{wall}\n")
    os.utime(f, (end, end))


def test_jobs_and_overlap_from_benchmark_files(tmp_path):
    t = 1_000_000.0
    bench(tmp_path, "calibration/layer001.tsv", t + 10, 4)  # 6-10
    bench(tmp_path, "calibration/layer002.tsv", t + 14, 4)  # 10-14: beside layer 1's encodes from 11
    bench(tmp_path, "encode/k2-layer001-block000.tsv", t + 15, 4)  # 11-15
    bench(tmp_path, "encode/k2-layer001-block001.tsv", t + 13, 2)  # 11-13 (inside the first)
    bench(tmp_path, "encode/k2.r1-layer002.tsv", t + 20, 5)  # a layer job: 15-20
    bench(tmp_path, "retire/window-0.tsv", t + 21, 0.1)
    bench(tmp_path, "calibration/tokens.tsv", t + 2, 2)  # the first job: 0-2
    js = tl.jobs(tmp_path)
    by = {j["job"]: j for j in js}
    assert by["calibration/tokens"]["start"] == 0 and by["calibration/layer002"]["start"] == 10.0
    assert (by["encode/k2.r1-layer002"]["kind"], by["encode/k2.r1-layer002"]["layer"]) == ("encode", 2)
    assert by["retire/window-0"]["kind"] == "retire" and by["calibration/tokens"]["layer"] == -1
    (row,) = tl.analyse(js)  # layer 2 has no layer 3 to calibrate
    assert row["layer"] == 1 and row["overlap_s"] == 3.0 and row["calib_next_starts_before_last_encode_ends"]
    assert tl.union([(3, 4), (0, 2), (1, 2.5)]) == [(0, 2.5), (3, 4)]
    assert tl.overlap((2, 5), [(0, 2.5), (3, 4)]) == 1.5
