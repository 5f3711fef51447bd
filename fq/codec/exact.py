"""float64 arithmetic that gives the same bits on the CPU and on CUDA.

Elementwise IEEE operations (+, -, *, / between tensors, conversions) round the same on every device,
but reductions (torch.sum, mean, cumsum, matmul) do not: their order depends on the backend, the vector
width and the thread count. So the encoder sums only with ``tree_sum``, a pairwise tree of elementwise
adds whose order is fixed by the length alone. Two more traps: CUDA computes ``tensor / python_number``
as ``tensor * (1 / number)`` (one more rounding), the CPU divides -- ``div`` always divides; and torch's
float64 sqrt on CUDA is not the CPU's correctly rounded one (3 of 512 channel RMS values differed in the
last bit on an H200) -- ``sqrt`` takes the CPU's, for the short per-channel vectors the encoder roots.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def tree_sum(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Sum along ``dim`` in float64, in a fixed pairwise order: zero-pad to a power of two, then fold the
    upper half onto the lower half (x[i] + x[i + half]) until one element is left."""
    x = x.to(torch.float64).movedim(dim, -1)
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = F.pad(x, (0, width - n))  # + 0.0 leaves every partial sum unchanged
    while width > 1:
        width //= 2
        x = x[..., :width] + x[..., width:]
    return x[..., 0]


def div(x: torch.Tensor, c: float) -> torch.Tensor:
    """x / c as a true IEEE division on every device (the divisor is a tensor on x's device)."""
    return x / torch.tensor(c, dtype=x.dtype, device=x.device)


def sqrt(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float64 sqrt (the CPU's IEEE sqrt), returned on x's device."""
    return x.to("cpu", torch.float64).sqrt().to(x.device)
