"""K of routed experts: one number, or one per projection and per layer (a budgeted base's allocation).

exllamav3's loader takes one K per projection of a layer for all its experts (gate, up and down may differ, and every
layer may differ): ``exllamav3/modules/multilinear.py``. fq's expert K therefore has two shapes:

- a **fragment spec**, what one (node, layer, block) fragment holds: an ``int`` (every linear at that K) or a mapping
  ``{"gate": K, "up": K, "down": K}`` over the canonical projections (``fq.model.source.PROJECTIONS``, whatever the
  checkpoint calls them);
- a **node spec**, what a node's experts are across layers: an ``int`` (every layer), or ``{layer: fragment spec}``.

A uniform mapping is normalised to its ``int``, so a budgeted base whose allocation happens to be uniform writes the
same bytes as a fixed-K base. In JSON (plans, predicates, assemblies) a fragment spec is the int or the mapping; a
node spec's layers are string keys. In a safetensors header (strings only) a fragment spec is ``"3"`` or the
canonical JSON of the mapping.

"One K" is an ``int`` 1..8 or one of exllamav3's half-integer rates 1.5, 2.5, 3.5 (a ``float``; mul1 only, checked
where the codebook is known: recipes and the encoder); ``is_one`` tells it from a mapping. A header writes ``"1.5"``.
"""
from __future__ import annotations

import json
import re
from typing import Iterable, Mapping, Union

from fq.errors import FqError

PROJECTIONS = ("gate", "up", "down")  # as fq.model.source.PROJECTIONS (not imported: core sits below model)
K_RANGE = range(1, 9)

# exllamav3 1.6.5's half-integer rates (mul1 codebook only: fq.codec.rate checks that where the codebook is known)
HALF_KS = (1.5, 2.5, 3.5)

FragmentK = Union[int, float, Mapping[str, Union[int, float]]]
NodeK = Union[int, float, Mapping[int, FragmentK]]


def is_one(spec) -> bool:
    """Whether a spec is one K (an int, or a half-integer float), not a mapping."""
    return isinstance(spec, (int, float)) and not isinstance(spec, bool)


def _k(value, where: str) -> int | float:
    """An integer K in 1..8 or a half-integer 1.5, 2.5, 3.5 (a float; 2.0 is refused, so an integer K stays an int)."""
    if isinstance(value, bool) or not (isinstance(value, int) and value in K_RANGE
                                       or isinstance(value, float) and value in HALF_KS):
        raise FqError(f"{where}: expected an integer K in 1..8 or a half-integer K 1.5, 2.5, 3.5, got {value!r}")
    return value


def fragment(spec, where: str = "K") -> FragmentK:
    """A checked, normalised fragment spec (a uniform mapping becomes its int)."""
    if isinstance(spec, Mapping):
        if sorted(spec) != sorted(PROJECTIONS):
            raise FqError(f"{where}: expected K for exactly the projections {', '.join(PROJECTIONS)}, "
                          f"got {', '.join(map(str, spec)) or 'none'}")
        out = {p: _k(spec[p], f"{where}.{p}") for p in PROJECTIONS}
        return out["gate"] if len(set(out.values())) == 1 else out
    return _k(spec, where)


def _per_projection(spec) -> bool:
    """Whether a mapping is a fragment spec's {gate, up, down} (not a node spec's {layer: ...})."""
    return len(spec) == len(PROJECTIONS) and all(p in spec for p in PROJECTIONS)


def proj(spec: FragmentK, projection: str) -> int:
    """The K of one canonical projection (gate, up, down) under a fragment spec."""
    return spec if is_one(spec) else spec[projection]


def at_layer(spec: NodeK, layer: int, where: str = "K") -> FragmentK:
    """A node spec's fragment spec at ``layer``."""
    if is_one(spec):
        return spec
    try:
        return spec[layer]
    except KeyError:
        raise FqError(f"{where}: no K for layer {layer} (layers {', '.join(map(str, sorted(spec)))})") from None


_LAYER = re.compile(r"0|[1-9][0-9]{0,8}")


def _layer(layer, where: str) -> int:
    """A node spec's layer key: a non-negative int, or its decimal string (JSON keys)."""
    if isinstance(layer, str) and _LAYER.fullmatch(layer):
        return int(layer)
    if type(layer) is int and layer >= 0:
        return layer
    raise FqError(f"{where}: layer {layer!r} is not a decimal layer number")


def node(spec, where: str = "K") -> NodeK:
    """A checked node spec; a per-layer mapping whose layers all hold one int K becomes that int."""
    if isinstance(spec, Mapping):
        out = {_layer(layer, where): fragment(s, f"{where}[{layer}]") for layer, s in spec.items()}
        if len(out) != len(spec):
            raise FqError(f"{where}: a layer is named twice ({', '.join(map(repr, spec))})")
        if not out:
            raise FqError(f"{where}: expected K per layer, got an empty mapping")
        values = {json.dumps(v, sort_keys=True) for v in out.values()}
        return next(iter(out.values())) if len(values) == 1 and is_one(next(iter(out.values()))) else out
    return _k(spec, where)


def to_json(spec):
    """A fragment or node spec as JSON data (layers as string keys, in layer order)."""
    if is_one(spec):
        return spec
    if _per_projection(spec):
        return {p: spec[p] for p in PROJECTIONS}
    return {str(layer): to_json(spec[layer]) for layer in sorted(spec)}


def to_meta(spec: FragmentK) -> str:
    """A fragment spec as a safetensors header string."""
    return str(spec) if is_one(spec) else json.dumps(to_json(spec), sort_keys=True, separators=(",", ":"))


def from_meta(text: str, where: str = "K") -> FragmentK:
    """The inverse of ``to_meta``, refusing anything else."""
    if isinstance(text, str) and re.fullmatch(r"[0-9]+(\.5)?", text):
        value = float(text) if "." in text else int(text)
        if text != str(value):
            raise FqError(f"{where}: expected an integer K or the canonical JSON of K per projection, got {text!r}")
        return fragment(value, where)
    try:
        data = json.loads(text)
    except (TypeError, ValueError):
        raise FqError(f"{where}: expected an integer K or a JSON object of K per projection, got {text!r}") from None
    if not isinstance(data, Mapping) or to_meta(fragment(data, where)) != text:
        raise FqError(f"{where}: expected an integer K or the canonical JSON of K per projection, got {text!r}")
    return fragment(data, where)


def bits(spec) -> float:
    """Mean trellis bits per expert weight: gate, up and down hold equally many weights (intermediate x hidden)."""
    if is_one(spec):
        return float(spec)
    if _per_projection(spec):
        return sum(spec[p] for p in PROJECTIONS) / len(PROJECTIONS)
    return sum(bits(s) for s in spec.values()) / len(spec)


def describe(spec) -> str:
    """``K3``, ``gate/up K2, down K3``, or per layer ``L1 K2 / L2 gate/up K2, down K3``."""
    if is_one(spec):
        return f"K{spec}"
    if _per_projection(spec):
        if spec["gate"] == spec["up"]:
            return f"gate/up K{spec['gate']}, down K{spec['down']}"
        return ", ".join(f"{p} K{spec[p]}" for p in PROJECTIONS)
    return " / ".join(f"L{layer} {describe(spec[layer])}" for layer in sorted(spec))


def of_layout(spec: FragmentK, projections: Iterable[str]) -> dict:
    """``{name: K}`` for a checkpoint's own projection names, given in canonical order (``ExpertLayout.projections``:
    gate, up, down, whatever the checkpoint calls them)."""
    names = tuple(projections)
    if len(names) != len(PROJECTIONS):
        raise FqError(f"expected the names of the projections {', '.join(PROJECTIONS)}, got {', '.join(names)}")
    return {name: proj(spec, p) for name, p in zip(names, PROJECTIONS)}


def node_at(data, layer: int, where: str = "K") -> FragmentK:
    """The fragment spec a node spec (as JSON, or already checked) gives ``layer``: what every fragment of that
    node at that layer must hold."""
    return at_layer(node(data, where), layer, where)


def chain_bits(specs: Iterable) -> Union[int, float]:
    """The bits per weight of a chain of nodes (node specs, as JSON or checked): the sum of each node's ``bits``; an
    int when every node is one int K (a fixed-K chain's sum of K, as before)."""
    nodes = [node(s) for s in specs]
    if all(is_one(n) for n in nodes):
        return sum(nodes)
    return sum(bits(n) for n in nodes)
