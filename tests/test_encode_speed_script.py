"""benchmarks/encode_speed.py runs end to end (--dry-run: CPU stand-ins, tiny sizes), so the one GPU run
it exists for does not fail on a script error."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_encode_speed_dry_run(tmp_path):
    out = tmp_path / "speed.json"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "encode_speed.py"), "--dry-run", "--json", str(out),
                        "--ks", "2", "--codebooks", "mul1", "--tiles", "16", "--check-tiles", "4", "--reps", "1"],
                       capture_output=True, text=True, timeout=600, cwd=str(ROOT))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    d = json.loads(out.read_text())
    assert d["errors"] == []
    (row,) = d["throughput"]
    assert row["ours_equals_cpu"] and row["ours_ring_closed"] and row["mse_ratio_vs_ref"] == 1.0
    assert [p["K"] for p in d["pipeline"]] == [2, 3, 2] and all("stages_s" in p for p in d["pipeline"])
