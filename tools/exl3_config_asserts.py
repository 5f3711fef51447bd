"""Extract what exllamav3's architecture classes assert about config.json (``assert_cfg``) and the keys they read
without a default (``read_cfg(type, key, no_default)``) into fq's data file.

exllamav3 refuses to load a model whose config.json states another value for a key its class asserts (``Key
norm_topk_prob expected to have value True but was False``). fq checks every base it plans against these facts
(``fq.model.families.base.exl3_assert_problems``), read from ``fq/data/exl3_config_asserts.json``; this tool
writes that file from the wheel's sources, so that a new exllamav3 release is one command away:

    pip download exllamav3==1.6.5 --no-deps -d /tmp/w && unzip -q /tmp/w/exllamav3-*.whl -d /tmp/exl3src
    .venv/bin/python tools/exl3_config_asserts.py /tmp/exl3src/exllamav3 > fq/data/exl3_config_asserts.json

Each architecture file's ``arch_string`` values get every ``assert_cfg(type, key, value[, optional])`` call of that
file and of the files whose config class it derives from (``from .glm4_moe import Glm4MoeConfig``); a key read
through a vision-language wrapper (``text_config->`` or the file's ``pfx(...)``) is recorded without the prefix,
as fq reads the language model's view of the config. Only literal values are recorded (a call whose value is not a
literal is reported on stderr and skipped).

``required`` lists, per class, the keys of the language model's config that a ``read_cfg(..., no_default)`` call
reads: exllamav3 refuses to load a config without them ("Missing any of the following keys: ['indexer_types']", which
GLM-5's class reads and the GLM-5-size rehearsal's first source did not state). A call naming several keys is one
entry of alternatives; keys of the vision tower (``vision_config->``, or ``vision_config`` itself) and the wrapper's
``text_config`` object are left to the family's own check; a key built by ``pfx + "name"`` is recorded as ``name``.
"""
from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path


def _calls(tree: ast.AST) -> list[dict]:
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "assert_cfg"):
            continue
        args = list(node.args) + [kw.value for kw in node.keywords]
        if len(args) < 3:
            continue
        key = args[1]
        if isinstance(key, ast.Call) and key.args:  # pfx("hidden_act"): the wrapper's prefix
            key = key.args[0]
        try:
            name, value = ast.literal_eval(key), ast.literal_eval(args[2])
            optional = ast.literal_eval(args[3]) if len(args) > 3 else False
        except ValueError:
            print(f"skipped a non-literal assert_cfg at line {node.lineno}", file=sys.stderr)
            continue
        out.append({"key": name.split("->")[-1], "value": value, "optional": bool(optional)})
    return out


def _key_names(node: ast.AST) -> list[str] | None:
    """The literal key(s) a read_cfg call names: "key", ["k1", "k2"], pfx + "key" (None: not literal)."""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and isinstance(node.right, ast.Constant):
        node = node.right  # pfx + "hidden_size": the wrapper's prefix
    elif isinstance(node, ast.Call) and len(node.args) == 1:
        node = node.args[0]  # pfx("hidden_size"), as assert_cfg's keys are read
    try:
        v = ast.literal_eval(node)
    except ValueError:
        return None
    keys = [v] if isinstance(v, str) else list(v) if isinstance(v, (list, tuple)) else None
    return keys if keys and all(isinstance(k, str) for k in keys) else None


def _required(tree: ast.AST) -> list[list[str]]:
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "read_cfg"
                and len(node.args) >= 3 and isinstance(node.args[2], ast.Name) and node.args[2].id == "no_default"):
            continue
        keys = _key_names(node.args[1])
        if keys is None:
            print(f"skipped a non-literal read_cfg key at line {node.lineno}: {ast.unparse(node.args[1])}",
                  file=sys.stderr)
            continue
        if any(k.startswith("vision_config") or k == "text_config" for k in keys):
            continue
        out.append(sorted({k.split("->")[-1] for k in keys}))
    return out


def _required_by_class(files: dict[str, ast.Module]) -> dict[str, list[list[str]]]:
    """{arch_string: required keys} per config class: a file may hold several (Qwen3.5's dense and MoE classes read
    different keys), so each class gets its own body's reads, its base classes' (found by name in any architecture
    file) and its file's module-level functions'."""
    classes, module_level = {}, {}
    for stem, tree in files.items():
        funcs = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        module_level[stem] = [k for f in funcs for k in _required(f)]
        for n in tree.body:
            if isinstance(n, ast.ClassDef):
                arch = next((ast.literal_eval(a.value) for a in n.body if isinstance(a, ast.Assign)
                             and any(isinstance(t, ast.Name) and t.id == "arch_string" for t in a.targets)), None)
                classes[n.name] = (stem, [b.id for b in n.bases if isinstance(b, ast.Name)], _required(n), arch)
    class_bases = {name: c[1] for name, c in classes.items()}
    out = {}
    for name, (stem, _, _, arch) in classes.items():
        if arch is None:
            continue
        keys = [k for c in _reach(name, class_bases) for k in classes[c][2] + module_level[classes[c][0]]]
        out[arch] = sorted({tuple(k) for k in keys})
    return {a: [list(k) for k in v] for a, v in sorted(out.items())}


def _reach(start: str, edges: dict[str, list[str]]) -> list[str]:
    """``start`` and every name reachable from it through ``edges`` (depth first), each once; a name without
    edges (not an architecture file or class) is skipped."""
    out, todo = [], [start]
    while todo:
        s = todo.pop()
        if s in out or s not in edges:
            continue
        out.append(s)
        todo += edges[s]
    return out


def _closure(stem: str, own: dict, bases: dict) -> list:
    """``own[s]`` of the file and of the files its config class derives from, each item once, in order."""
    items = [c for s in _reach(stem, bases) for c in own[s]]
    unique = []
    for c in items:
        if c not in unique:
            unique.append(c)
    return unique


def extract(package: Path) -> dict:
    arch = package / "architecture"
    own, trees, bases, strings = {}, {}, {}, {}
    for f in sorted(arch.glob("*.py")):
        text = f.read_text()
        tree = trees[f.stem] = ast.parse(text)
        own[f.stem] = _calls(tree)
        bases[f.stem] = re.findall(r"^from \.(\w+) import", text, re.M)
        strings[f.stem] = re.findall(r'arch_string\s*=\s*"([^"]+)"', text)
    asserts = {}
    for stem, archs in strings.items():
        calls = _closure(stem, own, bases)
        for a in archs:
            asserts[a] = sorted(calls, key=lambda c: c["key"])
    return {"asserts": dict(sorted(asserts.items())), "required": _required_by_class(trees)}


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: exl3_config_asserts.py EXLLAMAV3_PACKAGE_DIR")
    doc = {"format": "fq-exl3-config-asserts/2", "exllamav3": "1.6.5", **extract(Path(sys.argv[1]))}
    print(json.dumps(doc, indent=1, sort_keys=True))
