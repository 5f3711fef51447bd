"""Expert selections for ``fq combine --experts``.

    all                 every expert of every layer
    0-31,40             these experts in every layer
    3:0-7,12;5:1        per layer: layer 3 experts 0-7 and 12, layer 5 expert 1 (other layers: none)

Numbers are decimal, ranges inclusive. Anything else is refused with the offending part named.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from fq.errors import FqError

_NUM = r"(?:0|[1-9][0-9]*)"
MAX_DIGITS = 9
_LIST = re.compile(rf"{_NUM}(?:-{_NUM})?(?:,{_NUM}(?:-{_NUM})?)*")


@dataclass(frozen=True)
class ExpertSelection:
    every_layer: frozenset[int] | None  # experts chosen in every layer; None with per_layer
    per_layer: dict[int, frozenset[int]] | None
    all: bool = False

    def chosen(self, layer: int, expert: int) -> bool:
        if self.all:
            return True
        if self.every_layer is not None:
            return expert in self.every_layer
        return expert in self.per_layer.get(layer, frozenset())

    def named(self) -> tuple[set[int] | None, dict[int, frozenset[int]]]:
        """What the user named explicitly, to check it exists in the product."""
        return (set(self.every_layer) if self.every_layer is not None else None), dict(self.per_layer or {})

    def describe(self) -> str:
        if self.all:
            return "all"
        if self.every_layer is not None:
            return _fmt(self.every_layer)
        return ";".join(f"{layer}:{_fmt(ex)}" for layer, ex in sorted(self.per_layer.items()))


def _fmt(experts) -> str:
    return ",".join(str(e) for e in sorted(experts))


def _number(text: str, where: str) -> int:
    """A decimal already matched by _NUM; more than MAX_DIGITS digits is refused before ``int`` sees it."""
    if len(text) > MAX_DIGITS:
        raise FqError(f"{where}: number {text[:12]}… has {len(text)} digits; layer and expert numbers have at most "
                      f"{MAX_DIGITS}")
    return int(text)


def _parse_list(text: str, where: str) -> frozenset[int]:
    if not _LIST.fullmatch(text):
        raise FqError(f"{where}: {text!r} is not a list of expert numbers and ranges like 0-7,12")
    out = set()
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        a, b = _number(lo, where), _number(hi or lo, where)
        if b < a:
            raise FqError(f"{where}: range {part!r} runs backwards")
        if b - a > 1 << 20:
            raise FqError(f"{where}: range {part!r} is implausibly large")
        out.update(range(a, b + 1))
    return frozenset(out)


def parse_selection(text: str) -> ExpertSelection:
    where = "--experts"
    if text == "all":
        return ExpertSelection(None, None, all=True)
    if ":" not in text:
        return ExpertSelection(_parse_list(text, where), None)
    per_layer: dict[int, frozenset[int]] = {}
    for group in text.split(";"):
        layer, sep, experts = group.partition(":")
        if not sep or not re.fullmatch(_NUM, layer):
            raise FqError(f"{where}: group {group!r} must be LAYER:EXPERTS, e.g. 3:0-7,12")
        if _number(layer, where) in per_layer:
            raise FqError(f"{where}: layer {layer} named twice")
        per_layer[int(layer)] = _parse_list(experts, f"{where} layer {layer}")
    return ExpertSelection(None, per_layer)
