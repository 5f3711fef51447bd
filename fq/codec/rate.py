"""The bitrate K of an EXL3 trellis: an integer 1..8, or a half-integer 1.5, 2.5, 3.5 (mul1 codebook only).

A half-integer K = KA + 0.5 (exllamav3 1.6.5 ``frac_k``: MASK 0xAAAA) advances the trellis by D(p) = KA bits at
even tile positions p and KA + 1 bits at odd ones, so a 256-weight tile is a ring of 256*K bits = 16*K uint16
words, as at integer K. Everything else (16-bit state, codebook, tile order, MSB-first words) is the integer
format's; see docs/codec.md "Half-integer K". Integer K is the special case D(p) = K.
"""
from __future__ import annotations

from fq.core import kbits
from fq.errors import FqError

INTEGER_KS = tuple(range(1, 9))
HALF_KS = kbits.HALF_KS  # the rates exllamav3 1.6.5 instantiates (quantize_tiles_frac_kernel_a{1,2,3}_maaaa)
TILE_LEN = 256


def check_k(K, codebook: str | None = None, name: str = "K") -> int | float:
    """K as given if it is an integer 1..8 or one of 1.5, 2.5, 3.5 (the latter only with ``codebook`` mul1, when a
    codebook is given); FqError otherwise. Strict: 2.0 or True is refused, so an integer rate stays an int."""
    ok_int = isinstance(K, int) and not isinstance(K, bool) and K in INTEGER_KS
    ok_half = isinstance(K, float) and K in HALF_KS
    if not (ok_int or ok_half):
        raise FqError(f"{name}: expected an integer in 1..8 or a half-integer rate 1.5, 2.5 or 3.5, got {K!r}")
    if ok_half and codebook is not None and codebook != "mul1":
        raise FqError(f"{name}: the half-integer rate {K} needs the mul1 codebook (as exllamav3 requires), "
                      f"got codebook {codebook!r}")
    return K


def is_half(K) -> bool:
    return isinstance(K, float)


def ka(K) -> int:
    """The narrow step width: K itself for integer K, K - 0.5 for a half-integer K."""
    return int(K)


def step_bits(K) -> list[int]:
    """D(p), the bits trellis step p (tile position p in tensor-core order) adds: K, or KA + (p & 1)."""
    if not is_half(K):
        return [K] * TILE_LEN
    a = ka(K)
    return [a + (p & 1) for p in range(TILE_LEN)]


def tile_words(K) -> int:
    """uint16 words per 256-weight tile: 16*K (an integer at half-integer K too)."""
    return int(16 * K)


def ring_ends(K) -> list[int]:
    """S(p) = D(0) + ... + D(p): the ring bit where state p's 16-bit window ends (exclusive)."""
    out, s = [], 0
    for d in step_bits(K):
        s += d
        out.append(s)
    return out


def k_from_words(words: int, codebook: str | None = None):
    """K from a trellis's last dimension (16*K words): int, a half-integer float, or None if neither fits."""
    if words % 16 == 0 and 1 <= words // 16 <= 8:
        return words // 16
    K = words / 16
    if K in HALF_KS and (codebook is None or codebook == "mul1"):
        return K
    return None
