"""The encoder pipeline on one device: fixed-order sums (fq.codec.exact), CPU determinism, encode_batch ==
encode, and (on a GPU) a CUDA encode byte-identical to the CPU one, sums and scale included."""
import random

import pytest
import torch

from tests.conftest import cuda
from fq.codec import encode, encode_residual, quantize
from fq.codec import encoder as enc_mod
from fq.codec import scale_search
from fq.codec.encoder import encode_batch
from fq.codec.exact import div, sqrt, tree_sum
from fq.codec.regularize import CODEBOOK_SCALE, regularize
from fq.codec.scale_search import sample_tiles, search_scales
from fq.errors import FqError

STAGES = {"check", "regularize", "search", "viterbi", "pack", "reconstruct"}


def _weight(out_f, in_f, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(out_f, in_f, generator=g) ** 3  # heavy tails and uneven channels, like expert weights
    return w * (0.5 + torch.rand(out_f, 1, generator=g)) * (0.5 + torch.rand(1, in_f, generator=g)) * 0.02


def _zero_channels(out_f, in_f, seed=0):
    w = _weight(out_f, in_f, seed)
    w[5] = 0.0  # an output channel
    w[:, 17] = 0.0  # an input channel
    return w


def _py_tree(vals):
    """The documented order, in Python floats: zero-pad to a power of two, fold the upper half onto the lower."""
    v = list(vals)
    while len(v) & (len(v) - 1) or not v:
        v.append(0.0)
    while len(v) > 1:
        h = len(v) // 2
        v = [v[i] + v[i + h] for i in range(h)]
    return v[0]


def _same(a, b):
    """Two Encodeds are the same bytes, reconstruction, scale and sums."""
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert a.tensors[k].device.type == "cpu" and b.tensors[k].device.type == "cpu", k
        assert a.tensors[k].dtype == b.tensors[k].dtype and a.tensors[k].numpy().tobytes() == b.tensors[k].numpy().tobytes(), k
    assert torch.equal(a.W_hat.cpu(), b.W_hat.cpu())
    assert (a.rel_mse, a.g_scale, a.sum_sq_w, a.sum_sq_err) == (b.rel_mse, b.g_scale, b.sum_sq_w, b.sum_sq_err)


# ---------------------------------------------------------------------------------------------- exact.py


@pytest.mark.parametrize("n", [0, 1, 2, 3, 5, 8, 33, 1000])
def test_tree_sum_is_the_documented_pairwise_order(n):
    rng = random.Random(n)
    vals = [rng.gauss(0, 1) * 10.0 ** rng.randint(-12, 12) for _ in range(n)]
    got = tree_sum(torch.tensor(vals, dtype=torch.float64))
    assert got.dtype == torch.float64 and got.item() == _py_tree(vals)


def test_tree_sum_order_is_pinned_not_sequential():
    # 1e16 + 1 rounds back to 1e16: a sequential sum gives 1, the tree (1e16 - 1e16) + (1 + 1) gives 2
    x = torch.tensor([1e16, 1.0, -1e16, 1.0], dtype=torch.float64)
    assert x.cumsum(0)[-1].item() == 1.0 and tree_sum(x).item() == 2.0
    # integer-valued sums below 2^53 are exact whatever the order
    ints = torch.arange(-5000, 7001, dtype=torch.float64)
    assert tree_sum(ints).item() == float(sum(range(-5000, 7001)))


def test_tree_sum_along_any_dim_and_stride():
    x = torch.randn(5, 7, 9, dtype=torch.float64) * torch.logspace(-6, 6, 9, dtype=torch.float64)
    for dim in (0, 1, 2, -1):
        got = tree_sum(x, dim)
        moved = x.movedim(dim, -1)
        want = torch.tensor([_py_tree(row) for row in moved.reshape(-1, moved.shape[-1]).tolist()],
                            dtype=torch.float64).reshape(moved.shape[:-1])
        assert torch.equal(got, want), dim
        assert torch.equal(tree_sum(x.transpose(0, 2).contiguous().transpose(0, 2), dim), got), dim
    assert torch.equal(tree_sum(x.float(), 1), tree_sum(x.float().double(), 1))  # sums in float64


def test_div_is_true_division():
    x = torch.randn(1000, dtype=torch.float64)
    for c in (3.0, -CODEBOOK_SCALE, 0.1, 6144):
        assert div(x, c).tolist() == [v / c for v in x.tolist()], c
    # the trap div avoids (CUDA's tensor / number): multiplying by the reciprocal differs in the last bit
    assert not torch.equal(div(x, CODEBOOK_SCALE), x * (1 / CODEBOOK_SCALE))


# ---------------------------------------------------------------------------------------------- encoder, CPU


def test_cpu_encode_is_deterministic_down_to_the_sums():
    W = _zero_channels(128, 256, seed=3)
    T: dict = {}
    a, b = encode(W, 2, "mul1", seed=4, timings=T), encode(W, 2, "mul1", seed=4)
    _same(a, b)
    assert a.W_hat.device.type == "cpu" and set(T) == STAGES
    assert a.sum_sq_w == _py_tree((W.double() ** 2).flatten().tolist())


def test_encode_rejects_other_devices():
    with pytest.raises(FqError, match="device"):
        encode(_weight(128, 128), 2, device="meta")
    with pytest.raises(FqError, match="device"):
        encode(_weight(128, 128), 2, device="no-such-device")


def _batch_cases():
    base_w = _weight(128, 256, seed=7)
    base = quantize(base_w, 1, "mul1", seed=8)
    Ws = [_weight(128, 256, seed=1), _weight(256, 128, seed=2), torch.zeros(128, 128), _zero_channels(256, 256, seed=4),
          base_w]
    return Ws, [11, 12, 13, 14, 15], [None, None, None, None, [base]]


def _singles(Ws, seeds, parents, K, cb, device=None):
    return [encode(W, K, cb, s, device) if p is None else encode_residual(W, p, K, cb, s, device)
            for W, s, p in zip(Ws, seeds, parents)]


def test_encode_batch_equals_encode_per_matrix(monkeypatch):
    Ws, seeds, parents = _batch_cases()
    singles = _singles(Ws, seeds, parents, 2, "mcg")
    calls = []
    real = enc_mod._viterbi
    for mod in (scale_search, enc_mod):  # the search's calls and the main ones
        monkeypatch.setattr(mod, "_viterbi", lambda t, *a: calls.append(t.shape[0]) or real(t, *a))
    batch = encode_batch(Ws, 2, "mcg", seeds, parents=parents)
    assert len(batch) == len(Ws)
    for one, b in zip(singles, batch):
        _same(one, b)
    # the first search round of all non-zero matrices is one call (3 candidates each), the main Viterbi of
    # these small matrices is one more call
    samples = sum(sample_tiles(torch.ones(W.shape[1], W.shape[0])).shape[0] for W in Ws[:2] + Ws[3:])  # by shape
    assert calls[0] == 3 * samples
    assert calls[-1] == sum(W.numel() for W in Ws) // 256
    # one matrix per main call gives the same results
    monkeypatch.setattr(enc_mod, "GROUP_TILES", 1)
    calls.clear()
    for one, b in zip(singles, encode_batch(Ws, 2, "mcg", seeds, parents=parents)):
        _same(one, b)
    assert calls[-len(Ws):] == [W.numel() // 256 for W in Ws]


def test_search_rounds_are_batched_and_independent(monkeypatch):
    # x * 2 puts the best scale far below the prior: its search walks out to SEARCH_MAX_EVALS candidates,
    # while the plain matrix stops after the first round; a zero matrix needs no evaluation
    x = regularize(_weight(128, 256, seed=5).double().t(), 1)[0]
    xs = [x, x * 2, torch.zeros_like(x)]
    alone = [search_scales([v], 2, "mul1", None)[0] for v in xs]
    calls = []
    real = scale_search._viterbi
    monkeypatch.setattr(scale_search, "_viterbi", lambda t, *a: calls.append(t.shape[0]) or real(t, *a))
    assert search_scales(xs, 2, "mul1", None) == alone
    m = sample_tiles(x).shape[0]
    assert calls == [6 * m] + [m] * (scale_search.SEARCH_MAX_EVALS - 3)


def test_encode_batch_argument_errors():
    with pytest.raises(FqError, match="seeds"):
        encode_batch([_weight(128, 128)] * 2, 2, "mul1", [1])
    with pytest.raises(FqError, match=r"Ws\[1\]"):
        encode_batch([_weight(128, 128), torch.zeros(100, 128)], 2)


def test_sqrt_is_correctly_rounded():
    import math

    x = torch.rand(2000, dtype=torch.float64, generator=torch.Generator().manual_seed(4)) * 1e6
    assert sqrt(x).tolist() == [math.sqrt(v) for v in x.tolist()]  # Python's math.sqrt is IEEE


# ---------------------------------------------------------------------------------------------- CUDA


@cuda
def test_cuda_exact_helpers_and_regularize_equal_cpu():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 777, generator=g, dtype=torch.float64) * torch.logspace(-10, 10, 777, dtype=torch.float64)
    for dim in (0, 1):
        assert torch.equal(tree_sum(x, dim), tree_sum(x.cuda(), dim).cpu()), dim
    assert torch.equal(tree_sum(x.flatten()), tree_sum(x.cuda().flatten()).cpu())
    for c in (3.0, -CODEBOOK_SCALE, 6144):
        assert torch.equal(div(x, c), div(x.cuda(), c).cpu()), c
    y = x.abs()
    assert torch.equal(sqrt(y), sqrt(y.cuda()).cpu()) and sqrt(y.cuda()).device.type == "cuda"
    for W in (_weight(256, 512, seed=1), _zero_channels(384, 256, seed=2), torch.zeros(128, 256)):
        cpu = regularize(W.double().t(), 9)
        gpu = regularize(W.double().t().cuda(), 9)
        for a, b in zip(cpu, gpu):
            assert b.device.type == "cuda" and torch.equal(a, b.cpu())
        assert torch.equal(sample_tiles(cpu[0]), sample_tiles(gpu[0]).cpu())
    # ties in the sample's ordering (identical tiles): the stable sort picks the same tiles on both
    t = torch.randn(16, 16, dtype=torch.float64, generator=g).repeat(8, 24)
    assert torch.equal(sample_tiles(t), sample_tiles(t.cuda()).cpu())


@cuda
@pytest.mark.parametrize("shape,K,cb", [((2048, 6144), 2, "mul1"), ((256, 384), 3, "mcg"), ((384, 256), 1, "3inst"),
                                        ((128, 128), 2, "mul1")])
def test_cuda_pipeline_equals_cpu(shape, K, cb):
    if shape == (128, 128):
        W = torch.zeros(shape)  # all zero: zero scales, no search
    elif shape == (256, 384):
        W = _zero_channels(*shape, seed=6)
    else:
        W = _weight(*shape, seed=K).bfloat16()  # a bf16 source, as checkpoints ship
    cpu = encode(W, K, cb, seed=3)
    T: dict = {}
    gpu = encode(W, K, cb, seed=3, device="cuda", timings=T)
    assert gpu.W_hat.device.type == "cuda" and set(T) == STAGES
    _same(cpu, gpu)


@cuda
def test_cuda_encode_batch_and_residual_equal_cpu():
    Ws, seeds, parents = _batch_cases()
    cpu = encode_batch(Ws, 3, "mul1", seeds, parents=parents)
    gpu = encode_batch([W.cuda() for W in Ws], 3, "mul1", seeds, "cuda:0", parents=parents)
    for a, b in zip(cpu, gpu):
        _same(a, b)
    for a, b in zip(gpu, _singles(Ws, seeds, parents, 3, "mul1", "cuda")):
        _same(a, b)
