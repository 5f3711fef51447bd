"""A device mesh and the pure planner: ``plan(manifest, mesh) -> MeshPlan``.

``DeviceMesh(tp, ep, pp, epoch)``: ranks are numbered ``rank = (pp_i * ep + ep_i) * tp + tp_i`` (tp
fastest, so a tp group is a run of neighbouring ranks). The ``epoch`` names one admission of the
mesh: a mesh re-admitted after a change gets a new epoch, and anything planned or loaded for an
older epoch is refused (``fq.tp.store``).

The plan says, for every rank, which entries it holds and the exact slice of each (``Slice(dim,
start, stop)`` on the torch weight ``(out, in)``), which layers each pipeline stage owns and where the
stage boundaries are, and the collective schedule: one step per declared ``Collective``, in
declaration order, with its process groups and contributors — never merged, so a missing or
doubled reduction shows. Planning reads no file and touches no device; the same manifest and mesh
give the same plan (and the same ``sha256``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from fq.core.canonical import dumps, sha256_hex
from fq.errors import FqError
from fq.tp.manifest import (ExpertParallel, TpManifest, Pinned, Replicate, SplitInput, SplitOutput, Tied, check_mesh,
                            effective, reduce_of)

FORMAT = "fq-mesh-plan/1"
AXES = ("pp", "ep", "tp")


@dataclass(frozen=True)
class DeviceMesh:
    tp: int = 1
    ep: int = 1
    pp: int = 1
    epoch: int = 0

    def __post_init__(self):
        for label in ("tp", "ep", "pp"):
            v = getattr(self, label)
            if type(v) is not int or v < 1:
                raise FqError(f"mesh: {label} must be a positive integer, got {v!r}")
        if type(self.epoch) is not int or self.epoch < 0:
            raise FqError(f"mesh: epoch must be a non-negative integer, got {self.epoch!r}")

    @property
    def size(self) -> int:
        return self.tp * self.ep * self.pp

    def rank(self, pp: int, ep: int, tp: int) -> int:
        return (pp * self.ep + ep) * self.tp + tp

    def coords(self, rank: int) -> dict:
        if not 0 <= rank < self.size:
            raise FqError(f"mesh: rank {rank} outside 0..{self.size - 1}")
        return {"pp": rank // (self.tp * self.ep), "ep": rank // self.tp % self.ep, "tp": rank % self.tp}

    def readmitted(self, **shape) -> "DeviceMesh":
        """The mesh after a re-admission (same or new shape): the next epoch."""
        return replace(self, **shape, epoch=self.epoch + 1)

    def same_shape(self, other: "DeviceMesh") -> bool:
        return (self.tp, self.ep, self.pp) == (other.tp, other.ep, other.pp)

    def describe(self) -> str:
        return f"tp={self.tp} ep={self.ep} pp={self.pp} epoch {self.epoch}"

    def to_json(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "pp": self.pp, "epoch": self.epoch}


@dataclass(frozen=True)
class Slice:
    """Rows (dim 0, output channels) or columns (dim 1, input channels) [start, stop) of W (out, in)."""

    dim: int
    start: int
    stop: int

    def to_json(self) -> dict:
        return {"dim": self.dim, "start": self.start, "stop": self.stop}

    def describe(self) -> str:
        return f"{'out' if self.dim == 0 else 'in'}[{self.start}:{self.stop}]"


@dataclass(frozen=True)
class Placement:
    rank: int
    entry: str
    slice: Slice | None  # None: the whole tensor
    source: str  # the entry whose bytes fill it (itself, or the target of a tie)
    alias: bool  # a tie whose target is already on this rank with the same slice: no allocation
    placements: tuple[str, str]  # DTensor-style placement on the (ep, tp) axes, for people

    def to_json(self) -> dict:
        return {"entry": self.entry, "slice": self.slice.to_json() if self.slice else None,
                "source": self.source, "alias": self.alias, "placements": list(self.placements)}


@dataclass(frozen=True)
class Stage:
    stage: int
    layers: tuple[int, ...]
    ranks: tuple[int, ...]

    def to_json(self) -> dict:
        return {"stage": self.stage, "layers": list(self.layers), "ranks": list(self.ranks)}


@dataclass(frozen=True)
class Boundary:
    """Activations cross from ``from_stage`` (after ``after_layer``) to ``to_stage`` (before ``before_layer``)."""

    after_layer: int
    before_layer: int
    from_stage: int
    to_stage: int

    def to_json(self) -> dict:
        return {"after_layer": self.after_layer, "before_layer": self.before_layer,
                "from_stage": self.from_stage, "to_stage": self.to_stage}


@dataclass(frozen=True)
class Step:
    """One scheduled collective: exactly one per declared operation."""

    index: int
    op: str
    kind: str
    layer: int | None
    stage: int
    axes: tuple[str, ...]
    groups: tuple[tuple[int, ...], ...]  # disjoint process groups, each runs the op once
    contributors: tuple[str, ...]

    def group_of(self, rank: int) -> tuple[int, ...] | None:
        return next((g for g in self.groups if rank in g), None)

    def to_json(self) -> dict:
        return {"index": self.index, "op": self.op, "kind": self.kind, "layer": self.layer, "stage": self.stage,
                "axes": list(self.axes), "groups": [list(g) for g in self.groups],
                "contributors": list(self.contributors)}


@dataclass(frozen=True)
class MeshPlan:
    mesh: DeviceMesh
    manifest: TpManifest
    stages: tuple[Stage, ...]
    boundaries: tuple[Boundary, ...]
    placements: tuple[Placement, ...]  # by rank, then manifest order
    schedule: tuple[Step, ...]
    _by_rank: dict = field(default_factory=dict, repr=False, compare=False)

    def for_rank(self, rank: int) -> tuple[Placement, ...]:
        self.mesh.coords(rank)
        if not self._by_rank:
            for p in self.placements:
                self._by_rank.setdefault(p.rank, []).append(p)
        return tuple(self._by_rank.get(rank, ()))

    def stage_of_rank(self, rank: int) -> Stage:
        return self.stages[self.mesh.coords(rank)["pp"]]

    def to_json(self) -> dict:
        devices = []
        for r in range(self.mesh.size):
            devices.append({"rank": r, "coords": self.mesh.coords(r), "stage": self.mesh.coords(r)["pp"],
                            "placements": [p.to_json() for p in self.for_rank(r)]})
        return {"format": FORMAT, "mesh": self.mesh.to_json(), "manifest_sha256": self.manifest.sha256,
                "stages": [s.to_json() for s in self.stages], "boundaries": [b.to_json() for b in self.boundaries],
                "devices": devices, "schedule": [s.to_json() for s in self.schedule]}

    @property
    def sha256(self) -> str:
        return sha256_hex(dumps(self.to_json()))


def _stages(layers: tuple[int, ...], mesh: DeviceMesh) -> tuple[Stage, ...]:
    """Contiguous runs of layers, sizes differing by at most one (earlier stages take the extra)."""
    n, pp = len(layers), mesh.pp
    out, pos = [], 0
    for s in range(pp):
        k = n // pp + (1 if s < n % pp else 0)
        ranks = tuple(mesh.rank(s, e, t) for e in range(mesh.ep) for t in range(mesh.tp))
        out.append(Stage(s, layers[pos:pos + k], ranks))
        pos += k
    return tuple(out)


def tp_slice(n: int, dim: int, t: int, tp: int) -> Slice:
    """tp rank ``t``'s equal share of ``n`` channels along ``dim`` (the planner's and tp-export's one cut)."""
    step = n // tp
    return Slice(dim, t * step, (t + 1) * step)


def _expert_owner(m: TpManifest, mesh: DeviceMesh) -> dict[tuple[int, int], int]:
    """(layer, expert) -> ep coordinate, by each layer's experts in ascending id order."""
    per_layer: dict[int, dict[int, str]] = {}
    for e in m.entries:
        if isinstance(e.policy, ExpertParallel):
            per_layer.setdefault(e.layer, {})[e.expert] = e.policy.assign
    owner = {}
    for layer, experts in per_layer.items():
        ids = sorted(experts)
        chunk = len(ids) // mesh.ep
        for i, x in enumerate(ids):
            owner[(layer, x)] = i // chunk if experts[x] == "contiguous" else i % mesh.ep
    return owner


def plan(manifest: TpManifest, mesh: DeviceMesh) -> MeshPlan:
    """Resolve every entry on ``mesh``. Pure and deterministic; refuses a mesh the manifest cannot use."""
    if not isinstance(manifest, TpManifest):
        raise FqError(f"plan: expected a TpManifest, got {type(manifest).__name__}")
    check_mesh(manifest, mesh.tp, mesh.ep, mesh.pp)
    layers = manifest.layers
    stages = _stages(layers, mesh)
    stage_of = {L: s.stage for s in stages for L in s.layers}
    owner = _expert_owner(manifest, mesh)

    def stage(e) -> int:
        if e.layer is not None:
            return stage_of[e.layer]
        if isinstance(e.policy, Pinned):
            return mesh.coords(e.policy.rank)["pp"]
        return 0 if e.role == "embed" else mesh.pp - 1

    def cells(e) -> list[tuple[int, Slice | None, tuple[str, str]]]:
        """(rank, slice, placements) of the tensor ``e`` describes, under its (tie-resolved) policy."""
        pol = effective(manifest, e)
        if isinstance(pol, Pinned):
            return [(pol.rank, None, ("Pinned", "Pinned"))]
        s = stages[stage(e)]
        ep_place = "Replicate()"
        if isinstance(pol, ExpertParallel):
            key = (e.layer, e.expert) if e.expert is not None else None
            g = owner[key]
            ranks = [r for r in s.ranks if mesh.coords(r)["ep"] == g]
            ep_place, pol = "Shard(expert)", pol.inner
        else:
            ranks = list(s.ranks)
        out = []
        for r in ranks:
            t = mesh.coords(r)["tp"]
            if isinstance(pol, SplitOutput):
                out.append((r, tp_slice(e.shape[0], 0, t, mesh.tp), (ep_place, "Shard(0)")))
            elif isinstance(pol, SplitInput):
                out.append((r, tp_slice(e.shape[1], 1, t, mesh.tp), (ep_place, "Shard(1)")))
            else:
                out.append((r, None, (ep_place, "Replicate()")))
        return out

    placements = []
    for e in manifest.entries:
        if isinstance(e.policy, Tied):
            target = manifest.entry(e.policy.to)
            at_target = {(r, sl) for r, sl, _ in cells(target)}
            for r, sl, pl in cells(e):
                placements.append(Placement(r, e.name, sl, target.name, (r, sl) in at_target, pl))
        else:
            for r, sl, pl in cells(e):
                placements.append(Placement(r, e.name, sl, e.name, False, pl))
    order = {e.name: i for i, e in enumerate(manifest.entries)}
    placements.sort(key=lambda p: (p.rank, order[p.entry]))

    boundaries = []
    for a, b in zip(stages, stages[1:]):
        if a.layers and b.layers:
            boundaries.append(Boundary(a.layers[-1], b.layers[0], a.stage, b.stage))

    schedule = []
    for i, c in enumerate(manifest.collectives):
        contrib = [e for e in manifest.entries if reduce_of(effective(manifest, e)) == c.name]
        st = {stage(e) for e in contrib}
        if len(st) != 1:
            raise FqError(f"manifest collective {c.name!r}: contributors sit on pipeline stages {sorted(st)}; "
                          "one reduction runs inside one stage")
        s = stages[st.pop()]
        keep = [a for a in ("ep", "tp") if a not in c.axes]
        groups: dict[tuple, list[int]] = {}
        for r in s.ranks:
            co = mesh.coords(r)
            groups.setdefault(tuple(co[a] for a in keep), []).append(r)
        schedule.append(Step(i, c.name, c.kind, c.layer, s.stage, c.axes,
                             tuple(tuple(g) for _, g in sorted(groups.items())), tuple(e.name for e in contrib)))
    result = MeshPlan(mesh, manifest, stages, tuple(boundaries), tuple(placements), tuple(schedule))
    check_coverage(result)
    return result


def check_coverage(p: MeshPlan) -> None:
    """Every split entry's slices tile its dimension exactly once in every replica group, and every
    entry is held by at least one rank. The planner's own invariant, also used by tests."""
    by_entry: dict[str, list[Placement]] = {}
    for pl in p.placements:
        by_entry.setdefault(pl.entry, []).append(pl)
    for e in p.manifest.entries:
        pls = by_entry.get(e.name)
        if not pls:
            raise FqError(f"plan: entry {e.name!r} is placed on no rank")
        split = [pl for pl in pls if pl.slice is not None]
        if not split:
            continue
        groups: dict[tuple, list[Slice]] = {}
        for pl in split:
            co = p.mesh.coords(pl.rank)
            groups.setdefault((co["pp"], co["ep"]), []).append(pl.slice)
        n = e.shape[split[0].slice.dim]
        for key, slices in groups.items():
            pos = 0
            for s in sorted(slices, key=lambda s: s.start):
                if s.start != pos:
                    raise FqError(f"plan: {e.name} slices in group {key} do not tile [0, {n}) (at {pos})")
                pos = s.stop
            if pos != n:
                raise FqError(f"plan: {e.name} slices in group {key} end at {pos}, not {n}")


def describe(p: MeshPlan) -> str:
    """Placements per rank (grouped by layer, role and slice) and the collective schedule, for people."""
    m = p.manifest
    lines = [f"mesh {p.mesh.describe()}: {p.mesh.size} ranks (rank = (pp*{p.mesh.ep} + ep)*{p.mesh.tp} + tp); "
             f"manifest sha256 {m.sha256[:16]}…, plan sha256 {p.sha256[:16]}…"]
    for s in p.stages:
        lines.append(f"stage {s.stage}: layers {', '.join(map(str, s.layers)) or '-'}; ranks {list(s.ranks)}")
    for b in p.boundaries:
        lines.append(f"boundary: stage {b.from_stage} -> {b.to_stage} after layer {b.after_layer}")
    for r in range(p.mesh.size):
        co = p.mesh.coords(r)
        lines.append(f"rank {r} (pp {co['pp']} ep {co['ep']} tp {co['tp']}):")
        groups: dict[tuple, list[int]] = {}
        for pl in p.for_rank(r):
            e = m.entry(pl.entry)
            key = (e.layer if e.layer is not None else -1, e.role, pl.slice.describe() if pl.slice else "whole",
                   pl.placements, pl.alias)
            groups.setdefault(key, []).append(e.expert if e.expert is not None else -1)
        for (layer, role, sl, pls, alias), experts in groups.items():
            where = f"layer {layer}" if layer >= 0 else "no layer"
            ex = f" experts {_ranges(experts)}" if experts[0] >= 0 else ""
            lines.append(f"  {where} {role}{ex}: {sl} [{', '.join(pls)}]{' alias' if alias else ''}")
    lines.append(f"collective schedule ({len(p.schedule)} steps, one per declared operation):")
    for st in p.schedule:
        lines.append(f"  #{st.index} {st.kind} {st.op} (layer {st.layer}, stage {st.stage}) over "
                     f"{'x'.join(st.axes)}: groups {[list(g) for g in st.groups]}, {len(st.contributors)} contributors")
    return "\n".join(lines)


def _ranges(xs: list[int]) -> str:
    xs = sorted(xs)
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)
