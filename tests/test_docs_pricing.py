"""docs/pricing.md shows real `fq price` output: regenerate it and compare."""
from __future__ import annotations

import re
from pathlib import Path

from fq.cli import main
from fq.model.source_synth import glm5_like, write_synthetic

ROOT = Path(__file__).resolve().parents[1]


def test_pricing_doc_output_is_current(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    src = write_synthetic(tmp_path / "glm5", *glm5_like())
    rc = main(["price", "recipes/glm52-k2k3-dag.json", "recipes/glm52-k2k3-lean.json", "--model", str(src),
               "--sizes", str(src / "sizes.json"), "--gpus", "8", "--disk-budget", "1.6TB"])
    assert rc == 0
    fresh = capsys.readouterr().out.rstrip("\n")
    doc = (ROOT / "docs" / "pricing.md").read_text()
    m = re.search(r"<!-- fq-price-output:begin -->\n```\n(.*?)\n```\n<!-- fq-price-output:end -->", doc, re.S)
    assert m, "docs/pricing.md lost its output markers"
    assert m.group(1) == fresh, "docs/pricing.md is stale: rerun the command it records and paste the output"
    assert "cost ratio glm52-k2k3-lean / glm52-k2k3-dag: 0.7447" in fresh
