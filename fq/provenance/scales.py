"""EXL3 channel scales must be finite.

An EXL3 linear is a trellis of integer codes plus two float16 vectors, ``suh`` (in) and ``svh`` (out),
that scale the decoded rows and columns. The trellis cannot hold a NaN; the scales can, and a signed
fragment with an Inf or NaN scale poisons every weight it touches. ``check_scale`` is the one check:
``fq.provenance.fragments.describe`` applies it while streaming a shard (``fq verify``, ``--base`` verification,
the producer's read-back) and ``fq combine`` applies it to the byte ranges it copies into an adapter.
The encoder refuses to produce such scales in the first place (``fq.codec.scale_search.check_scales``).

    nonfinite_f16(data, offset=0) -> index of the first NaN/Inf float16 in a (piece of a) tensor, or None
    check_scale(data, where, offset=0)   # raises FqError naming ``where`` and the element
"""
from __future__ import annotations

import numpy as np

from fq.errors import FqError

SCALE_SUFFIXES = ("suh", "svh")
_EXP = 0x7C  # float16 exponent bits within the high (second, little-endian) byte: all ones = Inf or NaN


def nonfinite_f16(data, offset: int = 0) -> int | None:
    """Element index (from the tensor's start) of the first non-finite little-endian float16 in ``data``,
    the tensor's bytes from byte ``offset`` on; a stream's pieces may start or end mid-element, and only
    each element's high byte decides, so every piece is checked on its own."""
    a = np.frombuffer(data, dtype=np.uint8)
    first_high = 1 if offset % 2 == 0 else 0
    bad = np.flatnonzero((a[first_high::2] & _EXP) == _EXP)
    if not bad.size:
        return None
    return (offset + first_high + 2 * int(bad[0])) // 2


def check_scale(data, where: str, offset: int = 0) -> None:
    """Refuse a float16 scale tensor (or a piece of one starting at byte ``offset``) holding NaN or Inf."""
    i = nonfinite_f16(data, offset)
    if i is not None:
        raise FqError(f"{where}: element {i} is NaN or Inf; EXL3 channel scales must be finite")
