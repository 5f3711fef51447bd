"""tools/pipeline_figure.py, README's figure: every rule of the workflow has a phase, and the drawing's graph
handling (merge, cycles across layers and windows, transitive reduction) on a small rule graph."""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import pipeline_figure as pf  # noqa: E402

DOT = """digraph snakemake_dag {
    0[label = "all", color = "0.00 0.6 0.85", style="rounded"];
    1[label = "init", color = "0.1 0.6 0.85", style="rounded"];
    2[label = "stage", color = "0.2 0.6 0.85", style="rounded"];
    3[label = "encode", color = "0.3 0.6 0.85", style="rounded"];
    4[label = "retire", color = "0.4 0.6 0.85", style="rounded"];
    5[label = "finalize", color = "0.5 0.6 0.85", style="rounded"];
    1 -> 2
    1 -> 3
    2 -> 3
    3 -> 3
    3 -> 4
    4 -> 2
    3 -> 5
    4 -> 5
    1 -> 5
    5 -> 0
}
"""


def test_every_rule_of_the_workflow_has_a_phase():
    rules = {m for f in [ROOT / "Snakefile", *sorted((ROOT / "rules").glob("*.smk"))]
             for m in re.findall(r"^\s*rule (\w+):", f.read_text(), re.M)}
    assert "encode" in rules and "finalize" in rules
    assert sorted(r for r in rules - {"all"} if pf.phase_of(r) is None) == []


def test_the_graph_is_ranked_without_its_cycles_and_reduced(tmp_path):
    nodes, edges = pf.parse(DOT, "test")
    nodes.discard("all")
    edges = {(a, b) for a, b in edges if a in nodes and b in nodes}
    dag = pf.forward_edges(nodes, edges)
    assert ("retire", "stage") not in dag and ("encode", "encode") not in dag  # the window's and the layer's loops
    assert pf.ranks(nodes, dag) == {"init": 0, "stage": 1, "encode": 2, "retire": 3, "finalize": 4}
    assert pf.reduce(dag) == {("init", "stage"), ("stage", "encode"), ("encode", "retire"), ("retire", "finalize")}
    (tmp_path / "g.dot").write_text(DOT)
    assert pf.main([str(tmp_path / "g.dot"), str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
