"""K-bit trellis packing (K = 1..8) and the tensor-core element order inside a 16x16 tile.

A tile's 256 states form a tail-biting ring: state i is the 16 bits of the tile's K*256-bit stream that
end at bit (i+1)*K, wrapping around; its low K bits are symbol i. The stream is stored MSB-first in
16*K uint16 words, with each pair of words swapped (the reference writes uint32 lanes with halves
exchanged). Everything here is plain integer torch, identical on CPU and CUDA.

``pack``/``unpack`` also take a half-integer K (1.5, 2.5, 3.5; fq.codec.rate): the same ring, words and swap,
but step p adds D(p) = KA + (p & 1) bits, so state p's window ends at S(p) = D(0) + ... + D(p) and symbol p is
its low D(p) bits. The integer path is the code it always was (the golden files pin its bytes).
"""
from __future__ import annotations

import functools

import torch

from fq.codec import rate

TILE = 16
TILE_LEN = 256


@functools.lru_cache(maxsize=None)
def _tensor_core_perm() -> torch.Tensor:
    """perm[p] = row-major index (r*16 + c) of the tile element stored at position p."""
    perm = [0] * TILE_LEN
    for t in range(32):
        r0 = (t % 4) * 2
        c0 = t // 4
        rows = (r0, r0 + 1, r0 + 8, r0 + 9)
        for half, c in enumerate((c0, c0 + 8)):
            for j, r in enumerate(rows):
                perm[t * 8 + half * 4 + j] = r * TILE + c
    return torch.tensor(perm, dtype=torch.long)


def tensor_core_perm(device=None) -> torch.Tensor:
    return _tensor_core_perm().to(device)


def tensor_core_perm_inverse(device=None) -> torch.Tensor:
    return torch.argsort(_tensor_core_perm()).to(device)


def matrix_to_tiles(x: torch.Tensor) -> torch.Tensor:
    """(k, n) matrix -> (k/16, n/16, 256) tiles in tensor-core element order."""
    k, n = x.shape
    t = x.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3).reshape(k // TILE, n // TILE, TILE_LEN)
    return t[..., tensor_core_perm(x.device)]


def tiles_to_matrix(t: torch.Tensor) -> torch.Tensor:
    """Inverse of matrix_to_tiles: (tk, tn, 256) tensor-core tiles -> (16*tk, 16*tn) matrix."""
    tk, tn, _ = t.shape
    rm = t[..., tensor_core_perm_inverse(t.device)]
    return rm.reshape(tk, tn, TILE, TILE).permute(0, 2, 1, 3).reshape(tk * TILE, tn * TILE)


def _swap_pairs(words: torch.Tensor) -> torch.Tensor:
    s = words.shape
    return words.reshape(*s[:-1], s[-1] // 2, 2).flip(-1).reshape(s)


def pack(states: torch.Tensor, K) -> torch.Tensor:
    """(..., 256) 16-bit states -> (..., 16*K) int16 packed words. Only each state's low K bits (low D(p) bits
    at a half-integer K) are stored."""
    if isinstance(K, float):  # a half-integer rate; integer K takes the path below, unchanged
        return _pack_half(states, rate.check_k(K))
    dev = states.device
    sym = states.to(torch.int32) & ((1 << K) - 1)
    shifts = torch.arange(K - 1, -1, -1, device=dev, dtype=torch.int32)
    bits = (sym.unsqueeze(-1) >> shifts) & 1  # (..., 256, K), MSB first
    bits = bits.reshape(*states.shape[:-1], TILE * K, 16)
    weights = torch.tensor([1 << (15 - i) for i in range(16)], device=dev, dtype=torch.int32)
    words = (bits * weights).sum(-1, dtype=torch.int32)
    words = torch.where(words >= 32768, words - 65536, words).to(torch.int16)
    return _swap_pairs(words)


def unpack(packed: torch.Tensor, K) -> torch.Tensor:
    """(..., 16*K) int16 packed words -> (..., 256) int32 states in 0..65535."""
    if isinstance(K, float):
        return _unpack_half(packed, rate.check_k(K))
    dev = packed.device
    words = _swap_pairs(packed).to(torch.int32) & 0xFFFF
    nbits = TILE_LEN * K
    i = torch.arange(TILE_LEN, device=dev, dtype=torch.int64)
    start = ((i + 1) * K - 16) % nbits
    wa = start // 16
    wb = (wa + 1) % (TILE * K)
    off = (start % 16).to(torch.int32)
    lead = packed.shape[:-1]
    a = words[..., wa]
    b = words[..., wb]
    window = (a << 16) | b
    return (window >> (16 - off).expand(*lead, TILE_LEN)) & 0xFFFF


def _words_of_bits(bits: torch.Tensor) -> torch.Tensor:
    """(..., 16*W) MSB-first bits -> (..., W) int16 words, pairs swapped (the integer pack's word step)."""
    dev = bits.device
    bits = bits.reshape(*bits.shape[:-1], bits.shape[-1] // 16, 16).to(torch.int32)
    weights = torch.tensor([1 << (15 - i) for i in range(16)], device=dev, dtype=torch.int32)
    words = (bits * weights).sum(-1, dtype=torch.int32)
    words = torch.where(words >= 32768, words - 65536, words).to(torch.int16)
    return _swap_pairs(words)


def _pack_half(states: torch.Tensor, K: float) -> torch.Tensor:
    # Every position's low KA+1 bits, MSB first; an even position (D = KA) drops its leading one.
    dev = states.device
    a = rate.ka(K)
    shifts = torch.arange(a, -1, -1, device=dev, dtype=torch.int32)
    bits = (states.to(torch.int32).unsqueeze(-1) >> shifts) & 1  # (..., 256, KA+1)
    keep = torch.ones((TILE_LEN, a + 1), dtype=torch.bool, device=dev)
    keep[0::2, 0] = False
    stream = bits[..., keep]  # (..., 256*K) in ring order: boolean indexing walks positions, then bits
    return _words_of_bits(stream)


def _unpack_half(packed: torch.Tensor, K: float) -> torch.Tensor:
    dev = packed.device
    words = _swap_pairs(packed).to(torch.int32) & 0xFFFF
    nw = rate.tile_words(K)
    ends = torch.tensor(rate.ring_ends(K), device=dev, dtype=torch.int64)
    start = (ends - 16) % (16 * nw)
    wa = start // 16
    wb = (wa + 1) % nw
    off = (start % 16).to(torch.int32)
    window = (words[..., wa] << 16) | words[..., wb]
    return (window >> (16 - off).expand(*packed.shape[:-1], TILE_LEN)) & 0xFFFF
