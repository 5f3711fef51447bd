"""Live tensor bytes of a piece of torch code on any device, the CPU included (where torch has no allocator
statistics and tracemalloc does not see torch's allocations): a TorchDispatchMode that counts the storage of every
tensor an operator returns until its last tracked tensor is collected. Used by the tests that pin the chunked
encoder's peak and by benchmarks/linear_encode_cost.py's CPU breakdown; not in any encode path.

    with LiveBytes("cpu") as m:
        encode_ldlq(W, H, 6)
    m.peak, m.largest, m.at_peak  # bytes; the largest single storage; the storages' sizes alive at the peak

Tensors made outside the block (its inputs) are not counted; a storage torch keeps alive with no Python tensor left
(rare) is released early. Good to a few percent against torch.cuda.max_memory_allocated, without its allocator's
rounding and caching.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device_type = torch.device(device).type
        self.live: dict[int, list] = {}  # storage data_ptr -> [nbytes, tracked tensors]
        self.current = self.peak = self.largest = 0
        self.at_peak: list[int] = []
        self.op_at_peak = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._track(t, func)
        return out

    def _track(self, t: torch.Tensor, func) -> None:
        st = t.untyped_storage()
        ptr, nbytes = st.data_ptr(), st.nbytes()
        if nbytes == 0:
            return
        entry = self.live.get(ptr)
        if entry is None:
            entry = self.live[ptr] = [nbytes, 0]
            self.current += nbytes
            self.largest = max(self.largest, nbytes)
            if self.current > self.peak:
                self.peak = self.current
                self.at_peak = sorted((e[0] for e in self.live.values()), reverse=True)
                self.op_at_peak = str(func)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr)

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[ptr]
