"""Cutting EXL3 tensor sets by whole 128-blocks reconstructs exactly the matching rows/columns.

This is the property every TP load and export rests on: reconstruct(slice(set)) equals the slice of
reconstruct(set), bit for bit, for an output (column of W^T) split where suh stays whole and svh is cut,
and for an input (row of W^T) split where suh is cut and svh stays whole.
"""
import pytest
import torch

from tests.kits import provkit
from fq.codec import quantize, reconstruct, reconstruct_chain
from fq.errors import FqError
from fq.tp.mesh import Slice
from fq.tp.slicing import assemble, slice_dense, slice_exl3, sliced_shape
from tests.kits.tpkit import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def encoded():
    """A real encoder output, W (256, 256) at K=2 mul1 (256 tiles, a few seconds on two cores), and a
    random K=1 mcg stage on top of it (a chain)."""
    W = torch.randn(256, 256, generator=torch.Generator().manual_seed(3)) * 0.02
    return W, [quantize(W, 2, "mul1", seed=0), provkit.random_set(256, 256, 1, "mcg", torch.Generator().manual_seed(1))]


def cuts(n: int, parts: int, dim: int) -> list[Slice]:
    step = n // parts
    return [Slice(dim, i * step, (i + 1) * step) for i in range(parts)]


@pytest.mark.parametrize("dim, parts", [(0, 2), (1, 2)])
def test_real_codec_output_slices_reconstruct_bit_identically(encoded, dim, parts):
    _, chain = encoded
    full = reconstruct_chain(chain)
    pieces = []
    for sl in cuts(full.shape[dim], parts, dim):
        cut = [slice_exl3(t, sl) for t in chain]
        if dim == 0:  # output split: svh cut, suh whole
            assert all(torch.equal(c["suh"], t["suh"]) and c["svh"].shape == (sl.stop - sl.start,)
                       for c, t in zip(cut, chain))
        else:  # input split: suh cut, svh whole
            assert all(torch.equal(c["svh"], t["svh"]) and c["suh"].shape == (sl.stop - sl.start,)
                       for c, t in zip(cut, chain))
        piece = reconstruct_chain(cut)
        want = full[sl.start:sl.stop] if dim == 0 else full[:, sl.start:sl.stop]
        assert torch.equal(piece, want)
        pieces.append((sl, piece))
    assert torch.equal(assemble(pieces), full)


@pytest.mark.parametrize("K, codebook", [(1, "mcg"), (3, "3inst"), (8, "mul1")])
def test_every_codebook_and_K(K, codebook):
    gen = torch.Generator().manual_seed(K)
    t = provkit.random_set(384, 256, K, codebook, gen)  # W (384, 256)
    full = reconstruct(t)
    for sl in cuts(384, 3, 0) + cuts(256, 2, 1) + [Slice(0, 128, 384), Slice(1, 0, 256)]:
        got = reconstruct(slice_exl3(t, sl))
        assert torch.equal(got, full[sl.start:sl.stop] if sl.dim == 0 else full[:, sl.start:sl.stop])
        assert got.shape == sliced_shape((384, 256), sl)


def test_a_cut_inside_a_hadamard_block_is_refused_and_would_be_wrong():
    t = provkit.random_set(256, 256, 2, "mul1", torch.Generator().manual_seed(0))
    with pytest.raises(FqError, match=r"out\[0:64\] does not cut whole 128-blocks"):
        slice_exl3(t, Slice(0, 0, 64), "w")
    with pytest.raises(FqError, match=r"in\[128:384\] is not inside \[0, 256\)"):
        slice_exl3(t, Slice(1, 128, 384), "w")
    # why 128: a 64-channel cut of the tiles alone does not reconstruct those channels
    inner = dict(t, trellis=t["trellis"][:, :4].contiguous(), svh=t["svh"][:128].contiguous())
    inner["trellis"] = torch.cat([inner["trellis"], torch.zeros_like(inner["trellis"])], dim=1)
    assert not torch.equal(reconstruct(inner)[:64], reconstruct(t)[:64])


def test_dense_slices():
    w = torch.arange(12.0).reshape(3, 4)
    assert torch.equal(slice_dense(w, Slice(1, 2, 4)), w[:, 2:])
    assert torch.equal(slice_dense(w, None), w)
    with pytest.raises(FqError, match="not inside"):
        slice_dense(w, Slice(0, 2, 4))
