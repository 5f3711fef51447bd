"""fq.runtime.exl3_chain_moe (the grouped chain MoE in exllamav3) on the CPU: which row of a stage's tables each
expert slot reads, where each routed assignment's down output lands in the prefill slot scratch, the grouping of
experts by rows, and the whole routed sum on the CPU twin of exllamav3's multi-expert GEMM (ReferenceKernels) against
each expert's reconstructed chain. The same orchestration on exllamav3's kernels is tested on the H200
(tests/test_exl3_runtime.py)."""
from __future__ import annotations

import numpy as np
import pytest
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
    slot, n = slot_layout(counts, groups)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])  # expert e's sorted assignments begin here
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


# -- the whole routed sum on the CPU twin ------------------------------------------------------------------------
E, H, I, TOPK = 6, 128, 128, 2  # EXL3 dims are multiples of 128


def _exl3_set(out_f: int, in_f: int, K: int, g: torch.Generator) -> dict:
    """A random EXL3 tensor set (mul1): random trellis words decode to codebook values like any encoding's."""
    from fq.codec import marker_value

    return {"trellis": torch.randint(-32768, 32768, (in_f // 16, out_f // 16, 16 * K), generator=g).to(torch.int16),
            "suh": ((torch.randint(0, 2, (in_f,), generator=g) * 2 - 1) / in_f ** 0.5).half(),
            "svh": torch.full((out_f,), 0.05, dtype=torch.half) * (1 + torch.rand(out_f, generator=g)).half(),
            "mul1": torch.tensor(marker_value("mul1"), dtype=torch.int32)}


def _layer(narrow: list[int]):
    """Base K2 on every expert, a K1 stage on every expert, a K2 stage on ``narrow`` only."""
    g = torch.Generator().manual_seed(7)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    base = {r: [_exl3_set(*shapes[r], 2, g) for _ in range(E)] for r in shapes}
    stages = {(e, r): [(1, _exl3_set(*shapes[r], 1, g))] for e in range(E) for r in shapes}
    for e in narrow:
        for r in shapes:
            stages[(e, r)].append((2, _exl3_set(*shapes[r], 2, g)))
    return base, stages


def _direct(base, stages, y, sel, w):
    """Σ_k w · down(SiLU(gate x) · up x) per token, each linear reconstruct_chain of its parts in float32, with the
    fp16 roundings exllamav3 makes (the input, the activation, the routing weights)."""
    from fq.codec.tensors import reconstruct_chain

    W = {(e, r): reconstruct_chain([base[r][e]] + [t for _, t in stages.get((e, r), [])])
         for e in range(E) for r in ("gate", "up", "down")}
    x = y.half().float()
    out = torch.zeros(y.shape[0], H)
    for t in range(y.shape[0]):
        for j in range(sel.shape[1]):
            e = int(sel[t, j])
            a = (torch.nn.functional.silu(x[t] @ W[(e, "gate")].T) * (x[t] @ W[(e, "up")].T)).half().float()
            out[t] += float(w[t, j].half()) * (a @ W[(e, "down")].T)
    return out


def _routed_is_direct(moe, base, stages, tokens: int, g) -> None:
    """Random tokens, routing and weights drawn from ``g``: ChainMoE's routed sum equals every expert's reconstructed
    chain (float32 sums in another order, and an fp16 activation that can round the other way: 1e-4 of the scale)."""
    y = torch.randn(tokens, H, generator=g)
    sel = torch.stack([torch.randperm(E, generator=g)[:TOPK] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, TOPK, generator=g), -1).half()
    got, want = moe.routed(y, sel, w), _direct(base, stages, y, sel, w)
    assert got.shape == want.shape and float((got - want).abs().max()) < 1e-4 * float(want.abs().max())


@pytest.mark.parametrize("tokens", [1, 5, 8, 40])
def test_the_grouped_routed_sum_is_every_experts_chain_on_the_cpu_twin(tokens):
    """ChainMoE on ReferenceKernels (exl3_mgemm's documented result in float32) against the per-expert sum of each
    expert's reconstructed chain: decode (1..8 tokens: one slot per token and expert, the down launch weighting and
    reducing per token) and prefill (40 tokens: experts grouped by row count, the slot scratch), with a stage that
    covers two experts only (their slots -1 elsewhere)."""
    from fq.runtime.exl3_chain_moe import ChainMoE, ReferenceKernels

    base, stages = _layer(narrow=[1, 4])
    moe = ChainMoE(ReferenceKernels(), base, stages, E=E, H=H, I=I, Ho=H)
    assert [st.full for st in moe.stages] == [True, False]
    _routed_is_direct(moe, base, stages, tokens, torch.Generator().manual_seed(tokens))


def test_a_stage_on_part_of_a_projection_is_refused():
    from fq.errors import FqError
    from fq.runtime.exl3_chain_moe import ChainMoE, ReferenceKernels

    base, stages = _layer(narrow=[])
    del stages[(3, "down")]
    with pytest.raises(FqError, match="expert 3 has a stage at chain position 1 on some of gate/up/down only"):
        ChainMoE(ReferenceKernels(), base, stages, E=E, H=H, I=I, Ho=H)


def test_group_experts_bounds_padding_and_keeps_every_expert_once():
    from fq.runtime.exl3_chain_moe import group_experts

    counts = [0, 64, 70, 3, 0, 66, 120, 2, 1, 65]
    groups = group_experts(counts)
    assert sorted(e for g in groups for e in g) == [e for e, c in enumerate(counts) if c]
    for g in groups:
        cmax = max(counts[e] for e in g)
        assert len(g) == 1 or len(g) * cmax <= 1.1 * sum(counts[e] for e in g)
    assert group_experts(counts, max_rows=100) and all(len(g) * max(counts[e] for e in g) <= 120
                                                       for g in group_experts(counts, max_rows=100))


def _mixed_layer():
    """A budgeted base (exllamav3's one K per projection of a layer: gate K1, up K2, down K3), a K1 stage on every
    expert and a stage on experts 1 and 4 whose gate/up are K2 and down K1: gate and up in launches of their own
    where their K differ."""
    g = torch.Generator().manual_seed(11)
    shapes = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    base_k = {"gate": 1, "up": 2, "down": 3}
    base = {r: [_exl3_set(*shapes[r], base_k[r], g) for _ in range(E)] for r in shapes}
    stages = {(e, r): [(1, _exl3_set(*shapes[r], 1, g))] for e in range(E) for r in shapes}
    for e in (1, 4):
        for r, K in (("gate", 2), ("up", 2), ("down", 1)):
            stages[(e, r)].append((2, _exl3_set(*shapes[r], K, g)))
    return base, stages


@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_the_grouped_routed_sum_takes_one_K_per_projection(tokens):
    """Gate, up and down at different K (a budgeted base): the base's gate and up get a launch each (the other's slots
    -1), the stage whose gate and up share K keeps one; decode and prefill equal every expert's reconstructed chain."""
    from fq.runtime.exl3_chain_moe import ChainMoE, ReferenceKernels

    base, stages = _mixed_layer()
    moe = ChainMoE(ReferenceKernels(), base, stages, E=E, H=H, I=I, Ho=H)
    assert [[(L.K, L.serves) for L in st.gu] + [(st.d.K, "down")] for st in moe.base] == \
        [[(1, "gate"), (2, "up"), (3, "down")]]
    assert [([(L.K, L.serves) for L in st.gu], st.d.K, st.full) for st in moe.stages] == \
        [([(1, "gu")], 1, True), ([(2, "gu")], 1, False)]
    _routed_is_direct(moe, base, stages, tokens, torch.Generator().manual_seed(100 + tokens))


def test_experts_of_one_stage_at_different_K_get_tables_of_their_own():
    """Not what fq's products hold (a layer's projection has one K), but the tables do not assume it: a base whose
    experts differ in down's K is two groups, each writing its own slots."""
    from fq.runtime.exl3_chain_moe import ChainMoE, ReferenceKernels

    base, stages = _layer(narrow=[2])
    g = torch.Generator().manual_seed(5)
    for e in (0, 3):
        base["down"][e] = _exl3_set(H, I, 3, g)
    moe = ChainMoE(ReferenceKernels(), base, stages, E=E, H=H, I=I, Ho=H)
    assert sorted(st.d.K for st in moe.base) == [2, 3] and not any(st.full for st in moe.base)
    for tokens in (3, 40):
        _routed_is_direct(moe, base, stages, tokens, g)
