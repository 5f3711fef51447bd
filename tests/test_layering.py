"""fq's import layering: packages import downward only, and nothing imports in a circle.

    .venv/bin/python -m pytest tests/test_layering.py

Every ``fq/**/*.py`` is parsed with ``ast`` (nothing is imported). A *unit* is a package directly under ``fq/``
(``fq/codec/``, ``fq/provenance/`` with its ``attest/`` subpackage, ...) or one of the modules left at the top
(``fq/cli.py``, ``fq/errors.py``, ...; ``fq/__init__.py`` is the unit ``__init__``). Every import statement counts,
wherever it sits: a function-level (lazy) import is how fq keeps torch out of start-up, not a licence to import
upward -- it still runs, and a circle through it still means two modules that cannot be understood one without the
other. ``if TYPE_CHECKING:`` imports count too. ``from fq.a import b`` is an edge to the module ``fq.a.b`` when that
is a module, else to ``fq.a``; importing ``fq.a.b`` is not counted as importing ``fq.a``'s ``__init__`` as well.

Checked:
1. every unit is in LAYERS (a new package must be given its place here);
2. no edge goes to a unit of a higher layer, and none to another unit of the same layer;
3. hence no cycle between units (also checked directly, so that the message names the circle);
4. no cycle between the modules of fq.workflow (the Snakemake steps), nor inside any other unit.

Failures name each offending import as ``file:line``.
"""
from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FQ = ROOT / "fq"

# THE layer order, bottom first: a unit may import units of lower rows only (and itself). One row may hold several
# units that are independent of each other. README ("What is here") and fq/__init__.py point here.
LAYERS = [
    ("__init__",),            # fq/__init__.py: the version, nothing else
    ("display",),             # printable(): names fq did not choose, made safe for a terminal
    ("errors",),              # FqError, the one error type (the codec's only fq import)
    ("core",),                # canonical JSON, atomic writes, safe paths, schema checks, units, layer ranges
    ("codec",),               # the EXL3 trellis codec
    ("model",),               # source checkpoints, safetensors shards, expert layouts, usage, the demo model
    ("hessian",),             # calibration tokens, the layer-by-layer calibration forward, Hessian artifacts
    ("allocation",),          # sensitivity measurement and the bits solver
    ("planning",),            # recipes, plans, pricing, cost-table calibration
    ("provenance",),          # fragments, attestations, manifests, plans, publications; verify, combine
    ("runtime", "tp"),        # consumers of verified products: transformers/exllamav3 loading, eval; TP export/load
    ("workflow", "promote"),  # the campaign's Snakemake steps; publishing a finalized campaign
    ("cli_args",),            # argparse options shared by fq plan / fq price
    ("commands",),            # the fq subcommands
    ("cli",),                 # the fq command
    ("__main__",),            # python -m fq
]
RANK = {unit: i for i, row in enumerate(LAYERS) for unit in row}


def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(FQ.rglob("*.py")):
        if "__pycache__" in p.parts:
            continue
        parts = ["fq", *p.relative_to(FQ).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def unit_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"  # fq.X or fq.X.Y...: X is the package or top-level module


def _is_package(module: str) -> bool:
    return MODULES[module].name == "__init__.py"


def _resolve(name: str) -> str | None:
    """The fq module an import of ``name`` runs: the longest prefix that is a module of fq."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def edges() -> list[tuple[str, str, str, int]]:
    """(importer, imported, file, line) for every import of an fq module by an fq module."""
    out = []
    for mod, path in MODULES.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        package = mod if _is_package(mod) else mod.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in MODULES else base)
            for t in targets:
                if t == "fq" or t.startswith("fq."):
                    r = _resolve(t)
                    if r is not None and r != mod:
                        out.append((mod, r, path.relative_to(ROOT).as_posix(), node.lineno))
    return out


EDGES = sorted(set(edges()))


def _cycles(nodes, succ) -> list[list[str]]:
    """Strongly connected components with more than one node (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(succ.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _where(pairs: set[tuple[str, str]], key) -> list[str]:
    return [f"{f}:{line}: {a} imports {b}" for a, b, f, line in EDGES if (key(a), key(b)) in pairs]


def test_every_unit_has_a_layer():
    missing = sorted({unit_of(m) for m in MODULES} - set(RANK))
    assert not missing, (f"units without a layer: {missing}; give each its row in LAYERS (tests/test_layering.py) "
                         f"and say in its __init__ docstring what it may import")


def test_no_upward_or_sideways_import():
    bad = []
    for a, b, f, line in EDGES:
        ua, ub = unit_of(a), unit_of(b)
        if ua != ub and ua in RANK and ub in RANK and RANK[ub] >= RANK[ua]:
            how = "a higher layer" if RANK[ub] > RANK[ua] else "the same layer"
            bad.append(f"{f}:{line}: {a} ({ua}) imports {b} ({ub}, {how})")
    assert not bad, "imports against the layer order (tests/test_layering.py LAYERS):\n" + "\n".join(bad)


def test_no_cycle_between_units():
    succ = defaultdict(set)
    for a, b, _, _ in EDGES:
        if unit_of(a) != unit_of(b):
            succ[unit_of(a)].add(unit_of(b))
    cycles = _cycles({unit_of(m) for m in MODULES}, succ)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"circle {' <-> '.join(comp)}:")
        lines += ["  " + w for w in _where({(x, y) for x in members for y in members if x != y}, unit_of)]
    assert not cycles, "\n".join(lines)


def test_no_cycle_between_modules_of_a_unit():
    """fq.workflow above all (init, staging, hub, finalize, campaign once imported one another in circles), but
    every unit: a module-level circle is a unit that cannot be read one module at a time."""
    succ = defaultdict(set)
    for a, b, _, _ in EDGES:
        if unit_of(a) == unit_of(b):
            succ[a].add(b)
    cycles = _cycles(set(MODULES), succ)
    lines = []
    for comp in cycles:
        members = set(comp)
        lines.append(f"circle {' <-> '.join(comp)}:")
        lines += ["  " + f"{f}:{line}: {a} imports {b}" for a, b, f, line in EDGES if a in members and b in members]
    assert not cycles, "\n".join(lines)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The parser itself: a function-level import is an edge, and a workflow circle is reported with file:line."""
    assert ("fq.workflow.campaign", "fq.workflow.hub") in {(a, b) for a, b, _, _ in EDGES}  # lazy, in load_campaign
    succ = {"fq.workflow.a": {"fq.workflow.b"}, "fq.workflow.b": {"fq.workflow.a"}, "fq.workflow.c": {"fq.workflow.a"}}
    assert _cycles(set(succ), succ) == [["fq.workflow.a", "fq.workflow.b"]]
