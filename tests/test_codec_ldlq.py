"""The calibrated LDLQ encoder (fq.codec.ldlq) and its exact arithmetic (fq.codec.gridmm, fq.codec.ldl).

Inputs are built from numpy's generator and integer-valued activations, so they are the same bits on every
machine (torch.randn's vectorized paths may differ by ISA), and H = X^T X / rows is exact. Sizes are small
(128x256 weights): every test here runs in well under a second or two on one core.
"""
import hashlib
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.conftest import cuda
from fq.codec import encode, reconstruct, reconstruct_chain, validate_tensors
from fq.codec import ldlq as ldlq_mod
from fq.codec.gridmm import budget, exact_mm, grid_mm, split
from fq.codec.ldl import block_ldl
from fq.codec.ldlq import encode_ldlq, encode_ldlq_batch, proxy_error
from fq.errors import FqError

# sha256 of the tensors of encode_ldlq(*_golden_case()) (K2 mul1, seed 5), computed once on an AVX-512 CPU
GOLDEN_SHA256 = "d2247a7bb58762880c7657833f7f8a9c8a29e177d0716b376a5cf9da514cfeb6"


def _weight(out_f, in_f, seed):
    """Heavy tails and uneven channels, like expert weights (numpy: the same bits everywhere)."""
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((out_f, in_f))
    w = z * z * z  # (not z ** 3: numpy may call libm's pow)
    w = w * (0.5 + rng.random((out_f, 1))) * (0.2 + 2.0 * rng.random((1, in_f))) * 0.02
    return torch.from_numpy(w).float()


def _hessian(in_f, seed, rows=1024, rank=8, outliers=4):
    """H = X^T X / rows of integer activations: a correlated low-rank part, noise, a few large channels."""
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, in_f)) + 0.3 * rng.standard_normal((rows, in_f))
    X[:, rng.permutation(in_f)[:outliers]] *= 20.0
    X = torch.from_numpy(np.round(X * 4.0))  # integers: X^T X is exact in float64 (|sums| << 2^53)
    return (X.t() @ X) / rows  # rows a power of two: exact


def _golden_case():
    return _weight(128, 256, 1), _hessian(256, 2)


def _digest(tensors):
    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].contiguous().numpy().tobytes())
    return h.hexdigest()


def _same(a, b):
    assert set(a.tensors) == set(b.tensors)
    for k in a.tensors:
        assert a.tensors[k].device.type == "cpu" and b.tensors[k].device.type == "cpu"
        assert a.tensors[k].numpy().tobytes() == b.tensors[k].numpy().tobytes(), k
    assert torch.equal(a.W_hat.cpu(), b.W_hat.cpu())
    assert (a.rel_mse, a.g_scale, a.sum_sq_w, a.sum_sq_err, a.proxy_err) == \
        (b.rel_mse, b.g_scale, b.sum_sq_w, b.sum_sq_err, b.proxy_err)


@pytest.fixture(scope="module")
def golden():
    W, H = _golden_case()
    return W, H, encode_ldlq(W, H, 2, "mul1", seed=5)


@pytest.fixture(scope="module")
def weight_only(golden):
    W = golden[0]
    return {K: encode(W, K, "mul1", seed=5) for K in (2, 3)}


# ---------------------------------------------------------------------------------------------- gridmm


def test_grid_product_is_exact_and_order_free():
    rng = np.random.default_rng(0)
    A = torch.from_numpy(rng.standard_normal((3, 40, 300)) * 10.0 ** rng.integers(-6, 6, (3, 40, 1)))
    B = torch.from_numpy(rng.standard_normal((3, 300, 24)))
    bits = budget(300)
    ga, gb = split(A, bits // 2, 2, batch_dims=1), split(B, bits - bits // 2, 2, batch_dims=1)
    got = grid_mm(ga, gb)
    # the same integer products in int64 (exact integer arithmetic, no BLAS), combined in grid_mm's order
    ia = [p.numpy().astype(np.int64) for p in ga.parts]
    ib = [p.numpy().astype(np.int64) for p in gb.parts]
    terms = {(s, t): torch.from_numpy((ia[s] @ ib[t]).astype(np.float64)) for s in range(2) for t in range(2)}
    assert all(bool((v.abs() <= 2.0**53).all()) for v in terms.values())
    ref = (terms[0, 1] * 2.0 ** -(gb.bits) + terms[1, 0] * 2.0 ** -(ga.bits)) + terms[0, 0]
    assert torch.equal(got, ref * (ga.unit * gb.unit))
    # any summation order: the inner dimension permuted, and summed in reversed chunks
    perm = torch.from_numpy(rng.permutation(300))
    ga2, gb2 = split(A[..., perm], bits // 2, 2, batch_dims=1), split(B[:, perm], bits - bits // 2, 2, batch_dims=1)
    assert torch.equal(grid_mm(ga2, gb2), got)
    chunks = [(ga.cols(a, a + 60), gb.rows(a, a + 60)) for a in range(240, -1, -60)]
    for s, t in ((0, 0), (0, 1), (1, 0)):
        acc = sum((x.parts[s] @ y.parts[t] for x, y in chunks), torch.zeros_like(got))
        assert torch.equal(acc, terms[s, t])
    # each batch element gets its own grid: a stack gives each matrix's own result
    for i in range(3):
        assert torch.equal(exact_mm(A[i], B[i], 2, 2), got[i])
    assert float((got - A @ B).abs().max() / (A @ B).abs().max()) < 1e-12
    with pytest.raises(AssertionError, match="53"):
        grid_mm(split(A[0], bits, 1), split(B[0], 1, 1))


# ---------------------------------------------------------------------------------------------- block LDL


def _reference_ldl(H):
    k, m = H.shape[0], H.shape[0] // 16
    C = torch.linalg.cholesky(H)
    L = C.clone().view(k, m, 16)
    for i in range(m):
        L[:, i, :] = L[:, i, :] @ torch.linalg.inv(C[i * 16 : (i + 1) * 16, i * 16 : (i + 1) * 16])
    blocks = torch.arange(k) // 16
    return torch.where(blocks[:, None] > blocks[None, :], L.reshape(k, k), torch.zeros((), dtype=H.dtype))


def test_block_ldl_matches_lapack_and_flags_indefinite():
    H = _hessian(256, 3)
    H = H + 0.025 * H.diagonal().mean() * torch.eye(256, dtype=torch.float64)
    s = 2.0 ** -torch.ceil(torch.log2(H.diagonal()) / 2)  # powers of two, as the encoder equilibrates
    He = H * s[:, None] * s[None, :]
    bad = He.clone()
    bad[200, 200] = -1.0
    L, ok = block_ldl(torch.stack([He, bad]))
    assert ok.tolist() == [True, False]
    assert float((L[0] - _reference_ldl(He)).abs().max()) < 1e-10
    # L D L^T = H, with D the block diagonal of the Schur complements
    L1, _ = block_ldl(He[None])
    assert torch.equal(L1[0], L[0])  # a matrix's factor does not depend on the batch it is in
    U = L[0] + torch.eye(256, dtype=torch.float64)
    D = torch.linalg.solve(U, torch.linalg.solve(U, He).t()).t()
    blocks = torch.arange(256) // 16
    assert float(D[blocks[:, None] != blocks[None, :]].abs().max()) < 1e-10


# ---------------------------------------------------------------------------------------------- encoder


def test_ldlq_deterministic_and_golden(golden):
    W, H, e = golden
    _same(e, encode_ldlq(W, H, 2, "mul1", seed=5))
    assert _digest(e.tensors) == GOLDEN_SHA256


ISA_SCRIPT = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from tests.test_codec_ldlq import _digest, _golden_case
from fq.codec.ldlq import encode_ldlq
from fq.codec import viterbi
W, H = _golden_case()
print(viterbi._trellis.isa(), torch.get_num_threads(), _digest(encode_ldlq(W, H, 2, "mul1", seed=5).tensors))
"""


def test_ldlq_bytes_independent_of_isa_and_threads():
    """AVX2 everywhere (fq's Viterbi, torch's kernels, MKL's GEMMs), one thread: the golden bytes again."""
    from fq.codec import viterbi

    if viterbi._trellis is None or "avx2" not in viterbi._trellis.isas():
        pytest.skip("this CPU cannot run the AVX2 kernels")
    env = dict(os.environ, FQ_CPU_ISA="avx2", ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout: tests.test_codec_ldlq
    r = subprocess.run([sys.executable, "-c", ISA_SCRIPT, root], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    isa, threads, digest = r.stdout.split()
    assert (isa, threads) == ("avx2", "1")
    assert digest == GOLDEN_SHA256


def test_tensors_valid_and_reconstruct_is_what_encoded_says(golden):
    W, H, e = golden
    g = validate_tensors(e.tensors, "W", K=2, codebook="mul1")
    assert (g.in_features, g.out_features) == (256, 128)
    W_hat = reconstruct(e.tensors)
    assert torch.equal(W_hat, e.W_hat)
    assert proxy_error(W, W_hat, H) == e.proxy_err
    d = W_hat.double() - W.double()
    assert e.rel_mse == pytest.approx(float((d * d).sum() / (W.double() ** 2).sum()), rel=1e-12)
    E, H64 = d, H.double()
    ref = float(torch.trace(E @ H64 @ E.t()) / torch.trace(W.double() @ H64 @ W.double().t()))
    assert e.proxy_err == pytest.approx(ref, rel=1e-5)


@pytest.mark.parametrize("K", [2, 3])
def test_ldlq_beats_weight_only_in_the_h_metric(golden, weight_only, K):
    W, H, e2 = golden
    e = e2 if K == 2 else encode_ldlq(W, H, K, "mul1", seed=5)
    wo = proxy_error(W, weight_only[K].W_hat, H)
    assert e.proxy_err < wo / 4, (K, e.proxy_err, wo)
    # the weight-only encoder's proxy error with H = I is its relative MSE (the reference's no-H fallback)
    eye = torch.eye(256)
    assert proxy_error(W, weight_only[K].W_hat, eye) == pytest.approx(weight_only[K].rel_mse, rel=1e-5)


def test_identity_hessian_keeps_the_weight_mse(weight_only, golden):
    W = golden[0]
    e = encode_ldlq(W, torch.eye(256), 2, "mul1", seed=5)
    assert e.rel_mse < 1.05 * weight_only[2].rel_mse
    assert e.proxy_err == pytest.approx(e.rel_mse, rel=1e-5)


def test_residual_stage_in_the_h_metric(golden):
    W, H, base = golden
    stage = encode_ldlq(W, H, 1, "mul1", seed=6, parents=[base.tensors])
    chain = reconstruct_chain([base.tensors, stage.tensors])
    before, after = proxy_error(W, base.W_hat, H), proxy_error(W, chain, H)
    assert after < 0.5 * before, (before, after)
    R = W.double() - base.W_hat.double()
    assert stage.proxy_err == proxy_error(R, stage.W_hat, H)


def test_batch_equals_single_encodes(golden, monkeypatch):
    W, H, e = golden
    Wz = _weight(256, 256, 7)  # another width: a second stack of the batched products
    Wz[:, 17] = 0.0  # a zero input channel
    Wz[5] = 0.0  # a zero output channel
    Ws = [W, Wz, torch.zeros(128, 256)]
    singles = [e, encode_ldlq(Wz, H, 2, "mul1", 8), encode_ldlq(Ws[2], H, 2, "mul1", 9)]
    calls = []
    real = ldlq_mod._viterbi
    monkeypatch.setattr(ldlq_mod, "_viterbi", lambda t, *a, **kw: calls.append(t.shape[0]) or real(t, *a, **kw))
    batch = encode_ldlq_batch(Ws, H, 2, "mul1", [5, 8, 9], names=["a", "b", "c"])
    for a, b in zip(singles, batch):
        _same(a, b)
    # one Viterbi call per 16-row step holds the tiles of all the matrices
    assert calls == [sum(w.shape[0] // 16 for w in Ws)] * 16
    rec = reconstruct(batch[1].tensors)
    assert torch.count_nonzero(rec[5]) == 0 and torch.count_nonzero(rec[:, 17]) == 0
    assert torch.count_nonzero(reconstruct(batch[2].tensors)) == 0 and batch[2].proxy_err == 0.0


def test_batch_with_a_hessian_per_matrix_equals_single_encodes(golden):
    # every expert's down projection has its own Hessian: one batch, each matrix coded in its own metric
    W, H, e = golden
    x = torch.randn(512, 256, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    H2 = x.T @ x / 512
    Wz = _weight(256, 256, 7)
    batch = encode_ldlq_batch([W, Wz, W], [H, H2, H2], 2, "mul1", [5, 8, 5])
    for a, b in zip([e, encode_ldlq(Wz, H2, 2, "mul1", 8), encode_ldlq(W, H2, 2, "mul1", 5)], batch):
        _same(a, b)
    assert batch[0].proxy_err != batch[2].proxy_err  # the same W in two metrics
    with pytest.raises(FqError, match="one Hessian each or one for all, got 2"):
        encode_ldlq_batch([W, Wz, W], [H, H2], 2)


def test_indefinite_hessian_gets_more_damping(golden):
    W, H, _ = golden
    lam = torch.linalg.eigvalsh(H)[0]
    Hi = H - (lam + 0.1 * H.diagonal().mean()) * torch.eye(256, dtype=torch.float64)  # min eigenvalue < -damping
    with pytest.warns(RuntimeWarning, match=r"W: Hessian H is not positive definite .* retrying with 0.25"):
        e = encode_ldlq(W, Hi, 2, "mul1", seed=5)
    validate_tensors(e.tensors, K=2, codebook="mul1")
    v = torch.ones(256, dtype=torch.float64) / 16.0
    hopeless = torch.eye(256, dtype=torch.float64) - 200.0 * torch.outer(v, v)
    with pytest.raises(FqError, match=r"expert\.up: Hessian H is not positive definite even with a damping of 25"):
        with pytest.warns(RuntimeWarning):
            encode_ldlq(W, hopeless, 2, "mul1", seed=5, name="expert.up")


@pytest.mark.parametrize("change,match", [
    (lambda H: H.index_put_((torch.tensor(3), torch.tensor(4)), torch.tensor(float("nan"), dtype=H.dtype)),
     r"gate: Hessian H contains NaN or Inf \(first at \[3, 4\]\)"),
    (lambda H: H[:128, :128], r"gate: Hessian H: expected a floating-point \(in, in\) = \(256, 256\)"),
    (lambda H: H + torch.triu(torch.ones_like(H), 1) * H.abs().max(), "gate: Hessian H is not symmetric"),
    (lambda H: torch.zeros_like(H), "gate: Hessian H has no usable energy"),
])
def test_bad_hessians_are_refused_by_name(golden, change, match):
    W, H, _ = golden
    with pytest.raises(FqError, match=match):
        encode_ldlq(W, change(H.clone()), 2, name="gate")


def test_batch_argument_errors(golden):
    W, H, _ = golden
    with pytest.raises(FqError, match="seeds"):
        encode_ldlq_batch([W, W], H, 2, "mul1", [1])
    with pytest.raises(FqError, match=r"Ws\[1\]: in_features 128"):
        encode_ldlq_batch([W, torch.zeros(256, 128)], H, 2)


# ---------------------------------------------------------------------------------------------- CUDA


@cuda
def test_cuda_ldlq_equals_cpu(golden):
    W, H, cpu = golden
    gpu = encode_ldlq(W, H, 2, "mul1", seed=5, device="cuda")
    assert gpu.W_hat.device.type == "cuda"
    _same(cpu, gpu)
    Ws = [W, _weight(256, 256, 7), torch.zeros(128, 256)]
    a = encode_ldlq_batch(Ws, H, 3, "mcg", [1, 2, 3])
    b = encode_ldlq_batch([w.cuda() for w in Ws], H.cuda(), 3, "mcg", [1, 2, 3], "cuda:0")
    for x, y in zip(a, b):
        _same(x, y)
    base = encode_ldlq(W, H, 1, "mul1", seed=4, device="cuda", parents=[cpu.tensors])
    _same(base, encode_ldlq(W, H, 1, "mul1", seed=4, parents=[cpu.tensors]))
    assert proxy_error(W.cuda(), gpu.W_hat, H.cuda()) == proxy_error(W, cpu.W_hat, H)


@cuda
def test_cuda_block_factor_kernel_equals_the_host_bits():
    """The 16x16 block factor runs on the GPU in the host's operation order: the same bits for positive definite,
    near-singular, indefinite and non-finite blocks, read through strides; block_ldl flags the same matrices."""
    from fq.codec.ldl import chol_inv16
    from fq.codec.viterbi_cuda import chol_inv16_cuda

    g = torch.Generator().manual_seed(3)
    X = torch.randn(40, 16, 24, generator=g, dtype=torch.float64)
    D = X @ X.transpose(1, 2) / 24
    D[1] = D[1] * 1e-300  # tiny but positive
    D[2, 5, 5] = -1.0  # indefinite
    D[3, 9, 2] = float("nan")  # non-finite below the diagonal
    D[4] = torch.outer(X[4, :, 0], X[4, :, 0])  # singular
    D[5, 0, 7] = float("inf")  # above the diagonal: never read
    big = torch.zeros(40, 48, 48, dtype=torch.float64)
    big[:, 16:32, 16:32] = D
    view = big.cuda()[:, 16:32, 16:32]  # strided, as block_ldl hands it over
    inv, good = chol_inv16_cuda(view)
    low = torch.tril(D) + torch.tril(D, -1).transpose(1, 2)
    ref_inv, ref_ok = chol_inv16(low.numpy())
    assert good.cpu().numpy().tolist() == ref_ok.tolist()
    assert not ref_ok[2] and not ref_ok[3] and ref_ok[0] and ref_ok[5]
    assert inv.cpu().numpy().tobytes() == ref_inv.tobytes()
    H = _hessian(256, 3)
    H = H + 0.025 * H.diagonal().mean() * torch.eye(256, dtype=torch.float64)
    s = 2.0 ** -torch.ceil(torch.log2(H.diagonal()) / 2)
    He = H * s[:, None] * s[None, :]
    bad = He.clone()
    bad[200, 200] = -1.0
    Lc, okc = block_ldl(torch.stack([He, bad]))
    Lg, okg = block_ldl(torch.stack([He, bad]).cuda())
    assert okg.tolist() == okc.tolist() == [True, False]
    assert Lg.cpu().numpy().tobytes() == Lc.numpy().tobytes()


@cuda
@pytest.mark.slow
def test_cuda_ldlq_large_equals_cpu():
    """One GLM-5-like matrix (2048 out x 6144 in) at K2: the CPU and the GPU give the same bytes."""
    W = _weight(2048, 6144, 11)
    H = _hessian(6144, 12, rows=2048, rank=32, outliers=16)
    gpu = encode_ldlq(W, H, 2, "mul1", seed=3, device="cuda")
    cpu = encode_ldlq(W, H, 2, "mul1", seed=3)
    _same(cpu, gpu)
