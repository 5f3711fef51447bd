"""Choose a K per allocation unit: least predicted KL under a byte budget (a multiple-choice knapsack).

Each unit u offers options K with (predicted KL, stored bytes). The predicted KL of an allocation is the sum of its
units' (fq.allocation.sensitivity: independent errors add to second order), so the problem is a multiple-choice
knapsack. It is solved by the Lagrangian (convex-hull) greedy: every unit starts at its smallest option; the steps
along each unit's lower convex hull of (bytes, KL) are taken in order of KL saved per byte while they fit. That is
the optimum of the problem's linear relaxation but for at most one unit, whose next step did not fit (the
"fractional" step); the budget left is then filled with the best steps that still fit. Hence a certificate, not a
hope: the allocation's predicted KL is above the optimum by at most ``gap_bound`` = the fractional step's KL saving
times the fraction of it the budget had room for (0 when the greedy ends exactly).

Bytes are what exllamav3 stores for a linear: the K-bit trellis at the 128-padded shape, fp16 ``suh`` and ``svh``
and the codebook marker; K 16 is the linear kept as published (bf16). ``bits`` budgets count those bytes over the
weights of every allocated linear (unpadded): 8 * bytes / weights.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

from fq.codec.shape import padded
from fq.core.units import fmt_bytes
from fq.errors import FqError

KEPT = 16


def linear_bytes(out_f: int, in_f: int, K) -> int:
    """Stored bytes of one linear at K (16: bf16 as published; a half-integer K stores 16*K words per tile too)."""
    if K == KEPT:
        return out_f * in_f * 2
    o, i = padded(out_f), padded(in_f)
    return o * i * round(2 * K) // 16 + 2 * (i + o) + 4


@dataclass(frozen=True)
class Allocation:
    ks: dict  # unit -> K
    predicted_kl: float
    bytes: int
    weights: int
    budget_bytes: int
    gap_bound: float  # predicted KL above the optimum at this budget by at most this

    @property
    def bits(self) -> float:
        return 8.0 * self.bytes / self.weights


def _hull(opts: dict) -> list:
    """The lower convex hull of a unit's options, by bytes ascending, KL strictly descending: [(bytes, kl, K)]."""
    pts = sorted(((b, kl, K) for K, (kl, b) in opts.items()), key=lambda p: (p[0], p[1], p[2]))
    best: list = []
    for p in pts:  # drop options that cost more bytes and save nothing
        if best and p[1] >= best[-1][1]:
            continue
        best.append(p)
    hull: list = []
    for p in best:
        while len(hull) >= 2:
            (b1, k1, _), (b2, k2, _) = hull[-2], hull[-1]
            # hull[-1] is above the segment hull[-2] -> p: not on the lower hull
            if (k2 - k1) * (p[0] - b1) >= (p[1] - k1) * (b2 - b1):
                hull.pop()
            else:
                break
        hull.append(p)
    return hull


def solve(options: dict, budget_bytes: int, weights: int) -> Allocation:
    """``options``: unit -> {K: (predicted KL, bytes)}; ``weights``: the allocated linears' weight count (for bits).
    Refuses a budget below the smallest allocation, naming both."""
    if not options:
        raise FqError("allocation: no units to allocate")
    hulls = {u: _hull(o) for u, o in options.items()}
    order = {u: i for i, u in enumerate(options)}
    at = {u: 0 for u in hulls}
    used = sum(h[0][0] for h in hulls.values())
    if used > budget_bytes:
        raise FqError(f"allocation: budget {fmt_bytes(budget_bytes)} ({8 * budget_bytes / weights:.3f} bits) is "
                      f"below the smallest allocation, every unit at its fewest bits: {fmt_bytes(used)} "
                      f"({8 * used / weights:.3f} bits)")

    def step(u):
        h, i = hulls[u], at[u]
        if i + 1 >= len(h):
            return None
        db, dk = h[i + 1][0] - h[i][0], h[i][1] - h[i + 1][1]
        return (-dk / db, order[u], u, db, dk)

    heap = [s for s in (step(u) for u in hulls) if s is not None]
    heapq.heapify(heap)
    gap = 0.0
    skipped = []
    while heap:
        _, _, u, db, dk = heapq.heappop(heap)
        if used + db <= budget_bytes:
            used += db
            at[u] += 1
            nxt = step(u)
            if nxt is not None:
                heapq.heappush(heap, nxt)
            continue
        if not skipped:  # the linear relaxation's one fractional step
            gap = dk * (budget_bytes - used) / db
        skipped.append(u)
    ks = {u: hulls[u][at[u]][2] for u in options}
    # fill: any option of a skipped unit that fits and lowers its KL (off-hull options included)
    for u in sorted(set(skipped), key=order.get):
        cur_kl, cur_b = options[u][ks[u]]
        best = None
        for K, (kl, b) in sorted(options[u].items()):
            if kl < cur_kl and used - cur_b + b <= budget_bytes and (best is None or kl < best[1]):
                best = (K, kl, b)
        if best is not None:
            used += best[2] - cur_b
            ks[u] = best[0]
    kl = sum(options[u][K][0] for u, K in ks.items())
    return Allocation(ks=ks, predicted_kl=kl, bytes=used, weights=weights, budget_bytes=budget_bytes,
                      gap_bound=gap)


def solve_from(options: dict, budget_bytes: int, weights: int, least_K: int):
    """(allocation, least K used): ``options`` solved with every unit at ``least_K`` or more where the budget
    allows, else over every measured K."""
    floor = {u: {K: v for K, v in o.items() if K >= least_K} for u, o in options.items()}
    try:
        if all(floor.values()):
            return solve(floor, budget_bytes, weights), least_K
    except FqError:
        pass
    return solve(options, budget_bytes, weights), min(min(o) for o in options.values())


def pooled_kl(parts: dict, ks: dict) -> float:
    """The pooled prediction of an allocation: sum_u second_u(K_u) + sqrt(sum_u first_u(K_u)^2), ``parts``: unit ->
    {K: (second-order KL, first-order KL)} (fq.allocation.inject.parts)."""
    return sum(parts[u][K][0] for u, K in ks.items()) + math.sqrt(sum(parts[u][K][1] ** 2 for u, K in ks.items()))


def solve_pooled(parts: dict, sizes: dict, budget_bytes: int, weights: int, least_K: int, rounds: int = 32):
    """(allocation, least K): least ``pooled_kl`` under the budget. ``parts``: unit -> {K: (second, first)}: one
    unit's error alone costs second + first (its injected curve: a D + b sqrt(D), the first-order term routing
    flips); ``sizes``: unit -> {K: bytes}. The errors of several units upstream of a router add in quadrature
    before they flip its decisions, hence one square root over all first-order terms. That sum is concave, so it is
    minimized by majorization: the square root replaced by its tangent at the current allocation (an upper bound,
    equal there), the separable knapsack solved (``solve``), until the allocation repeats or stops improving: a
    local optimum, started from the additive one (every unit's KL summed). ``gap_bound`` is the last knapsack's
    certificate, not one for the pooled objective."""
    def options(slope):
        return {u: {K: ((p[K][0] + slope * p[K][1] ** 2) if slope else sum(p[K]), sizes[u][K]) for K in sizes[u]}
                for u, p in parts.items()}

    best, least = solve_from(options(0.0), budget_bytes, weights, least_K)
    seen = {tuple(sorted(best.ks.items()))}
    for _ in range(rounds):
        S = sum(parts[u][K][1] ** 2 for u, K in best.ks.items())
        if S <= 0:
            break
        nxt, lk = solve_from(options(1 / (2 * math.sqrt(S))), budget_bytes, weights, least_K)
        key = tuple(sorted(nxt.ks.items()))
        if key in seen or pooled_kl(parts, nxt.ks) >= pooled_kl(parts, best.ks):
            break
        seen.add(key)
        best, least = nxt, lk
    return Allocation(ks=best.ks, predicted_kl=pooled_kl(parts, best.ks), bytes=best.bytes, weights=weights,
                      budget_bytes=budget_bytes, gap_bound=best.gap_bound), least


def budget_from_bits(bits: float, weights: int) -> int:
    if not bits > 0:
        raise FqError(f"allocation: bits {bits!r}: expected a positive number of bits per weight")
    return int(bits * weights // 8)
