"""Layer ranges as operators type them ("3-12,13-40") and as fq prints them ("3-12, 14").

Windows are the one operator value the tools cannot check by themselves: a typo like 3-77 for
3-78 would encode 75 of 76 layers, retire the source the last one needed, and surface only at
finalize after the fleet was paid. So a partition is checked against the layers to encode:
their union must be exactly those layers, each once, in ascending order; the error names every
missing, extra and doubled layer at once.
"""
from __future__ import annotations

import re
from collections import Counter
from typing import Iterable, Sequence

from fq.errors import FqError

_RANGE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")  # ASCII digits only


def format_layers(layers: Iterable[int]) -> str:
    """Compact ranges: ``3-12, 14, 16-20``."""
    layers = sorted(layers)
    parts: list[str] = []
    i = 0
    while i < len(layers):
        j = i
        while j + 1 < len(layers) and layers[j + 1] == layers[j] + 1:
            j += 1
        parts.append(str(layers[i]) if i == j else f"{layers[i]}-{layers[j]}")
        i = j + 1
    return ", ".join(parts) if parts else "none"


def parse_ranges(spec: str | Sequence[str], what: str = "windows", *, unit: str = "layer",
                 example: str = "3-12,13-40") -> list[tuple[int, int]]:
    """``"3-12,13-40"`` (commas and/or spaces) or ``["3-12", "13-40"]`` -> ``[(3, 12), (13, 40)]``. ``unit`` and
    ``example`` word the refusals (``fq cost-table --k`` ranges K values, not layers)."""
    if isinstance(spec, str):
        tokens = [t for t in re.split(r"[,\s]+", spec.strip()) if t]
    elif isinstance(spec, (list, tuple)):
        tokens = [str(t).strip() for t in spec]
    else:
        raise FqError(f"{what}: expected {unit} ranges like {example!r}, got {spec!r}")
    if not tokens:
        raise FqError(f"{what}: empty; expected {unit} ranges like {example!r}")
    out = []
    for token in tokens:
        m = _RANGE.match(token)
        if not m:
            if unit == "layer":
                raise FqError(f"{what} {_show(spec)}: {token!r} is not a layer range (expected A-B or A, e.g. "
                              f"{example})")
            raise FqError(f"{what} {_show(spec)}: {token!r} is not a {unit} value or range (expected {unit} or A-B, "
                          f"e.g. {example})")
        first = int(m.group(1))
        last = int(m.group(2)) if m.group(2) is not None else first
        if last < first:
            raise FqError(f"{what} {_show(spec)}: {token!r} runs backwards (expected first <= last)")
        out.append((first, last))
    return out


def check_partition(ranges: Sequence[tuple[int, int]], layers: Iterable[int], spec=None,
                    what: str = "windows") -> tuple[tuple[int, ...], ...]:
    """The layers of each range, refusing any partition that is not exactly ``layers`` once each."""
    layers = sorted(set(layers))
    wanted = set(layers)
    named = Counter(l for a, b in ranges for l in range(a, b + 1))
    shown = _show(spec if spec is not None else ",".join(f"{a}-{b}" if a != b else str(a) for a, b in ranges))
    problems = []
    missing = sorted(wanted - set(named))
    extra = sorted(set(named) - wanted)
    doubled = sorted(l for l, n in named.items() if n > 1)
    if missing:
        problems.append(f"layer(s) {format_layers(missing)} in no window")
    if extra:
        problems.append(f"layer(s) {format_layers(extra)} not encoded by the recipe (its MoE layers are {format_layers(layers)})")
    if doubled:
        where = ", ".join(f"{l} in " + " and ".join(f"{a}-{b}" for a, b in ranges if a <= l <= b) for l in doubled[:8])
        problems.append(f"layer(s) {format_layers(doubled)} named twice ({where})")
    if not problems:
        for (a0, b0), (a1, b1) in zip(ranges, ranges[1:]):
            if a1 < b0:
                problems.append(f"windows must be in ascending layer order ({a1}-{b1} comes after {a0}-{b0})")
                break
    if problems:
        raise FqError(f"{what} {shown}: " + "; ".join(problems))
    return tuple(tuple(l for l in range(a, b + 1)) for a, b in ranges)


def _show(spec) -> str:
    return repr(spec if isinstance(spec, str) else ",".join(str(s) for s in spec))
