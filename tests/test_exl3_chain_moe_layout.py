"""The bookkeeping of fq.runtime.exl3_chain_moe (the grouped chain MoE in exllamav3), on the CPU: which row of a
stage's pointer tables each expert slot reads, and where each routed assignment's down output lands in the prefill
slot scratch. The GPU arithmetic itself is tested on the H200 (tests/test_exl3_runtime.py)."""
from __future__ import annotations

import numpy as np
import torch

from fq.runtime.exl3_chain_moe import slot_layout, stage_rows


def test_stage_rows_send_covered_experts_to_their_rows_and_the_rest_to_minus_one():
    E, covered = 6, [1, 4]
    gu, d = stage_rows(covered, E)
    # gate/up table is [gate 1, gate 4, up 1, up 4]
    assert gu.tolist() == [-1, 0, -1, -1, 1, -1, -1, 2, -1, -1, 3, -1]
    assert d.tolist() == [-1, 0, -1, -1, 1, -1]
    sel = torch.tensor([[4, 0, 1]])
    idx_gu = torch.cat([sel, sel + E], 1)
    assert gu[idx_gu].tolist() == [[1, -1, 0, 3, -1, 2]]
    full_gu, full_d = stage_rows(list(range(E)), E)
    assert full_d.tolist() == list(range(E)) and full_gu.tolist() == list(range(2 * E))


def test_slot_layout_places_every_assignment_once_in_its_experts_slab():
    rng = np.random.default_rng(0)
    T, k, E = 37, 4, 9
    sel = np.stack([rng.choice(E, k, replace=False) for _ in range(T)])
    flat = torch.from_numpy(sel.reshape(-1))
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E).tolist()
    groups = [[e for e in (3, 0, 7) if counts[e]], [e for e in range(E) if e not in (3, 0, 7) and counts[e]]]
    slot, starts, n = slot_layout(counts, groups)
    assert n == sum(len(g) * max(counts[e] for e in g) for g in groups)
    assert len(set(slot.tolist())) == T * k and slot.min() >= 0 and slot.max() < n
    # a slab row holds (expert, row within expert); every sorted assignment finds its own
    owner = {}
    base = 0
    for g in groups:
        cmax = max(counts[e] for e in g)
        for b, e in enumerate(g):
            for r in range(counts[e]):
                owner[base + b * cmax + r] = (e, r)
        base += len(g) * cmax
    sorted_experts = flat[order].tolist()
    for p, s in enumerate(slot.tolist()):
        e, r = owner[s]
        assert e == sorted_experts[p] and r == p - starts[e]
    # the gather that undoes the sort: token t's j-th pick reads its own slot, so a weighted sum over k is the MoE sum
    values = torch.randn(E, 5, dtype=torch.float64)
    scratch = torch.zeros(n, 5, dtype=torch.float64)
    for s, (e, _) in owner.items():
        scratch[s] = values[e]
    by_assignment = torch.empty(T * k, dtype=torch.long)
    by_assignment[order] = torch.from_numpy(slot)
    w = torch.rand(T, k, dtype=torch.float64)
    got = (scratch[by_assignment].view(T, k, 5) * w[..., None]).sum(1)
    want = torch.stack([sum(w[t, j] * values[sel[t, j]] for j in range(k)) for t in range(T)])
    torch.testing.assert_close(got, want)
