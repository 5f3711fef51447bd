"""The three EXL3 procedural codebooks: the fp16 value of every 16-bit trellis state.

Values are computed exactly as the reference kernels compute them, fp16 roundings included:
- 3INST (cb 0): x = s*89226354 + 64248484 (mod 2^32); x = (x & 0x8fff8fff) ^ 0x3b603b60; value = lo + hi
  as an fp16 addition of the two fp16 halves of x.
- mcg (cb 1): the same lop3 on x = s*0xCBAC1FED, no additive constant.
- mul1 (cb 2): x = s*0x83DCD12D; b = sum of x's four bytes; h = fp16 bits 0x6400 + b (i.e. 1024 + b);
  value = fma(h, fp16(0x1eee), fp16(0xc931)) rounded once to fp16.
fp16 add and fma are exact in float64 (operands have 11-bit significands), so computing in float64 and
rounding once to fp16 (numpy rounds to nearest even) reproduces the hardware result bit for bit.
"""
from __future__ import annotations

import functools

import numpy as np

from fq.errors import FqError

CODEBOOKS = ("3inst", "mcg", "mul1")
# Scalar int32 marker tensor stored beside a trellis; no marker means 3INST.
MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}


def codebook_index(codebook: str) -> int:
    try:
        return CODEBOOKS.index(codebook)
    except ValueError:
        raise FqError(f"codebook: unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}") from None


def marker_value(codebook: str) -> int | None:
    """The int32 value of the marker tensor (two's complement of the uint32 multiplier), or None for 3INST."""
    codebook_index(codebook)
    m = MARKERS.get(codebook)
    return None if m is None else int(np.uint32(m).view(np.int32))


def _lop3_sum(x: np.ndarray) -> np.ndarray:
    x = (x & np.uint32(0x8FFF8FFF)) ^ np.uint32(0x3B603B60)
    halves = x.view(np.float16).reshape(-1, 2).astype(np.float64)  # little endian: [lo, hi]
    return (halves[:, 0] + halves[:, 1]).astype(np.float16)


@functools.lru_cache(maxsize=None)
def values_f16(codebook: str) -> np.ndarray:
    """fp16 value of each of the 65536 states, as a read-only array."""
    cb = codebook_index(codebook)
    s = np.arange(65536, dtype=np.uint32)
    if cb == 0:
        v = _lop3_sum(s * np.uint32(89226354) + np.uint32(64248484))
    elif cb == 1:
        v = _lop3_sum(s * np.uint32(0xCBAC1FED))
    else:
        x = s * np.uint32(0x83DCD12D)
        b = (x & 0xFF) + ((x >> 8) & 0xFF) + ((x >> 16) & 0xFF) + (x >> 24)
        h = (np.uint16(0x6400) + b.astype(np.uint16)).view(np.float16).astype(np.float64)
        k_inv = np.array([0x1EEE], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        k_bias = np.array([0xC931], dtype=np.uint16).view(np.float16).astype(np.float64)[0]
        v = (h * k_inv + k_bias).astype(np.float16)
    v.setflags(write=False)
    return v


@functools.lru_cache(maxsize=None)
def values_f32(codebook: str) -> np.ndarray:
    v = values_f16(codebook).astype(np.float32)
    v.setflags(write=False)
    return v


@functools.lru_cache(maxsize=None)
def _values_cpu(codebook: str):
    import torch

    return torch.from_numpy(values_f32(codebook).copy())


def values_torch(codebook: str, device=None):
    """float32 torch tensor of the 65536 state values (cached on the CPU; do not modify)."""
    v = _values_cpu(codebook)
    return v if device is None else v.to(device)
