"""torch's intra-op thread count, set for a block and restored after (torch imported only when used)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def torch_threads(n: int | None):
    """``n`` intra-op threads inside the block, the previous count after it; None leaves the count alone."""
    if n is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
