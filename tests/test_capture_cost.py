"""benchmarks/capture_cost.py at demo size on the CPU: its layer tensors fill transformers' module and the
projection is computed (the GLM-5-sized run is on the H200: docs/benchmarks.md)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_capture_cost_smoke(tmp_path):
    out = tmp_path / "c.json"
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "capture_cost.py"), "--small", "--experts", "2,4",
                        "--rows", "1,2", "--cols", "64", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    assert [(r["experts"], r["rows"]) for r in res["rows"]] == [(2, 1), (2, 2), (4, 1), (4, 2)]
    assert {"setup_s", "per_row_s", "projected_glm5_layer_s"} <= set(res) and "projected GLM-5 layer" in p.stdout
