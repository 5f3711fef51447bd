"""Draw the campaign's pipeline (README's figure) from Snakemake's own rule graph.

    .venv/bin/snakemake --rulegraph --cores 1 --config out=NEW > first.dot     # a fresh campaign: its first run
    .venv/bin/snakemake --cores 2 --config out=DIR                             # measures the allocation, then
    .venv/bin/snakemake --rulegraph --cores 1 --config out=DIR > second.dot    # the rest of the campaign
    .venv/bin/python tools/pipeline_figure.py first.dot second.dot docs/pipeline.png

The demo's recipe exercises every rule of the workflow, so its two graphs (a budgeted base's campaign runs twice:
the allocation first) are the whole workflow; they are merged by rule name. Each rule is placed in the column of its
longest path from a rule without inputs (no Graphviz needed) and coloured by its phase; an edge is drawn where a rule
consumes another's output directly, not where a longer path already connects them (the transitive reduction), and
not where it closes a cycle across layers or windows (an encode job reads the fragments a share job copies; a
window is staged after the one before it retired).
"""
from __future__ import annotations

import argparse
import re
from collections import defaultdict
from pathlib import Path

# rule -> phase, in the order a campaign runs them (a rule not named here is drawn grey: update the map)
PHASES = {
    "prepare": ("demo_model", "keygen", "model_signing_keygen", "init", "usage", "plan"),
    "allocate": ("sensitivity", "allocate"),
    "stage the source": ("stage", "skeleton", "skeleton_variant", "retire"),
    "calibrate": ("calib_tokens", "calib_embed", "calib_dense_linears", "calib_moe_linears", "calib_head"),
    "encode": ("encode", "encode_linears", "share", "weight_only", "native"),
    "sign and publish": ("finalize", "verify_published", "repair"),
    "measure": ("eval", "report"),
}
COLOURS = {"prepare": "#8da0cb", "allocate": "#e78ac3", "stage the source": "#b3b3b3", "calibrate": "#a6d854",
           "encode": "#fc8d62", "sign and publish": "#ffd92f", "measure": "#66c2a5"}


def parse(dot: str, where: str) -> tuple[set[str], set[tuple[str, str]]]:
    """(rule names, {(from rule, to rule)}) of ``snakemake --rulegraph`` output."""
    ids = dict(re.findall(r'^\s*(\d+)\[label = "([^"]+)"', dot, re.M))
    if not ids:
        raise SystemExit(f"{where}: no rules in it (expected snakemake --rulegraph output)")
    edges = {(ids[a], ids[b]) for a, b in re.findall(r"^\s*(\d+) -> (\d+)", dot, re.M)}
    return set(ids.values()), edges


def forward_edges(nodes: set, edges: set) -> set:
    """The edges without those closing a cycle, found by a depth-first walk from the rules without inputs in phase
    order (so that the edge dropped is the one back to an earlier step: retire -> stage, not stage -> encode)."""
    steps = [r for rules in PHASES.values() for r in rules]  # every rule in the order a campaign runs them
    order = lambda n: (steps.index(n) if n in steps else len(steps), n)  # noqa: E731
    succ = defaultdict(list)
    for a, b in sorted(edges, key=lambda e: (order(e[0]), order(e[1]))):
        succ[a].append(b)
    has_input = {b for a, b in edges if a != b}
    state, back = {}, set()
    for root in sorted(nodes, key=lambda n: (n in has_input, order(n))):
        if root in state:
            continue
        state[root] = "open"
        stack = [(root, iter(succ[root]))]
        while stack:
            n, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                state[n] = "done"
                stack.pop()
            elif state.get(nxt) == "open":
                back.add((n, nxt))
            elif nxt not in state:
                state[nxt] = "open"
                stack.append((nxt, iter(succ[nxt])))
    return {e for e in edges if e not in back and e[0] != e[1]}


def ranks(nodes: set, dag: set) -> dict[str, int]:
    """Each rule's longest path from a rule without inputs."""
    rank = dict.fromkeys(nodes, 0)
    for _ in nodes:  # relaxation: converges within len(nodes) rounds on a DAG
        changed = False
        for a, b in sorted(dag):
            if rank[b] < rank[a] + 1:
                rank[b], changed = rank[a] + 1, True
        if not changed:
            break
    return rank


def reduce(dag: set) -> set:
    """The transitive reduction: an edge a -> c is dropped when another path leads from a to c."""
    succ = defaultdict(set)
    for a, b in dag:
        succ[a].add(b)

    def reachable(a, skip):
        seen, todo = set(), [x for x in succ[a] if x != skip]
        while todo:
            n = todo.pop()
            if n not in seen:
                seen.add(n)
                todo.extend(succ[n])
        return seen

    return {(a, b) for a, b in dag if b not in reachable(a, b)}


def phase_of(rule: str) -> str | None:
    return next((p for p, rules in PHASES.items() if rule in rules), None)


def layout(nodes: set, dag: set) -> dict[str, tuple[float, float]]:
    """Columns by rank; within a column, rules ordered by the mean height of their inputs (fewer crossings)."""
    rank = ranks(nodes, dag)
    preds = defaultdict(list)
    for a, b in dag:
        preds[b].append(a)
    pos: dict[str, tuple[float, float]] = {}
    for col in range(max(rank.values()) + 1):
        members = [n for n in nodes if rank[n] == col]
        key = {n: (sum(pos[p][1] for p in preds[n]) / len(preds[n]) if preds[n] else 0.0) for n in members}
        members.sort(key=lambda n: (-key[n], n))
        for i, n in enumerate(members):
            pos[n] = (col * 2.5, (len(members) - 1) / 2 - i)
    return pos


def draw(nodes: set, edges: set, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, Patch

    dag = reduce(forward_edges(nodes, edges))
    pos = layout(nodes, dag)
    cols = max(x for x, _ in pos.values()) / 2.5 + 1
    rows = max(abs(y) for _, y in pos.values()) * 2 + 1
    fig, ax = plt.subplots(figsize=(1.75 * cols + 0.5, 0.75 * rows + 1.0))
    for a, b in sorted(dag):
        (x0, y0), (x1, y1) = pos[a], pos[b]
        ax.annotate("", xy=(x1 - 0.95, y1), xytext=(x0 + 0.95, y0),
                    arrowprops=dict(arrowstyle="-|>", color="#888888", lw=0.9, shrinkA=0, shrinkB=0,
                                    connectionstyle="arc3,rad=0.0"))
    for n, (x, y) in pos.items():
        phase = phase_of(n)
        ax.add_patch(FancyBboxPatch((x - 0.95, y - 0.24), 1.9, 0.48, boxstyle="round,pad=0.02,rounding_size=0.12",
                                    fc=COLOURS.get(phase, "#dddddd"), ec="#444444", lw=0.8))
        ax.text(x, y, n, ha="center", va="center", fontsize=9)
    ax.set_xlim(-1.1, (cols - 1) * 2.5 + 1.1)
    ax.set_ylim(-rows / 2 - 0.1, rows / 2 + 0.1)
    ax.axis("off")
    ax.legend(handles=[Patch(fc=c, ec="#444444", label=p) for p, c in COLOURS.items()], loc="lower center",
              bbox_to_anchor=(0.5, 1.0), ncol=len(COLOURS), frameon=False, fontsize=9)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("rulegraphs", type=Path, nargs="+", help="snakemake --rulegraph outputs (DOT), merged")
    p.add_argument("out", type=Path, help="the PNG to write")
    a = p.parse_args(argv)
    nodes, edges = set(), set()
    for g in a.rulegraphs:
        n, e = parse(g.read_text(), str(g))
        nodes |= n
        edges |= e
    nodes.discard("all")  # the aggregate target is not a step
    edges = {(x, y) for x, y in edges if x in nodes and y in nodes}
    unknown = sorted(n for n in nodes if phase_of(n) is None)
    if unknown:
        print(f"rules without a phase (drawn grey; add them to PHASES): {', '.join(unknown)}")
    draw(nodes, edges, a.out)
    print(f"{a.out}: {len(nodes)} rules, {len(edges)} edges")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
