"""The routed experts of a chained MoE layer in exllamav3, grouped over experts: one multi-expert EXL3 GEMM launch
per (projection, stage), stages summed in float32 before the activation (gate, up) and after (down).

exllamav3's own fast MoE kernels read one trellis per expert at one bit width per launch, so they cannot sum a chain's
stages; its per-expert path can (fq.runtime.exl3.ChainLinear) but costs a Python round trip per expert (7.6-11.4x a
native layer at batch-1 decode on GLM-5 shapes). Here the chain runs on exllamav3's kernels, batched:

- decode (up to 8 tokens): ``exl3_mgemm`` with pointer tables over the experts, one per stage and projection group
  (gate and up share one launch where they share K and codebook; a budgeted base may hold gate and up at different
  K, exllamav3's one K per projection of a layer, and then each has its own launch, the other's slots mapped to -1),
  indexed by the routing's selection; the down projection's launch also applies the routing weights and sums each
  token's experts. A stage that covers only some experts (a narrowed adapter) has a selection map that sends the
  others to -1, which the kernel skips. One launch reads one (K, codebook): experts of one stage whose projections
  differ in it (never within a layer of fq's products, but the tables do not assume it) get launches of their own.
- prefill: experts grouped by row count (``group_experts``, under 10% padding); a group is one slab of its
  experts' rows and the same launches, each slot an expert with all its rows. The down outputs land unweighted in a
  slot scratch; each token's k slots are weighted and summed in k order (deterministic).

Measured on the H200 (docs/benchmarks.md, GLM-5 shapes, five runs): 1.6-1.9x a native K3 layer at batch-1 decode and
2.4-2.6x at a 2048-token prefill, against 7.6-11.4x / 5.1-5.2x on the per-expert path. exllamav3's kernels cost the same at K1, K2 and K3
(their time is not in the trellis bytes), so a chain of two stages pays about two passes over the routed experts. A
CUDA graph around the decode launches gained nothing (the time is in the kernels), and exllamav3's batched-reconstruct
tier with the stages added was 1.9x slower than this at prefill; neither is kept.

The layer is reached through exllamav3's own seam for a routed sum computed elsewhere (``cpu_offload_issue``, used
by its CPU expert offload): routing, the shared expert, post norms and TP reduction stay exllamav3's.

The orchestration (which table row each slot reads, stage maps, weighting, grouping, the slot scratch) is one class,
``ChainMoE``, over a kernel backend: ``Exl3Kernels`` (exllamav3's ``exl3_mgemm`` and activation, CUDA) or
``ReferenceKernels``, the CPU twin that computes what ``exl3_mgemm`` is documented to compute (slot j: A[j] or the
broadcast A[0] times the float32 reconstruction of matrix idx[j]; -1 skipped; with weights, each token's slots
weighted and summed into row t), so CI tests the whole routed sum against fq's own reconstruction without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass

from fq.errors import FqError

MAX_DECODE_ROWS = 8  # exllamav3's MAX_BSZN: up to this many tokens the routed sum is one GEMV per (token, expert)
ROLES = ("gate", "up", "down")


def _shift_rows(rows, shift: int):
    """``rows`` with ``shift`` added where it is a row (>= 0), -1 left as is."""
    import torch

    return torch.where(rows >= 0, rows + shift, rows)


@dataclass
class Launch:
    """One multi-expert GEMM launch: a pointer table whose matrices share one (K, codebook), and the map from a slot's
    index to its row in the table (None: the index is the row)."""
    K: int
    cb: tuple       # (mcg, mul1)
    table: object   # the backend's table
    map: object     # (2E,) long over gate/up slot indices [gate e..., up e...] or (E,) over down's, -> row or -1
    serves: str     # "gu" (gate and up slots), "gate" or "up" (the other's slots map to -1), "down"


@dataclass
class StageTables:
    """One stage (or the base) of a group of a layer's experts whose gate, up and down each have one (K, codebook):
    the launches of its gate/up slots (one, or one per projection where gate and up differ) and of its down slots."""
    gu: list        # [Launch]
    d: Launch
    linears: list   # keeps the tensors the tables point into alive
    full: bool      # covers every expert: every slot is written by its launches


class Exl3Kernels:
    """exllamav3's kernels on CUDA: a table is three int64 device tensors of addresses (trellis, suh, svh)."""

    def __init__(self, device, act, act_limit):
        self.device, self.act_fn, self.act_limit = device, act, act_limit

    @staticmethod
    def meta(lin) -> tuple:
        return lin.K, bool(lin.mcg), bool(lin.mul1)

    def tables(self, linears: list):
        import torch

        return tuple(torch.tensor([getattr(lin, a).data_ptr() for lin in linears], dtype=torch.long,
                                  device=self.device) for a in ("trellis", "suh", "svh"))

    def mgemm(self, A, tables, C, idx, weights, K, cb, num_tokens=1):
        import torch
        from exllamav3.ext import exllamav3_ext as ext

        trellis, suh, svh = tables
        a_had = torch.empty((max(A.shape[0], C.shape[0]), A.shape[1], A.shape[2]), dtype=torch.half,
                            device=A.device)
        ext.exl3_mgemm(A, trellis, C, suh, a_had, svh, idx, weights, K, -1, cb[0], cb[1], -1, -1, 0, num_tokens,
                       None, None)

    def act(self, g, u, a):
        self.act_fn(g, u, a, self.act_limit)


class ReferenceKernels:
    """The CPU twin: a table is the list of its matrices' float32 (out, in) reconstructions (fq.codec), and mgemm
    computes exl3_mgemm's documented result in float32; the activation is SiLU(gate) * up rounded to fp16, as
    exllamav3's silu_mul writes it."""

    device = "cpu"

    @staticmethod
    def meta(tensors: dict) -> tuple:
        return tensors["trellis"].shape[-1] // 16, "mcg" in tensors, "mul1" in tensors

    def tables(self, sets: list):
        from fq.codec.tensors import reconstruct

        return [reconstruct(t) for t in sets]

    def mgemm(self, A, tables, C, idx, weights, K, cb, num_tokens=1):
        import torch

        slots = idx.shape[1]
        out = torch.zeros((slots,) + tuple(C.shape[1:]), dtype=torch.float32)
        for j, q in enumerate(idx[0].tolist()):
            if q < 0:
                continue
            x = (A[j] if A.shape[0] > 1 else A[0]).float()
            out[j] = x @ tables[q].T
            if weights is None:
                C[j] = out[j].to(C.dtype)
            else:
                out[j] *= float(weights[0, j])
        if weights is not None:
            per = slots // num_tokens
            for t in range(num_tokens):
                C[t] = out[t * per:(t + 1) * per].sum(0).to(C.dtype)

    def act(self, g, u, a):
        import torch

        a.copy_((torch.nn.functional.silu(g.float()) * u.float()).half())


def group_experts(counts: list[int], max_rows: int = 16384, pad: float = 1.1) -> list[list[int]]:
    """Experts with rows, largest first, cut into groups whose padded rows (size x the group's largest count) stay
    within ``pad`` times their real rows and within ``max_rows``: one slab per group, little of it padding."""
    order = sorted((e for e, c in enumerate(counts) if c), key=lambda e: (-counts[e], e))
    groups, cur, real = [], [], 0
    for e in order:
        c = counts[e]
        if cur:
            n = len(cur) + 1
            cmax = counts[cur[0]]
            if n * cmax > max_rows or n * cmax > pad * (real + c):
                groups.append(cur)
                cur, real = [], 0
        cur.append(e)
        real += c
    if cur:
        groups.append(cur)
    return groups


def stage_rows(experts: list[int], E: int):
    """For a stage covering ``experts`` (sorted ids) of E: (gu_map (2E,), d_map (E,)) long CPU tensors. Its gate/up
    table is [gates of experts..., ups of experts...]; gu_map sends slot e (gate e) and E + e (up e) to their rows,
    d_map sends e to its down row; experts without the stage go to -1 (the kernel skips those slots)."""
    import torch

    d_map = torch.full((E,), -1, dtype=torch.long)
    gu_map = torch.full((2 * E,), -1, dtype=torch.long)
    for i, e in enumerate(experts):
        d_map[e] = i
        gu_map[e], gu_map[E + e] = i, len(experts) + i
    return gu_map, d_map


def slot_layout(counts: list[int], groups: list[list[int]]):
    """Where each routed assignment's down output lands in the prefill slot scratch. Assignments are taken in
    expert-sorted order (expert e's rows at starts[e] .. starts[e] + counts[e]); a group of B experts with at most
    cmax rows writes a (B * cmax)-row slab, expert b of the group at rows b * cmax .. of it, groups one after the
    other. Returns (slot of each sorted assignment (int64 array), total scratch rows)."""
    import numpy as np

    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    slot = np.full(int(sum(counts)), -1, dtype=np.int64)
    base = 0
    for grp in groups:
        cmax = max(counts[e] for e in grp)
        for b, e in enumerate(grp):
            slot[starts[e]:starts[e] + counts[e]] = base + b * cmax + np.arange(counts[e])
        base += len(grp) * cmax
    return slot, base


def _unsupported(mlp) -> str | None:
    """Why this BlockSparseMLP cannot take the grouped chain (then the caller keeps the per-expert path), or None."""
    if not getattr(mlp, "gated", False) or mlp.multi_gate is None or mlp.multi_up is None or mlp.multi_down is None:
        return "not a gated MLP with exllamav3's multi-expert pointer tables"
    if getattr(mlp, "interm_div", 1.0) != 1.0:
        return "interm_div scales the up projections at load"
    if (mlp.num_local_experts or mlp.num_experts) != mlp.num_experts or getattr(mlp, "routing_first", 0):
        return "an expert shard (TP or CPU split)"
    if getattr(mlp, "cpu_split_first", None) is not None or getattr(mlp, "cpu_offload", False):
        return "CPU expert offload"
    if mlp.multi_up.out_features % 128 or mlp.multi_down.out_features % 128:
        return "output widths not a multiple of 128 (exl3_mgemm's limit)"
    return None


class ChainMoE:
    """The routed sum of a gated MoE layer whose experts carry stages, on ``kernels`` (Exl3Kernels or
    ReferenceKernels).

    ``base``: per role ("gate", "up", "down") the base part of each expert (index = expert id): a LinearEXL3 for
    Exl3Kernels, an EXL3 tensor set for ReferenceKernels. ``stages``: {(expert, role): [(chain position, part), ...]}.
    E experts of H inputs, I intermediate and Ho outputs."""

    def __init__(self, kernels, base: dict, stages: dict, *, E: int, H: int, I: int, Ho: int, key: str = "moe"):
        self.kernels = kernels
        self.E, self.H, self.I, self.Ho = E, H, I, Ho
        # the base: its groups (one, unless its experts differ in a projection's K) partition every slot
        self.base = self._groups({(e, r): base[r][e] for e in range(E) for r in ROLES}, list(range(E)))
        by_pos: dict = {}
        for (e, proj), parts in stages.items():
            for pos, part in parts:
                by_pos.setdefault(pos, {})[(e, proj)] = part
        self.stages = []
        for pos, parts in sorted(by_pos.items()):
            experts = sorted({e for e, _ in parts})
            for e in experts:
                if not all((e, p) in parts for p in ROLES):
                    raise FqError(f"{key}: expert {e} has a stage at chain position {pos} on some of gate/up/"
                                  f"down only")
            self.stages += self._groups(parts, experts)

    def _groups(self, parts: dict, experts: list[int]) -> list[StageTables]:
        """The tables of one stage over ``experts`` (``parts[(expert, role)]``): one StageTables per group of experts
        whose (gate, up, down) have the same (K, codebook) each, in the order of those."""
        by_meta: dict = {}
        for e in experts:
            by_meta.setdefault(tuple(tuple(self.kernels.meta(parts[(e, r)])) for r in ROLES), []).append(e)
        return [self._tables(parts, group, metas) for metas, group in sorted(by_meta.items())]

    def _tables(self, parts: dict, experts: list[int], metas: tuple) -> StageTables:
        k, E, dev = self.kernels, self.E, self.kernels.device
        n, full = len(experts), len(experts) == E
        gates, ups, downs = ([parts[(e, r)] for e in experts] for r in ROLES)
        gu_map, d_map = stage_rows(experts, E)
        (kg, *cg), (ku, *cu), (kd, *cd) = metas
        if (kg, cg) == (ku, cu):  # gate and up in one launch over [gates..., ups...]
            gu = [Launch(kg, tuple(cg), k.tables(gates + ups), None if full else gu_map.to(dev), "gu")]
        else:  # one launch each; the other's slots -> -1
            g_map, u_map = gu_map.clone(), gu_map.clone()
            g_map[E:] = -1
            u_map[:E] = -1
            u_map[E:] = _shift_rows(u_map[E:], -n)
            gu = [Launch(kg, tuple(cg), k.tables(gates), g_map.to(dev), "gate"),
                  Launch(ku, tuple(cu), k.tables(ups), u_map.to(dev), "up")]
        d = Launch(kd, tuple(cd), k.tables(downs), None if full else d_map.to(dev), "down")
        return StageTables(gu, d, gates + ups + downs, full)

    def _launch(self, L: Launch, A, out, idx, weights=None, num_tokens: int = 1):
        self.kernels.mgemm(A, L.table, out, idx if L.map is None else L.map[idx], weights, L.K, L.cb, num_tokens)

    def _run_gu(self, st: StageTables, A, idx, out, which: str) -> None:
        for L in st.gu:
            if which == "gu" or L.serves in ("gu", which):  # a launch with only -1 slots is not made
                self._launch(L, A, out, idx)

    def _gate_up(self, A, idx, rows: int, which: str = "gu"):
        """float32 (slots, rows, I): slot j is row idx[0, j] of the [gates..., ups...] tables (gate e: e, up e: E + e)
        applied to A[j] (or to A[0], broadcast), every stage summed. ``which``: "gate" or "up" when every slot is
        one projection's (prefill), "gu" when they mix (decode)."""
        import torch

        gu = torch.empty((idx.shape[1], rows, self.I), dtype=torch.float, device=A.device)
        for st in self.base:  # the base's launches write every slot once
            self._run_gu(st, A, idx, gu, which)
        for st in self.stages:
            # slots of experts without this stage are skipped by the kernel, not written: zeros there
            part = torch.empty_like(gu) if st.full else torch.zeros_like(gu)
            self._run_gu(st, A, idx, part, which)
            gu += part
        return gu

    def _down(self, a, idx, weights, num_tokens: int, out):
        """Down projections of every slot, stages summed into ``out`` (weighted and reduced per token when ``weights``
        is given: the kernel overwrites row t with token t's sum and skips -1 slots)."""
        import torch

        n = num_tokens if weights is not None else out.shape[0]
        if len(self.base) == 1:
            self._launch(self.base[0].d, a, out, idx, weights, num_tokens)
        else:  # base groups: each writes (weighted: sums) its own slots only; add them up
            part = torch.empty_like(out)
            out[:n].zero_()
            for st in self.base:
                if weights is None:
                    part.zero_()
                self._launch(st.d, a, part, idx, weights, num_tokens)
                out[:n] += part[:n]
        if not self.stages:
            return out
        part = torch.empty_like(out)
        for st in self.stages:
            if not st.full and weights is None:
                part.zero_()
            self._launch(st.d, a, part, idx, weights, num_tokens)
            out[:n] += part[:n]
        return out

    def decode(self, y, sel, w):
        """y (T, H) half, sel (T, k) long, w (T, k) half, T <= 8 -> (T, Ho) float32 routed sum: one GEMV per
        (token, expert) slot, as exllamav3's own decode kernels (no dedup of experts shared by tokens)."""
        import torch

        T, k = sel.shape
        slots = T * k
        flat = sel.reshape(1, slots)
        idx_gu = torch.cat([flat, flat + self.E], 1)  # gate slots, then up slots
        # One input broadcast to every slot (one token) or one input row per slot (several)
        A = y.view(1, 1, self.H) if T == 1 else y.repeat_interleave(k, 0).repeat(2, 1).view(2 * slots, 1, self.H)
        gu = self._gate_up(A, idx_gu, 1)
        a = torch.empty((slots, self.I), dtype=torch.half, device=y.device)
        self.kernels.act(gu[:slots].view(slots, self.I), gu[slots:].view(slots, self.I), a)
        out = torch.empty((slots, 1, self.Ho), dtype=torch.float, device=y.device)
        self._down(a.view(slots, 1, self.I), flat, w.reshape(1, slots).half(), T, out)
        return out[:T].view(T, self.Ho)

    def prefill(self, y, sel, w):
        """y (T, H), sel (T, k), w (T, k) -> (T, Ho) float32. Experts are grouped by row count (group_experts:
        padding under 10%); a group of B experts is one [B, cmax, H] slab of their rows and one
        multi-expert GEMM launch per (projection, stage), each slot its expert's rows. The down outputs land
        unweighted in one slot scratch; each token's k slots are then weighted and summed in k order."""
        import torch

        T, k = sel.shape
        flat = sel.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.E).tolist()
        groups = group_experts(counts)
        slot_sorted, n_slots = slot_layout(counts, groups)
        tok_ext = torch.cat([order // k, order.new_full((1,), T)])  # token of each sorted assignment; T: padding
        y_ext = torch.cat([y, y.new_zeros((1, y.shape[1]))])
        # the sorted assignment each slab row reads (T * k: the padding sentinel), and every group's experts
        src = torch.full((n_slots,), T * k, dtype=torch.long)
        src[torch.from_numpy(slot_sorted)] = torch.arange(T * k)
        src = src.to(y.device)
        ids_all = torch.tensor([e for grp in groups for e in grp], dtype=torch.long).to(y.device)
        scratch = torch.empty((n_slots, self.Ho), dtype=torch.float, device=y.device)
        base = at_id = 0
        for grp in groups:
            B, cmax = len(grp), max(counts[e] for e in grp)
            x = y_ext.index_select(0, tok_ext.index_select(0, src[base:base + B * cmax])).view(B, cmax, self.H)
            ids = ids_all[at_id:at_id + B].view(1, B)
            gate = self._gate_up(x, ids, cmax, "gate")
            up = self._gate_up(x, ids + self.E, cmax, "up")
            a = torch.empty((B, cmax, self.I), dtype=torch.half, device=y.device)
            self.kernels.act(gate.view(-1, self.I), up.view(-1, self.I), a.view(-1, self.I))
            self._down(a, ids, None, 1, scratch[base:base + B * cmax].view(B, cmax, self.Ho))
            base += B * cmax
            at_id += B
        slot = torch.empty(T * k, dtype=torch.long, device=y.device)
        slot[order] = torch.from_numpy(slot_sorted).to(y.device)
        parts = scratch.index_select(0, slot).view(T, k, self.Ho)
        return (parts * w.float().view(T, k, 1)).sum(1)

    def routed(self, y, sel, w):
        y = y.half().contiguous()
        return self.decode(y, sel, w) if sel.shape[0] <= MAX_DECODE_ROWS else self.prefill(y, sel, w)


def attach(mlp, base: dict, stages: dict) -> str | None:
    """Route ``mlp``'s routed sum through a ChainMoE; returns why not (the caller keeps the per-expert path), or None.
    Uses the seam exllamav3's forward has for a routed sum computed outside its GPU tiers (whole-layer CPU offload:
    ``cpu_offload_issue`` returning the sum and nothing pending)."""
    why = _unsupported(mlp)
    if why:
        return why
    chain = ChainMoE(Exl3Kernels(mlp.device, mlp.activation_fn_call, mlp.act_limit), base, stages,
                     E=mlp.num_experts, H=mlp.multi_up.in_features, I=mlp.multi_up.out_features,
                     Ho=mlp.multi_down.out_features, key=mlp.key)

    def issue(shape, y, selected_experts, routing_weights, params):
        return chain.routed(y, selected_experts, routing_weights).reshape(shape), None

    unload = mlp.unload

    def unload_chain():  # the stage tensors and pointer tables go with the layer
        mlp.chain_moe = None
        mlp.cpu_offload = False
        unload()

    mlp.chain_moe = chain
    mlp.unload = unload_chain
    mlp.cpu_offload_issue = issue
    mlp.cpu_offload = True
    mlp.cpu_host = None
    mlp.bc = None  # its fused decode kernel reads the base's pointers and runs the shared expert inside
    mlp.bc_sh_exp = False
    mlp.fused_mode_buffers = None
    return None
