"""The stored shape of an EXL3 matrix: its dims zero-padded up to multiples of 128, as exllamav3 pads them.

exllamav3 1.6.5's ``Linear`` (``modules/linear.py``, ``pad_to=128``) rounds ``in_features`` and ``out_features`` up to
multiples of 128, the width of the Hadamard block the trellis is coded in; its converter quantizes the zero-padded
weight, and its loader reads the EXL3 tensors at the padded dims: ``trellis`` (in128/16, out128/16, 16K), ``suh``
(in128,), ``svh`` (out128,). At run time an input narrower than ``in_features`` is zero-extended, and a linear whose
consumer wants the exact width (a routed expert's down projection, back into the residual stream) trims its output
to ``out_features_unpadded``; a gate/up output keeps its padded width, which the down projection's padded input reads
(gpt-oss: hidden = intermediate = 2880, both stored at 2944).

fq stores what exllamav3 reads: a matrix (out, in) whose dims are positive multiples of 16 (the trellis tile) is
encoded as the (padded(out), padded(in)) matrix with zeros in the new rows and columns; a 128-aligned matrix is its
own padded shape (nothing changes for it, down to the bytes). ``padded`` is the one place the padded width is
computed; the source reader, the encoder, plans and prices, the base's derived expert biases, the runtime's
reconstruct-and-trim and the geometry checks all call it. Pure integers: no torch here.

    padded(n) -> int                      # n rounded up to a multiple of PAD
    padded_shape((out, in)) -> (out, in)  # both dims
    dims_problem(n) -> str | None         # why n cannot be an encoded dim (None: it can)
"""
from __future__ import annotations

PAD = 128  # exllamav3's pad_to: the Hadamard block; every stored EXL3 dim is a multiple of it
TILE = 16  # the trellis tile: every real dim of an encoded matrix is a multiple of it


def padded(n: int) -> int:
    """``n`` rounded up to a multiple of PAD (exllamav3's ``(n + pad_to - 1) // pad_to * pad_to``)."""
    return -(-int(n) // PAD) * PAD


def padded_shape(shape) -> tuple[int, ...]:
    """The stored shape of a matrix of ``shape``: every dim ``padded``."""
    return tuple(padded(n) for n in shape)


def dims_problem(n) -> str | None:
    """Why ``n`` cannot be a dim of an encoded matrix, or None."""
    if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
        return f"{n!r} is not a positive integer"
    if n % TILE:
        return (f"{n} is not a multiple of {TILE} (fq encodes matrices whose dims are multiples of the {TILE}-wide "
                f"trellis tile, zero-padded to multiples of {PAD} as exllamav3 pads them)")
    return None
