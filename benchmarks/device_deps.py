"""Snakemake and its dependency closure for the device's Python 3.12, into DIR (benchmarks/device_pack.sh's `deps`).

    .venv/bin/python benchmarks/device_deps.py DIR

The pure-Python distributions of the closure are copied from this virtualenv (they run on 3.12 as they are); the
compiled ones are fetched as cp312 manylinux wheels of the same versions. pip cannot resolve the closure for 3.12
itself: connection_pool >= 0.0.3 has no wheel. What site.tar.xz already holds (pydantic, jsonschema, ...) is left
out, and so are pulp's bundled CBC binaries (30 MB: Snakemake falls back to its greedy scheduler and says so).
"""
from __future__ import annotations

import importlib.metadata as md
import pathlib
import re
import shutil
import subprocess
import sys

IN_SITE = {"pydantic", "pydantic-core", "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
           "annotated-types", "typing-inspection"}


def closure(root: str) -> list[md.Distribution]:
    """``root`` and every distribution it requires, transitively (no extras), as this environment has them."""
    seen, todo, out = set(), [root], []
    while todo:
        try:
            d = md.distribution(todo.pop())
        except md.PackageNotFoundError:
            continue
        key = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
        if key in seen:
            continue
        seen.add(key)
        out.append(d)
        todo += [re.split(r"[ ;<>=!\[~(]", r)[0] for r in d.requires or [] if "extra ==" not in r]
    return out


def main(dst: pathlib.Path) -> None:
    compiled = []
    for d in closure("snakemake"):
        key = re.sub(r"[-_.]+", "-", d.metadata["Name"]).lower()
        if key in IN_SITE:
            continue
        if any(str(f).endswith(".so") for f in d.files or []):
            compiled.append(f"{d.metadata['Name']}=={d.version}")
            continue
        for f in d.files or []:
            p = pathlib.Path(d.locate_file(f))
            if p.is_file() and "__pycache__" not in p.parts and not str(f).startswith(".."):
                (dst / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(p, dst / f)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(dst),
                    "--python-version", "3.12", "--only-binary=:all:", "--platform", "manylinux2014_x86_64",
                    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64", *sorted(compiled)],
                   check=True)
    shutil.rmtree(dst / "pulp" / "solverdir", ignore_errors=True)
    print(f"{dst}: snakemake's closure for Python 3.12 ({len(compiled)} compiled: {', '.join(sorted(compiled))})")


if __name__ == "__main__":
    main(pathlib.Path(sys.argv[1]))
