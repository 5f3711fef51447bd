"""The CUDA Viterbi kernel (fq/codec/_viterbi_cuda.cu) gives the CPU kernel's states, bit for bit.

CPU-only parts: a numpy model of the kernel's thread/buffer layout (tests/kits/cuda_viterbi_model.py) against the
C kernel, and (where nvcc exists) that the kernel compiles for sm_90. The GPU parts call the kernel directly
(never the dispatcher, whose torch fallback would hide a broken kernel).
"""
import os
import shutil
import warnings

import numpy as np
import pytest
import torch

from tests.conftest import CODEBOOK_NAMES, cuda
from tests.kits.cuda_viterbi_model import viterbi_model
from fq.codec import quantize
from fq.codec.codebook import values_f32
from fq.codec.viterbi import viterbi

ALL_CASES = [(K, cb) for K in range(1, 9) for cb in range(3)]


def _gauss_tiles(n, K, seed):
    g = torch.Generator().manual_seed(seed)
    scale = (1.4, 1.2, 1.15, 1.1, 1.05, 1.0, 0.95, 0.9)[K - 1]
    return torch.randn(n, 256, generator=g) * scale


@pytest.mark.parametrize("K", range(1, 9))
def test_kernel_model_equals_c_kernel(golden_tiles, K):
    cb = CODEBOOK_NAMES[K % 3]
    x = golden_tiles[f"k{K}_cb{K % 3}.tiles_in"][:1]
    assert np.array_equal(viterbi_model(x.numpy(), K, values_f32(cb)), viterbi(x, K, cb).numpy())


@pytest.mark.parametrize("K", [1, 2, 8])
def test_kernel_model_tie_rules(K):
    # all-equal costs (zero tiles), float32 ties at large magnitude, all-inf costs: first minimum everywhere
    rng = np.random.default_rng(K)
    xs = np.stack([np.zeros(256), 1000.0 + rng.integers(0, 3, 256), np.full(256, 1e20)]).astype(np.float32)
    with np.errstate(over="ignore"):
        model = viterbi_model(xs, K, values_f32("mul1"))
    assert np.array_equal(model, viterbi(torch.from_numpy(xs), K, "mul1").numpy())


@pytest.mark.skipif(shutil.which("nvcc") is None and not os.environ.get("FQ_NVCC"), reason="needs nvcc")
def test_kernel_compiles_for_sm90(tmp_path, monkeypatch):
    from fq.codec import viterbi_cuda

    monkeypatch.setenv("FQ_CUDA_CACHE", str(tmp_path))
    lib = viterbi_cuda.build((9, 0))
    assert lib.is_file() and viterbi_cuda.build((9, 0)) == lib  # cached by content
    loaded = viterbi_cuda._load((9, 0))
    assert loaded.fq_viterbi_abi() == viterbi_cuda.ABI
    assert [loaded.fq_viterbi_bp_bytes(K) for K in (1, 2, 8)] == [256 * 4096, 256 * 16384, 256 * 256]


def _kernel(x, K, cb, device="cuda"):
    from fq.codec import viterbi_cuda

    return viterbi_cuda.viterbi_cuda(x, K, cb, device).cpu()


@cuda
@pytest.mark.parametrize("K,cb", ALL_CASES)
def test_cuda_kernel_equals_cpu_on_golden_tiles(golden_tiles, K, cb):
    x = golden_tiles[f"k{K}_cb{cb}.tiles_in"]
    name = CODEBOOK_NAMES[cb]
    assert torch.equal(_kernel(x, K, name), viterbi(x, K, name))


@cuda
@pytest.mark.parametrize("K", [1, 2, 3, 4])
def test_cuda_kernel_equals_cpu_on_gaussian_tiles(K):
    for i, cb in enumerate(CODEBOOK_NAMES):
        x = _gauss_tiles(192, K, seed=100 * K + i)
        assert torch.equal(_kernel(x, K, cb, "cuda:0"), viterbi(x, K, cb)), cb


@cuda
def test_cuda_kernel_ties_and_degenerate_tiles():
    rng = np.random.default_rng(7)
    xs = torch.from_numpy(np.stack([np.zeros(256), 1000.0 + rng.integers(0, 3, 256), np.full(256, 1e20),
                                    values_f32("mcg")[rng.integers(0, 65536, 256)]]).astype(np.float32))
    for K in range(1, 9):
        for cb in CODEBOOK_NAMES:
            assert torch.equal(_kernel(xs, K, cb), viterbi(xs, K, cb)), (K, cb)


@cuda
def test_cuda_kernel_batches_across_scratch(monkeypatch):
    # 1 MiB of scratch holds 16 K=8 tiles: 300 tiles run as several launches of whole SM waves
    monkeypatch.setenv("FQ_CUDA_VITERBI_SCRATCH_MB", "1")
    from fq.codec import viterbi_cuda

    assert viterbi_cuda.batch_tiles(8, 300, "cuda") < 300
    x = _gauss_tiles(300, 8, seed=5)
    assert torch.equal(_kernel(x, 8, "mul1"), viterbi(x, 8, "mul1"))
    assert _kernel(x[:0], 8, "mul1").shape == (0, 256)


@cuda
def test_cuda_kernel_deterministic():
    x = _gauss_tiles(64, 2, seed=11)
    assert torch.equal(_kernel(x, 2, "mul1"), _kernel(x, 2, "mul1"))


@cuda
def test_cuda_encoder_uses_the_kernel_and_gives_the_cpu_trellis(golden_matrices):
    from fq.codec import viterbi_cuda

    viterbi_cuda.library("cuda")  # fails here, not silently in the torch fallback
    m, cases = golden_matrices
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the fallback warns
        for c in cases:
            K, cb = c["K"], CODEBOOK_NAMES[c["cb"]]
            cpu = quantize(m[f"{c['tag']}.W"], K, cb, seed=c["seed"])
            gpu = quantize(m[f"{c['tag']}.W"], K, cb, seed=c["seed"], device="cuda")
            assert set(cpu) == set(gpu)
            for k in cpu:
                assert torch.equal(cpu[k], gpu[k]), (c["tag"], k)
