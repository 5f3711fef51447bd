"""Bit-compatibility with the reference EXL3 kernels (exllamav3 1.6.5, golden files in tests/data)."""
import pytest
import torch

from tests.conftest import CODEBOOK_NAMES, cuda
from fq.codec import reconstruct
from fq.codec.codebook import values_torch
from fq.codec.hadamard import had_rows
from fq.codec.packing import pack, tiles_to_matrix, unpack
from fq.codec.tensors import decode_inner

TILE_CASES = [(K, cb) for K in range(1, 9) for cb in range(3)]


def _states(g, K, cb):
    return g[f"k{K}_cb{cb}.indices"].to(torch.int32) & 0xFFFF


@pytest.mark.parametrize("K,cb", TILE_CASES)
def test_decode_reference_indices_bit_exact(golden_tiles, K, cb):
    decoded = values_torch(CODEBOOK_NAMES[cb])[_states(golden_tiles, K, cb).long()]
    assert torch.equal(decoded.view(torch.int32), golden_tiles[f"k{K}_cb{cb}.tiles_q"].view(torch.int32))


@pytest.mark.parametrize("K,cb", TILE_CASES)
def test_pack_matches_reference_and_unpack_inverts(golden_tiles, K, cb):
    states = _states(golden_tiles, K, cb).reshape(2, 16, 256)
    packed = golden_tiles[f"k{K}_cb{cb}.packed"]
    assert torch.equal(pack(states, K), packed)
    assert torch.equal(unpack(packed, K), states)


@pytest.mark.parametrize("K,cb", TILE_CASES)
def test_reconstruct_packed_matches_reference_fp16(golden_tiles, K, cb):
    inner = decode_inner(golden_tiles[f"k{K}_cb{cb}.packed"], K, CODEBOOK_NAMES[cb])
    ref = golden_tiles[f"k{K}_cb{cb}.reconstruct"]
    assert torch.equal(inner.half().view(torch.int16), ref.view(torch.int16))


def test_row_hadamard_matches_reference_kernel(golden_tiles):
    out = had_rows(golden_tiles["had_r_128.in"].float()).half()
    assert torch.equal(out.view(torch.int16), golden_tiles["had_r_128.out"].view(torch.int16))


def _case_tensors(m, tag):
    keys = ("trellis", "suh", "svh", "mul1", "mcg")
    return {k: m[f"{tag}.{k}"] for k in keys if f"{tag}.{k}" in m}


def test_matrix_cases_decode_and_reconstruct(golden_matrices):
    m, cases = golden_matrices
    assert len(cases) == 6
    for c in cases:
        tag, K, cb = c["tag"], c["K"], CODEBOOK_NAMES[c["cb"]]
        tensors = _case_tensors(m, tag)
        inner = decode_inner(tensors["trellis"], K, cb)
        assert torch.equal(inner.half().view(torch.int16), m[f"{tag}.inner"].view(torch.int16)), tag
        W = reconstruct(tensors)
        tol = 1e-6 * m[f"{tag}.W"].abs().max()
        assert (W - m[f"{tag}.W_dec"]).abs().max() <= tol, tag
        rel = float(((W - m[f"{tag}.W"]) ** 2).sum() / (m[f"{tag}.W"] ** 2).sum())
        assert rel == pytest.approx(c["rel_mse_dec"], rel=1e-4), tag


def test_tile_layout_round_trip():
    x = torch.arange(32 * 256, dtype=torch.float32).reshape(32, 256)
    from fq.codec.packing import matrix_to_tiles

    assert torch.equal(tiles_to_matrix(matrix_to_tiles(x)), x)


@cuda
@pytest.mark.parametrize("K,cb", TILE_CASES)
def test_cuda_decode_bit_exact(golden_tiles, K, cb):
    packed = golden_tiles[f"k{K}_cb{cb}.packed"].cuda()
    inner = decode_inner(packed, K, CODEBOOK_NAMES[cb])
    ref = golden_tiles[f"k{K}_cb{cb}.reconstruct"].cuda()
    assert torch.equal(inner.half().view(torch.int16), ref.view(torch.int16))
    assert torch.equal(unpack(packed, K).cpu(), _states(golden_tiles, K, cb).reshape(2, 16, 256))


@cuda
def test_cuda_matrix_reconstruct_equals_cpu(golden_matrices):
    m, cases = golden_matrices
    for c in cases:
        tensors = _case_tensors(m, c["tag"])
        cpu = reconstruct(tensors)
        gpu = reconstruct({k: v.cuda() for k, v in tensors.items()})
        assert torch.equal(cpu, gpu.cpu()), c["tag"]
