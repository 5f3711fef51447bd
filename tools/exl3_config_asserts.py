"""Extract what exllamav3's architecture classes assert about config.json (``assert_cfg``) into fq's data file.

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


def extract(package: Path) -> dict:
    arch = package / "architecture"
    own, bases, strings = {}, {}, {}
    for f in sorted(arch.glob("*.py")):
        text = f.read_text()
        tree = ast.parse(text)
        own[f.stem] = _calls(tree)
        bases[f.stem] = re.findall(r"^from \.(\w+) import", text, re.M)
        strings[f.stem] = re.findall(r'arch_string\s*=\s*"([^"]+)"', text)
    out = {}
    for stem, archs in strings.items():
        calls, seen, todo = [], set(), [stem]
        while todo:
            s = todo.pop()
            if s in seen or s not in own:
                continue
            seen.add(s)
            calls += own[s]
            todo += bases[s]
        unique = []
        for c in calls:
            if c not in unique:
                unique.append(c)
        for a in archs:
            out[a] = sorted(unique, key=lambda c: c["key"])
    return dict(sorted(out.items()))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: exl3_config_asserts.py EXLLAMAV3_PACKAGE_DIR")
    doc = {"format": "fq-exl3-config-asserts/1", "exllamav3": "1.6.5", "asserts": extract(Path(sys.argv[1]))}
    print(json.dumps(doc, indent=1, sort_keys=True))
