"""One matrix encoded by chunks of output channels (fq.codec.chunked) is the whole-matrix encode, byte for byte,
and its working set is bounded by the chunk, not by out x in.

Small matrices forced into several chunks (``chunk=``): 128 and 256 channels, one of which does not divide the
padded width, padded shapes (dims multiples of 16, not of 128), weight-only and LDLQ, a residual stage, K 2 and 6,
mul1 and mcg. Inputs from numpy's generator (the same bits on every machine), as tests/test_codec_ldlq.py's.
"""
import numpy as np
import pytest
import torch

from tests.conftest import cuda
from fq.codec import chunked, encode, encode_residual
from fq.codec.ldlq import encode_ldlq
from fq.codec.memtrack import LiveBytes
from fq.errors import FqError


def _weight(out_f, in_f, seed):
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((out_f, in_f))
    w = z * z * z * (0.5 + rng.random((out_f, 1))) * (0.2 + 2.0 * rng.random((1, in_f))) * 0.02
    return torch.from_numpy(w).float()


def _hessian(in_f, seed, rows=512):
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, 8)) @ rng.standard_normal((8, in_f)) + 0.3 * rng.standard_normal((rows, in_f))
    X[:, rng.permutation(in_f)[:3]] *= 20.0
    X = torch.from_numpy(np.round(X * 4.0))
    return (X.t() @ X) / rows


def _same(a, b):
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert a.tensors[k].numpy().tobytes() == b.tensors[k].numpy().tobytes(), k
    assert torch.equal(a.W_hat.cpu(), b.W_hat.cpu())
    assert (a.rel_mse, a.g_scale, a.sum_sq_w, a.sum_sq_err, a.proxy_err) == \
        (b.rel_mse, b.g_scale, b.sum_sq_w, b.sum_sq_err, b.proxy_err)


# (out, in): 384 = 3 chunks of 128 or 256 + 128 (not a divisor); 272 x 112 is stored padded to 384 x 128
# (out, in): 384 in chunks of 128, or of 256 (which does not divide it); 272 x 112 is stored padded to 384 x 128
@pytest.mark.parametrize("shape,K,codebook,C", [((384, 128), 2, "mul1", 128), ((272, 112), 6, "mcg", 256)])
def test_weight_only_chunks_are_the_whole_encode(shape, K, codebook, C):
    W = _weight(*shape, 3)
    _same(encode(W, K, codebook, seed=9), encode(W, K, codebook, seed=9, chunk=C))


@pytest.mark.parametrize("shape,K,codebook,C", [((384, 128), 6, "mcg", 256), ((272, 112), 2, "mul1", 128)])
def test_ldlq_chunks_are_the_whole_encode(shape, K, codebook, C):
    W, H = _weight(*shape, 4), _hessian(shape[1], 5)
    _same(encode_ldlq(W, H, K, codebook, seed=11), encode_ldlq(W, H, K, codebook, seed=11, chunk=C))


def test_residual_stages_and_zero_matrices_by_chunks():
    W, H = _weight(384, 128, 6), _hessian(128, 7)
    base = encode(W, 2, "mul1", seed=1).tensors
    _same(encode_residual(W, [base], 2, "mul1", seed=2), encode_residual(W, [base], 2, "mul1", seed=2, chunk=128))
    _same(encode_ldlq(W, H, 2, "mul1", seed=2, parents=[base]),
          encode_ldlq(W, H, 2, "mul1", seed=2, parents=[base], chunk=128))
    Z = torch.zeros(384, 128)  # no sample tiles: the search keeps its start; every scale zero
    _same(encode(Z, 2, "mul1", seed=3), encode(Z, 2, "mul1", seed=3, chunk=128))


def test_fold_sum_is_tree_sum():
    from fq.codec.exact import tree_sum

    x = torch.from_numpy(np.random.default_rng(0).standard_normal((3, 1000)) * 1e3)
    x[:, 7] = -0.0
    for block in (1, 2, 64, 128, 1024):
        got = chunked.fold_sum(1000, block, lambda c0, c1: x[:, c0:c1])
        assert got.numpy().tobytes() == tree_sum(x, -1).numpy().tobytes()


def test_chunk_size_comes_from_the_budget(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.setenv(chunked.ENV, "10")  # 10 MiB over LIVE float64 (in, C) temporaries at in = 1024
    assert chunked.chunk_columns(1024, 1 << 20, cpu) == 128
    monkeypatch.setenv(chunked.ENV, "1024")
    assert chunked.chunk_columns(1024, 1 << 20, cpu) == 8192  # 1 GiB / (10 * 8 * 1024) = 13107 -> 8192
    monkeypatch.setenv(chunked.ENV, "lots")
    with pytest.raises(FqError, match=chunked.ENV):
        chunked.chunk_columns(1024, 1 << 20, cpu)
    with pytest.raises(FqError, match="power of two"):
        encode(_weight(384, 128, 1), 2, chunk=384)


def test_chunked_ldlq_peak_is_bounded_by_the_chunk():
    """Live tensor bytes (every storage an operator returns, until collected) of a 2048 x 512 LDLQ encode by chunks
    of 128 channels. The whole-matrix encoder holds about 13 (out, in) float64 copies at its peak (the refit; 13.1 at
    4096 x 512, 12.8 at 8192 x 512: 90.6 GiB for GLM-5's lm_head). By chunks: the float64 target and the walk's
    feedback buffer (one each), then temporaries of one 128-row panel (128 x out), of one chunk (in x C) or of the
    Hessian (in x in), a dozen of each at most. No single tensor is larger than one (out, in) float64."""
    out_f, in_f, C = 2048, 512, 128
    W, H = _weight(out_f, in_f, 8), _hessian(in_f, 9)
    unit = out_f * in_f * 8
    with LiveBytes("cpu") as m:
        encode_ldlq(W, H, 3, "mul1", seed=1, chunk=C)
    bound = 2 * unit + 12 * (128 * out_f * 8) + 12 * (in_f * C * 8) + 12 * (in_f * in_f * 8)
    assert m.largest <= unit
    assert m.peak <= bound < 13 * unit, (m.peak / unit, m.at_peak[:16])


@cuda
def test_cuda_chunks_equal_the_cpu_whole_encode():
    W, H = _weight(272, 112, 4), _hessian(112, 5)
    whole = encode_ldlq(W, H, 2, "mul1", seed=11)
    _same(whole, encode_ldlq(W, H, 2, "mul1", seed=11, device="cuda", chunk=128))
    whole = encode(W, 6, "mcg", seed=9)
    _same(whole, encode(W.cuda(), 6, "mcg", seed=9, device="cuda", chunk=128))
