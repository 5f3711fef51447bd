"""The rule -> script contract: what each encoding job's Snakemake params carry, as small typed records.

The campaign builds them (``Campaign.encode_spec``, ``native_spec``, ``weight_only_spec``, ``linear_spec``,
``share_spec``), the rules hand Snakemake their JSON (plain dicts: what Snakemake records and compares as a job's
params is what it was before these records existed, so no committed job reruns for them), and each script reads its
record back with ``from_json``, which refuses a missing, extra or mistyped field by name.

    HessianRef(path, binding, weighting)                the Hessian file a job encodes against, its binding, weighting
    AncestorRef(node, codebook, digest, path)           a committed (or twin) fragment a stage's job corrects
    BlockSpec(block, experts, sources, ancestors)       one block of an encode job
    EncodeSpec(node, role, K, codebook, node_digest, layer, blocks, layout, hessian)
    NativeSpec(K, codebook, layer, block, experts, sources, layout, hessian)
    WeightOnlySpec(node, role, K, codebook, node_digest, layer, block, experts, sources, ancestors, layout)
    LinearSpec(node, cls, K, codebook, node_digest, layer, sources, hessian, ancestors)
    ShareSpec(node, node_digest, owner, owner_digest, layer, block, owner_fragment, owner_metrics, layout)
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass

from fq.errors import FqError


class _Record:
    """to_json / from_json for a frozen dataclass of JSON values, nested records and tuples of either."""

    _json_names: typing.ClassVar[dict] = {}  # field -> its key in the JSON, where they differ

    def to_json(self) -> dict:
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            out[self._json_names.get(f.name, f.name)] = _dump(v)
        return out

    @classmethod
    def from_json(cls, doc, where: str = "job spec"):
        if not isinstance(doc, dict):
            raise FqError(f"{where}: expected a {cls.__name__} (an object), got {type(doc).__name__}")
        hints = typing.get_type_hints(cls)
        fields = {cls._json_names.get(f.name, f.name): f for f in dataclasses.fields(cls)}
        extra = sorted(set(doc) - set(fields))
        if extra:
            raise FqError(f"{where}: {cls.__name__} has no field {', '.join(map(repr, extra))}")
        kwargs = {}
        for key, f in fields.items():
            if key not in doc:
                if key == "digest" and cls is AncestorRef:  # a twin's ancestor has none
                    kwargs[f.name] = None
                    continue
                if f.default is dataclasses.MISSING:
                    raise FqError(f"{where}: {cls.__name__} field {key!r} missing")
                continue
            kwargs[f.name] = _load(hints[f.name], doc[key], f"{where}.{key}")
        return cls(**kwargs)


def _dump(v):
    if isinstance(v, _Record):
        return v.to_json()
    if isinstance(v, tuple):
        return [_dump(x) for x in v]
    return v


def _load(hint, value, where: str):
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for a in inner:  # the first that takes the value (records before plain values)
            try:
                return _load(a, value, where)
            except FqError:
                if a is inner[-1]:
                    raise
        raise FqError(f"{where}: expected {hint}, got {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise FqError(f"{where}: expected a list, got {type(value).__name__}")
        return tuple(_load(args[0], x, f"{where}[{i}]") for i, x in enumerate(value))
    if isinstance(hint, type) and issubclass(hint, _Record):
        return hint.from_json(value, where)
    if hint is typing.Any:
        return value
    want = origin or hint
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, want) or isinstance(value, bool) and want is not bool:
        raise FqError(f"{where}: expected {getattr(want, '__name__', want)}, got {value!r}")
    return value


# K as the rules carry it: an integer (or a half-integer float), or a budgeted base's per-projection map
# (fq.core.kbits.to_json); a linear node's K is one number
KValue = typing.Union[int, float, dict]


@dataclass(frozen=True)
class HessianRef(_Record):
    path: str
    binding: str
    # the campaign's calibration.weighting, which the bound Hessian must have been captured with; absent from the JSON
    # when none, so that an unweighted campaign's job params are what they were
    weighting: str = "none"

    def to_json(self) -> dict:
        out = super().to_json()
        if self.weighting == "none":
            del out["weighting"]
        return out


@dataclass(frozen=True)
class AncestorRef(_Record):
    node: str
    codebook: str
    digest: str | None  # the ancestor node's recipe digest (None, and absent from the JSON, for a twin's ancestor)
    path: str

    def to_json(self) -> dict:
        out = super().to_json()
        if self.digest is None:
            del out["digest"]
        return out


@dataclass(frozen=True)
class BlockSpec(_Record):
    block: int
    experts: tuple[int, ...]
    sources: dict  # {expert: {projection: fq.model.formats.ExpertSource as JSON}}
    ancestors: tuple[AncestorRef, ...]


@dataclass(frozen=True)
class EncodeSpec(_Record):
    """An encode job (a block, or a whole layer of the node: encode.per_job)."""

    node: str
    role: str  # base | stage
    K: KValue
    codebook: str
    node_digest: str
    layer: int
    blocks: tuple[BlockSpec, ...]
    layout: dict  # fq.model.experts.ExpertLayout as JSON
    hessian: HessianRef | None


@dataclass(frozen=True)
class NativeSpec(_Record):
    """A one-pass comparison encode (the native point a chain is compared with)."""

    K: int
    codebook: str
    layer: int
    block: int
    experts: tuple[int, ...]
    sources: dict
    layout: dict
    hessian: HessianRef | None


@dataclass(frozen=True)
class WeightOnlySpec(_Record):
    """A fragment's weight-only twin (calibration.compare_weight_only), its chain the ancestors' twins."""

    node: str
    role: str
    K: KValue
    codebook: str
    node_digest: str
    layer: int
    block: int
    experts: tuple[int, ...]
    sources: dict
    ancestors: tuple[AncestorRef, ...]
    layout: dict


@dataclass(frozen=True)
class LinearSpec(_Record):
    """A linear job: one class of a layer's non-expert linears (or the head) of one linear node."""

    _json_names: typing.ClassVar[dict] = {"cls": "class"}

    node: str
    cls: str
    K: int | float
    codebook: str
    node_digest: str
    layer: int | None  # None: the head
    sources: dict  # {linear: ExpertSource as JSON}, read from the committed skeleton
    hessian: HessianRef | None
    ancestors: tuple[AncestorRef, ...]


@dataclass(frozen=True)
class ShareSpec(_Record):
    """A share job: a base publishing another (owner) base's committed expert encoding of one block."""

    node: str
    node_digest: str
    owner: str
    owner_digest: str
    layer: int
    block: int
    owner_fragment: str
    owner_metrics: str
    layout: dict
