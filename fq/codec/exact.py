"""float64 arithmetic that gives the same bits on the CPU and on CUDA.

Elementwise IEEE operations (+, -, *, / between tensors, conversions) round the same on every device,
but reductions (torch.sum, mean, cumsum, matmul) do not: their order depends on the backend, the vector
width and the thread count. So the encoder sums only with ``tree_sum``, a pairwise tree of elementwise
adds whose order is fixed by the length alone. Two more traps: CUDA computes ``tensor / python_number``
as ``tensor * (1 / number)`` (one more rounding), the CPU divides -- ``div`` always divides; and torch's
float64 sqrt is not correctly rounded on either device (on an H200 3 of 512 channel RMS values differed
in the last bit between CPU and CUDA; on the CPU it differs from IEEE sqrt too) -- ``sqrt`` uses numpy's,
which is the hardware's IEEE sqrt, for the short per-channel vectors the encoder roots.
"""
from __future__ import annotations

import numpy as np
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
    """Correctly rounded float64 sqrt (numpy's, i.e. the CPU's IEEE instruction), returned on x's device."""
    return torch.from_numpy(np.sqrt(x.detach().to("cpu", torch.float64).numpy())).to(x.device)
