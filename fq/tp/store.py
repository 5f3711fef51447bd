"""The weight store: fulfill a plan onto devices as one transaction.

``WeightStore(mesh)`` holds the admitted mesh (its epoch) and at most one published load.
``store.fulfill(plan, source, devices)``:

1. **refuse stale work** — the plan must be for the admitted mesh's shape *and* epoch;
2. **admit** — ``source.admit(plan, ranks)`` verifies signatures, digests, dtypes and shapes and hands
   back the verified bytes each rank needs; the store then checks that every placement on the loaded
   ranks is covered exactly as declared (EXL3 parts with the sliced geometry — routed experts' and a
   whole-model base's non-expert linears alike —, dense tensors with the declared dtype and sliced shape).
   Nothing has been allocated yet;
3. **allocate** — one device buffer per unit, each recorded in the journal with its origin
   (mesh epoch, rank, device); ties whose target is on the same rank become aliases;
4. **check origins** — before publishing, every allocation must still match the live mesh epoch, its
   rank and the device that rank is bound to (the mesh may have been re-admitted during the load);
5. **publish** — ``LoadedStore``: ``handle(rank, name)``, ``tensors(rank, name)``, ``weight(rank, name)``.

Any failure after admission (an allocation, the fault hook, an origin mismatch, anything raised)
releases every journaled allocation in reverse order, exactly once, and re-raises; nothing is
published, and an immediate retry starts clean. ``fault_after=N`` fails the load right after its N-th
allocation (N=0: before the first), so tests can sweep every step. ``unload()`` releases a published
load the same way. Released buffers are dropped by the store; a caller still holding a tensor keeps
its memory alive (Python references), so consumers use handles, not copies of them.

Devices are never guessed: ``devices`` names one device per loaded rank (a list indexed by rank, or
``{rank: device}`` to load some ranks, e.g. one per process); a CUDA device must carry its index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from fq.codec import MARKERS, reconstruct_chain
from fq.errors import FqError
from fq.model.experts import derive_linear, pow2_svh
from fq.model.shards import DTYPES, torch_dtype
from fq.tp.manifest import EXL3
from fq.tp.mesh import DeviceMesh, MeshPlan, Slice
from fq.tp.slicing import sliced_shape
from fq.tp.sources import Unit, View


class InjectedFault(FqError):
    """The failure ``fault_after`` injects."""


@dataclass(frozen=True)
class Origin:
    epoch: int
    rank: int
    device: str


@dataclass
class Allocation:
    seq: int
    key: str
    nbytes: int
    origin: Origin
    buffer: torch.Tensor | None
    released: bool = False


class Journal:
    """Every allocation of one load, in order; ``release_all`` undoes them newest first, once each."""

    def __init__(self, store: "WeightStore"):
        self.store = store
        self.entries: list[Allocation] = []

    def record(self, key: str, buffer: torch.Tensor, origin: Origin) -> Allocation:
        a = Allocation(len(self.entries), key, buffer.numel(), origin, buffer)
        self.entries.append(a)
        self.store.allocations += 1
        return a

    def release_all(self) -> None:
        for a in reversed(self.entries):
            if a.released:  # exactly once, however often a rollback or unload runs
                continue
            a.buffer = None  # the store's reference; device memory returns once the handles' views are gone too
            a.released = True
            self.store.releases += 1


@dataclass
class Handle:
    """One entry on one rank: ``parts`` (EXL3: one tensor set per chain node, chain order) or ``tensor``."""

    entry: str
    rank: int
    slice: Slice | None
    origin: Origin
    parts: list[dict] | None = None
    tensor: torch.Tensor | None = None
    alias_of: str | None = None


@dataclass
class LoadedStore:
    store: "WeightStore"
    plan: MeshPlan
    devices: dict[int, torch.device]
    journal: Journal
    handles: dict[tuple[int, str], Handle] = field(default_factory=dict)
    published: bool = False

    def handle(self, rank: int, name: str) -> Handle:
        """A published handle whose origin is still the admitted mesh's; refuses stale or unloaded ones."""
        if not self.published:
            raise FqError(f"{name} on rank {rank}: this load was unloaded or never published")
        h = self.handles.get((rank, name))
        if h is None:
            raise FqError(f"{name}: not placed on rank {rank} by the plan")
        live = self.store.mesh
        if h.origin.epoch != live.epoch:
            raise FqError(f"{name} on rank {rank}: loaded for mesh epoch {h.origin.epoch}, the mesh is now at epoch "
                          f"{live.epoch} (stale); unload and fulfill a plan for the current mesh")
        return h

    def tensors(self, rank: int, name: str):
        h = self.handle(rank, name)
        return h.parts if h.parts is not None else h.tensor

    def weight(self, rank: int, name: str) -> torch.Tensor:
        """The dense float32 slice of the weight on its device: the chain's reconstructions summed, in the source's
        units (a stored scale undone: the manifest entry's ``stored_scale_log2``)."""
        h = self.handle(rank, name)
        if h.parts is not None:
            n = self.plan.manifest.entry(name).stored_scale_log2
            return reconstruct_chain([pow2_svh(p, -n) for p in h.parts], name)
        return h.tensor.float()


def _device(d, rank: int) -> torch.device:
    try:
        dev = torch.device(d)
    except (RuntimeError, TypeError):
        raise FqError(f"devices[{rank}]: {d!r} is not a torch device") from None
    if dev.type == "cuda":
        if dev.index is None:
            raise FqError(f"devices[{rank}]: {d!r} names no index; say cuda:N (devices are never guessed)")
        if not torch.cuda.is_available() or dev.index >= torch.cuda.device_count():
            n = torch.cuda.device_count() if torch.cuda.is_available() else 0
            raise FqError(f"devices[{rank}]: {dev} does not exist ({n} CUDA devices visible)")
    elif dev.type != "cpu":
        raise FqError(f"devices[{rank}]: {dev.type} devices are not supported (cpu or cuda:N)")
    return dev


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


class WeightStore:
    def __init__(self, mesh: DeviceMesh):
        self.mesh = mesh
        self.loaded: LoadedStore | None = None
        self.allocations = 0  # lifetime counters: equal whenever nothing is resident
        self.releases = 0

    def readmit(self, mesh: DeviceMesh) -> None:
        """A new admission of the mesh (after a device change): a newer epoch; older loads become stale."""
        if mesh.epoch <= self.mesh.epoch:
            raise FqError(f"mesh re-admission: epoch {mesh.epoch} is not newer than {self.mesh.epoch}")
        self.mesh = mesh

    def _check_plan(self, plan: MeshPlan) -> None:
        live = self.mesh
        if not plan.mesh.same_shape(live):
            raise FqError(f"plan is for {plan.mesh.describe()}, the admitted mesh is {live.describe()}; re-plan")
        if plan.mesh.epoch != live.epoch:
            raise FqError(f"plan was made for mesh epoch {plan.mesh.epoch}, the admitted mesh is at epoch {live.epoch} "
                          "(stale plan); re-plan for the current mesh")

    def _ranks(self, plan: MeshPlan, devices) -> dict[int, torch.device]:
        if isinstance(devices, Mapping):
            chosen = dict(devices)
        elif isinstance(devices, Sequence) and not isinstance(devices, str):
            if len(devices) != plan.mesh.size:
                raise FqError(f"devices: {len(devices)} given, the mesh has {plan.mesh.size} ranks; name one per rank "
                              "(or pass {rank: device} to load some ranks)")
            chosen = dict(enumerate(devices))
        else:
            raise FqError("devices: a list (one per rank) or {rank: device}")
        if not chosen:
            raise FqError("devices: no rank to load")
        out = {}
        for r, d in sorted(chosen.items(), key=lambda kv: str(kv[0])):
            if type(r) is not int:
                raise FqError(f"devices: rank {r!r} is not an integer")
            plan.mesh.coords(r)
            out[r] = _device(d, r)
        return out

    def fulfill(self, plan: MeshPlan, source, devices, *, fault_after: int | None = None,
                on_allocate: Callable[[Allocation], None] | None = None) -> LoadedStore:
        if self.loaded is not None:
            raise FqError("weight store: a load is already published; unload it first")
        self._check_plan(plan)
        devs = self._ranks(plan, devices)
        units = source.admit(plan, list(devs))
        check_units(plan, list(devs), units)

        loaded = LoadedStore(self, plan, devs, Journal(self))
        where = {(pl.rank, pl.entry): pl for r in devs for pl in plan.for_rank(r)}
        try:
            if fault_after == 0:
                raise InjectedFault("injected fault before the first allocation")
            for u in units:
                self._allocate(loaded, u, where, on_allocate)
                if fault_after is not None and len(loaded.journal.entries) == fault_after:
                    raise InjectedFault(f"injected fault after allocation {fault_after} ({u.key})")
            self._aliases(loaded)
            self._check_origins(loaded)
        except BaseException:
            loaded.handles.clear()
            loaded.journal.release_all()
            raise
        loaded.published = True
        self.loaded = loaded
        return loaded

    def _allocate(self, loaded: LoadedStore, u: Unit, where: dict, hook) -> None:
        dev = loaded.devices[u.rank]
        host = torch.frombuffer(u.data, dtype=torch.uint8) if len(u.data) else torch.empty(0, dtype=torch.uint8)
        buf = torch.empty(len(u.data), dtype=torch.uint8, device=dev)
        buf.copy_(host)
        a = loaded.journal.record(u.key, buf, Origin(loaded.plan.mesh.epoch, u.rank, str(dev)))
        if hook is not None:
            hook(a)
        for v in u.views:
            t = buf[v.offset:v.offset + v.length].view(torch_dtype(v.dtype)).reshape(v.shape)
            pl = where[(u.rank, v.entry)]
            h = loaded.handles.setdefault((u.rank, v.entry), Handle(v.entry, u.rank, pl.slice, a.origin))
            if v.suffix is None:
                h.tensor = t
            else:
                h.parts = h.parts or []
                while len(h.parts) <= v.part:
                    h.parts.append({})
                h.parts[v.part][v.suffix] = t

    def _aliases(self, loaded: LoadedStore) -> None:
        for r in loaded.devices:
            for pl in loaded.plan.for_rank(r):
                if pl.alias:
                    t = loaded.handles[(r, pl.source)]
                    loaded.handles[(r, pl.entry)] = Handle(pl.entry, r, pl.slice, t.origin, t.parts, t.tensor, pl.source)

    def _check_origins(self, loaded: LoadedStore) -> None:
        live = self.mesh
        for a in loaded.journal.entries:
            o = a.origin
            if o.epoch != live.epoch:
                raise FqError(f"{a.key}: allocated for mesh epoch {o.epoch}, the mesh was re-admitted at epoch "
                              f"{live.epoch} during the load; nothing published")
            if not (0 <= o.rank < live.size) or o.rank not in loaded.devices:
                raise FqError(f"{a.key}: origin rank {o.rank} is not a rank of this load")
            if not _same_device(a.buffer.device, loaded.devices[o.rank]):
                raise FqError(f"{a.key}: resides on {a.buffer.device}, rank {o.rank} is bound to "
                              f"{loaded.devices[o.rank]}")

    def unload(self) -> None:
        """Release the published load, newest allocation first; its handles refuse access afterwards."""
        if self.loaded is None:
            return
        loaded, self.loaded = self.loaded, None
        loaded.published = False
        loaded.handles.clear()
        loaded.journal.release_all()


def fulfill(plan: MeshPlan, source, devices, *, mesh: DeviceMesh, fault_after: int | None = None) -> LoadedStore:
    """One-shot: a store for the admitted ``mesh`` and one load on it."""
    return WeightStore(mesh).fulfill(plan, source, devices, fault_after=fault_after)


def check_units(plan: MeshPlan, ranks: list[int], units: list[Unit]) -> None:
    """Admission's last word, before any allocation: the units cover exactly the non-alias placements
    of the loaded ranks, with the declared dtypes and the sliced shapes."""
    got: dict[tuple[int, str], list[tuple[View, Unit]]] = {}
    for u in units:
        if u.rank not in ranks:
            raise FqError(f"admission: {u.key} is for rank {u.rank}, which is not being loaded")
        for v in u.views:
            if v.offset < 0 or v.offset + v.length > len(u.data):
                raise FqError(f"admission: {u.key}: {v.entry} lies outside the unit's bytes")
            if v.offset % DTYPES[v.dtype][0]:
                raise FqError(f"admission: {u.key}: {v.entry}.{v.suffix} at offset {v.offset} is not aligned")
            got.setdefault((u.rank, v.entry), []).append((v, u))
    for r in ranks:
        for pl in plan.for_rank(r):
            if pl.alias:
                continue
            e = plan.manifest.entry(pl.entry)
            views = got.pop((r, pl.entry), None)
            where = f"admission: {pl.entry} on rank {r}"
            if not views:
                raise FqError(f"{where}: the source provides no bytes for it")
            want = sliced_shape(e.shape, pl.slice)
            if e.dtype != EXL3:
                v = views[0][0]
                if len(views) != 1 or (v.dtype, tuple(v.shape)) != (e.dtype, want):
                    raise FqError(f"{where}: source has {v.dtype} {list(v.shape)}, declared {e.dtype} {list(want)}")
                continue
            parts: dict[int, dict] = {}
            markers: dict[int, int] = {}
            for v, u in views:
                if v.suffix is None or v.suffix in parts.setdefault(v.part, {}):
                    raise FqError(f"{where}: part {v.part} has a dense or repeated tensor {v.suffix!r}")
                parts[v.part][v.suffix] = (v.dtype, v.shape)
                if v.suffix in MARKERS and v.length == 4:
                    markers[v.part] = int.from_bytes(u.data[v.offset:v.offset + 4], "little", signed=True)
            if sorted(parts) != list(range(len(parts))):
                raise FqError(f"{where}: chain parts {sorted(parts)}, expected 0..{len(parts) - 1} (a base first)")
            for i, specs in sorted(parts.items()):
                lin = derive_linear(specs, f"{where} part {i}", markers.get(i))
                if (lin.out_features, lin.in_features) != want:
                    raise FqError(f"{where} part {i}: EXL3 tensors are (out, in) = ({lin.out_features}, "
                                  f"{lin.in_features}), the plan needs {want}")
    if got:
        (r, name), _ = next(iter(got.items()))
        raise FqError(f"admission: source provides {name!r} for rank {r}, which the plan does not place there")
