"""The weight manifest: pure declarations of every logical weight and how it is sharded. No file, no
device: a manifest says *what* must be where; ``fq.tp.mesh.plan`` resolves it on a mesh.

A ``WeightEntry`` is one logical tensor: ``name`` (the torch weight name), ``layer``/``expert``
(``None`` when it has none), logical ``shape`` (torch ``(out, in)`` for a linear), ``dtype``
(``"exl3"`` for an EXL3 linear, else a safetensors dtype such as ``"BF16"``), ``role`` and a policy.

Policies (DTensor vocabulary, on the torch weight ``(out, in)``):

| policy | DTensor on the tp axis | EXL3 tensors each tp rank holds |
| --- | --- | --- |
| ``Replicate()`` | ``Replicate()`` | everything |
| ``SplitOutput()`` (gate/up) | ``Shard(0)`` | ``svh[a:b]``, ``trellis[:, a/16:b/16]``, ``suh`` whole |
| ``SplitInput(reduce=OP)`` (down) | ``Shard(1)``, output ``Partial`` | ``suh[a:b]``, ``trellis[a/16:b/16]``, ``svh`` whole |
| ``ExpertParallel(inner, assign)`` | ``inner`` on tp; one ep coordinate owns the expert | as ``inner`` |
| ``Tied(to=NAME)`` | whatever ``NAME`` has | the same bytes as ``NAME`` (an alias where co-resident) |
| ``Pinned(rank)`` | the whole tensor on one rank | everything |

A ``SplitInput`` produces partial sums: it names the declared ``Collective`` (an all-reduce) that
sums them. Collectives are declarations too, and the plan schedules each one exactly once, so a
missing or doubled reduction is visible instead of being merged away.

EXL3 splits must cut whole 128-blocks: the reconstruction applies a 128-point Hadamard transform
to blocks of rows and of columns (``fq.codec.hadamard``), so a slice that starts or ends inside a
block would need its neighbours' values. ``check_mesh`` refuses such a mesh and says which sizes work.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Union

from fq.core.canonical import dumps, sha256_hex
from fq.errors import FqError
from fq.model.shards import DTYPES

FORMAT = "fq-weight-manifest/1"
HAD = 128  # the Hadamard block: every EXL3 split boundary is a multiple of it
EXL3 = "exl3"
ROLES = ("router", "gate", "up", "down", "embed", "head", "dense", "attention", "shared")
EXPERT_ROLES = ("gate", "up", "down")
ASSIGNMENTS = ("contiguous", "strided")
AXES = ("tp", "ep")  # axes a collective may reduce over; pp stages talk point to point
KINDS = ("all_reduce",)
_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class Replicate:
    def to_json(self) -> dict:
        return {"policy": "replicate"}


@dataclass(frozen=True)
class SplitOutput:
    """Column-parallel: each tp rank holds output channels [a, b) of W (out, in)."""

    def to_json(self) -> dict:
        return {"policy": "split_output"}


@dataclass(frozen=True)
class SplitInput:
    """Row-parallel: each tp rank holds input channels [a, b) and produces a partial sum that the
    collective ``reduce`` adds up."""

    reduce: str

    def to_json(self) -> dict:
        return {"policy": "split_input", "reduce": self.reduce}


Inner = Union[Replicate, SplitOutput, SplitInput]


@dataclass(frozen=True)
class ExpertParallel:
    """Experts of a layer spread over the ep axis (``contiguous``: blocks of n/ep consecutive experts;
    ``strided``: expert i on ep rank i mod ep); within its owner, ``inner`` applies along tp."""

    inner: Inner
    assign: str = "contiguous"

    def to_json(self) -> dict:
        return {"policy": "expert_parallel", "assign": self.assign, "inner": self.inner.to_json()}


@dataclass(frozen=True)
class Tied:
    """The same tensor as entry ``to`` (e.g. lm_head tied to the embedding)."""

    to: str

    def to_json(self) -> dict:
        return {"policy": "tied", "to": self.to}


@dataclass(frozen=True)
class Pinned:
    """The whole tensor on one global rank."""

    rank: int

    def to_json(self) -> dict:
        return {"policy": "pinned", "rank": self.rank}


Policy = Union[Replicate, SplitOutput, SplitInput, ExpertParallel, Tied, Pinned]


def split_of(policy: Policy) -> Inner | None:
    """The along-tp behaviour of a policy (None for Tied/Pinned, resolved elsewhere)."""
    if isinstance(policy, ExpertParallel):
        return policy.inner
    if isinstance(policy, (Replicate, SplitOutput, SplitInput)):
        return policy
    return None


def split_dim(policy: Policy) -> int | None:
    """0 (output rows of W), 1 (input columns of W) or None (not split along tp)."""
    inner = split_of(policy)
    return 0 if isinstance(inner, SplitOutput) else 1 if isinstance(inner, SplitInput) else None


def reduce_of(policy: Policy) -> str | None:
    inner = split_of(policy)
    return inner.reduce if isinstance(inner, SplitInput) else None


@dataclass(frozen=True)
class WeightEntry:
    name: str
    layer: int | None
    expert: int | None
    shape: tuple[int, ...]
    dtype: str
    role: str
    policy: Policy
    # an EXL3 entry's tensors store its matrix times 2**n (fq.model.experts: the layout's stored scale, Laguna's
    # routed up_proj): a dense reconstruction of the matrix takes svh times 2**-n
    stored_scale_log2: int = 0

    def to_json(self) -> dict:
        out = {"name": self.name, "layer": self.layer, "expert": self.expert, "shape": list(self.shape),
               "dtype": self.dtype, "role": self.role, "policy": self.policy.to_json()}
        if self.stored_scale_log2:  # absent otherwise: every other manifest keeps its identity
            out["stored_scale_log2"] = self.stored_scale_log2
        return out


@dataclass(frozen=True)
class Collective:
    """One declared reduction: ``kind`` over the mesh ``axes`` of the stage that owns ``layer``."""

    name: str
    layer: int | None
    axes: tuple[str, ...] = ("tp",)
    kind: str = "all_reduce"

    def to_json(self) -> dict:
        return {"name": self.name, "layer": self.layer, "axes": list(self.axes), "kind": self.kind}


def _is_int(v) -> bool:
    return type(v) is int


@dataclass(frozen=True)
class TpManifest:
    """Entries and collectives, validated on construction (an invalid manifest cannot exist). ``tp``: the one tp
    size the manifest was declared for, where its policies depend on it (a whole-model base's linears are split only
    where that tp divides them, ``fq.tp.linears``); None: any tp."""

    entries: tuple[WeightEntry, ...]
    collectives: tuple[Collective, ...] = ()
    tp: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "entries", tuple(self.entries))
        object.__setattr__(self, "collectives", tuple(self.collectives))
        object.__setattr__(self, "_by_name", {e.name: e for e in self.entries})
        validate(self)

    def entry(self, name: str) -> WeightEntry:
        try:
            return self._by_name[name]
        except KeyError:
            raise FqError(f"manifest: no entry {name!r}") from None

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(sorted({e.layer for e in self.entries if e.layer is not None}))

    def to_json(self) -> dict:
        out = {"format": FORMAT, "entries": [e.to_json() for e in self.entries],
               "collectives": [c.to_json() for c in self.collectives]}
        if self.tp is not None:  # absent otherwise: a tp-free manifest keeps its identity
            out["tp"] = self.tp
        return out

    @property
    def sha256(self) -> str:
        return sha256_hex(dumps(self.to_json()))


def validate(m: TpManifest) -> None:
    """Identities, shapes, policies, ties and collectives; every error names the entry and the fix."""
    if m.tp is not None and (not _is_int(m.tp) or m.tp < 1):
        raise FqError(f"manifest: tp must be a positive integer or None, got {m.tp!r}")
    seen: set[str] = set()
    for e in m.entries:
        w = f"manifest entry {e.name!r}"
        if not isinstance(e.name, str) or not _NAME.fullmatch(e.name):
            raise FqError(f"{w}: name must be letters, digits, '_', '.', '-'")
        if e.name in seen:
            raise FqError(f"{w}: declared twice (entry names are identities)")
        seen.add(e.name)
        for label, v in (("layer", e.layer), ("expert", e.expert)):
            if v is not None and (not _is_int(v) or v < 0):
                raise FqError(f"{w}: {label} must be a non-negative integer or None, got {v!r}")
        if e.role not in ROLES:
            raise FqError(f"{w}: role {e.role!r}, expected one of {', '.join(ROLES)}")
        if (e.expert is not None) != (e.role in EXPERT_ROLES):
            raise FqError(f"{w}: role {e.role} {'needs' if e.role in EXPERT_ROLES else 'takes no'} expert id")
        if e.expert is not None and e.layer is None:
            raise FqError(f"{w}: an expert belongs to a layer; layer is None")
        if e.layer is None and e.role not in ("embed", "head") and not isinstance(e.policy, Pinned):
            raise FqError(f"{w}: a weight outside any layer needs role embed (first pipeline stage), role head "
                          "(last stage) or a Pinned rank")
        if not isinstance(e.shape, tuple) or not e.shape or not all(_is_int(d) and d > 0 for d in e.shape):
            raise FqError(f"{w}: shape must be a non-empty tuple of positive integers, got {e.shape!r}")
        if e.dtype == EXL3:
            if len(e.shape) != 2 or e.shape[0] % HAD or e.shape[1] % HAD:
                raise FqError(f"{w}: an EXL3 linear is (out, in) with both multiples of {HAD}, got {list(e.shape)}")
        elif e.dtype not in DTYPES:
            raise FqError(f"{w}: dtype {e.dtype!r}, expected 'exl3' or a safetensors dtype ({', '.join(DTYPES)})")
        _check_policy(m, e, w)
    ops = {}
    for c in m.collectives:
        w = f"manifest collective {c.name!r}"
        if not isinstance(c.name, str) or not _NAME.fullmatch(c.name):
            raise FqError(f"{w}: name must be letters, digits, '_', '.', '-'")
        if c.name in ops:
            raise FqError(f"{w}: declared twice; each reduction is one declared operation")
        if c.kind not in KINDS:
            raise FqError(f"{w}: kind {c.kind!r}, expected one of {', '.join(KINDS)}")
        if not isinstance(c.axes, tuple) or not c.axes or len(set(c.axes)) != len(c.axes) \
                or not set(c.axes) <= set(AXES):
            raise FqError(f"{w}: axes {c.axes!r} must be distinct names from {AXES}")
        if c.layer is not None and (not _is_int(c.layer) or c.layer < 0):
            raise FqError(f"{w}: layer must be a non-negative integer or None")
        ops[c.name] = c
    contributors: dict[str, list[WeightEntry]] = {}
    for e in m.entries:
        op = reduce_of(e.policy)
        if op is None:
            continue
        if op not in ops:
            raise FqError(f"manifest entry {e.name!r}: reduces into {op!r}, which is not a declared collective "
                          "(declare it, or its partial sums are never added)")
        c = ops[op]
        if c.layer != e.layer:
            raise FqError(f"manifest entry {e.name!r}: layer {e.layer} reduces into {op!r} of layer {c.layer}")
        if "tp" not in c.axes:
            raise FqError(f"manifest collective {op!r}: sums input-split {e.name!r}, so it must reduce over 'tp'")
        if isinstance(e.policy, ExpertParallel) and "ep" not in c.axes:
            raise FqError(f"manifest collective {op!r}: sums expert-parallel {e.name!r}, so it must reduce over 'ep' "
                          "too (each expert lives on one ep rank)")
        contributors.setdefault(op, []).append(e)
    for name in ops:
        if name not in contributors:
            raise FqError(f"manifest collective {name!r}: no entry reduces into it (a declared reduction with "
                          "nothing to reduce is a mistake)")


def _check_policy(m: TpManifest, e: WeightEntry, w: str) -> None:
    p = e.policy
    if isinstance(p, ExpertParallel):
        if e.expert is None:
            raise FqError(f"{w}: expert-parallel needs an expert id")
        if p.assign not in ASSIGNMENTS:
            raise FqError(f"{w}: assignment {p.assign!r}, expected one of {', '.join(ASSIGNMENTS)}")
        if not isinstance(p.inner, (Replicate, SplitOutput, SplitInput)):
            raise FqError(f"{w}: expert-parallel inner policy must be replicate, split_output or split_input")
    elif isinstance(p, Tied):
        target = m._by_name.get(p.to)
        if target is None or target is e:
            raise FqError(f"{w}: tied to {p.to!r}, which is {'itself' if target is e else 'not declared'}")
        if isinstance(target.policy, Tied):
            raise FqError(f"{w}: tied to {p.to!r}, which is itself tied; tie to the owner")
        if (target.shape, target.dtype) != (e.shape, e.dtype):
            raise FqError(f"{w}: tied to {p.to!r} but is {e.dtype} {list(e.shape)}, the target "
                          f"{target.dtype} {list(target.shape)}")
        if isinstance(target.policy, ExpertParallel) or e.expert is not None:
            raise FqError(f"{w}: ties between experts are not supported (tie dense weights)")
    elif isinstance(p, Pinned):
        if not _is_int(p.rank) or p.rank < 0:
            raise FqError(f"{w}: pinned rank must be a non-negative integer")
    elif not isinstance(p, (Replicate, SplitOutput, SplitInput)):
        raise FqError(f"{w}: unknown policy {p!r}")
    if split_dim(p) is not None and len(e.shape) != 2:
        raise FqError(f"{w}: only 2-D weights split along tp, got shape {list(e.shape)}")


# -- mesh-dependent checks (pure arithmetic) ----------------------------------------------------

def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def split_sizes_that_work(n: int, exl3: bool) -> list[int]:
    """tp sizes that cut ``n`` evenly (and, for EXL3, into whole 128-blocks)."""
    return divisors(n // HAD) if exl3 else divisors(n)


def effective(m: TpManifest, e: WeightEntry) -> Policy:
    return m.entry(e.policy.to).policy if isinstance(e.policy, Tied) else e.policy


def check_mesh(m: TpManifest, tp: int, ep: int, pp: int) -> None:
    """Refuse a mesh the manifest cannot be cut for, saying which sizes would work."""
    for label, v in (("tp", tp), ("ep", ep), ("pp", pp)):
        if not _is_int(v) or v < 1:
            raise FqError(f"mesh: {label} must be a positive integer, got {v!r}")
    if m.tp is not None and tp != m.tp:
        raise FqError(f"mesh: tp={tp}, but the manifest was declared for tp={m.tp} (which of its linears split "
                      f"depends on tp); declare it for tp={tp}")
    splits = [(e, split_dim(effective(m, e))) for e in m.entries]
    splits = [(e, d) for e, d in splits if d is not None]
    good = None
    for e, d in splits:
        ok = set(split_sizes_that_work(e.shape[d], e.dtype == EXL3))
        good = ok if good is None else good & ok
    for e, d in splits:
        n = e.shape[d]
        axis = "out" if d == 0 else "in"
        works = ", ".join(map(str, sorted(good)))
        hint = f"TP sizes that work for this manifest: {works}"
        if any(isinstance(effective(m, x), ExpertParallel) for x, _ in splits):
            hint += "; or use expert parallelism (--ep) with one of those TP sizes"
        if n % tp:
            raise FqError(f"{e.name}: {axis} {n} / {tp} is not an integer; {hint}")
        if e.dtype == EXL3 and (n // tp) % HAD:
            raise FqError(f"{e.name}: {axis} {n} / {tp} = {n // tp} is not a multiple of {HAD} (an EXL3 split "
                          f"must cut whole {HAD}-wide Hadamard blocks); {hint}")
    counts: dict[int, set[int]] = {}
    for e in m.entries:
        if isinstance(e.policy, ExpertParallel):
            counts.setdefault(e.layer, set()).add(e.expert)
    for layer, experts in sorted(counts.items()):
        if len(experts) % ep:
            common = math.gcd(*[len(x) for x in counts.values()])
            raise FqError(f"layer {layer}: {len(experts)} experts do not divide over ep={ep}; EP sizes that work: "
                          f"{', '.join(map(str, divisors(common)))}")
    if pp > len(m.layers) and m.layers:
        raise FqError(f"mesh: pp={pp} stages but only {len(m.layers)} layers; use pp <= {len(m.layers)}")
    for e in m.entries:
        if isinstance(e.policy, Pinned) and e.policy.rank >= tp * ep * pp:
            raise FqError(f"{e.name}: pinned to rank {e.policy.rank}, the mesh has {tp * ep * pp} ranks (0.."
                          f"{tp * ep * pp - 1})")
