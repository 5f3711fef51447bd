"""A numpy model of fq/codec/_viterbi_cuda.cu, thread for thread (vectorized over the 1024 threads).

It mirrors the kernel's arithmetic (keys: the fused multiply-add's bits with the low K bits replaced by h,
one unsigned min) and index arithmetic -- units, lanes per edge and their shuffle merge, the predecessor
addresses, the two cost buffers (K = 1: the split low/high layout with staged registers), the value slots,
the back-pointer layouts (not where each value slot is held: registers or shared memory,
which changes no arithmetic) (the key's low byte per edge; K = 1: each thread's bits in one word), the 64-bit end key, the pass structure and
both backtracks -- so CPU-only CI can check that layout against the C kernel. It is a model: the CUDA
tests (test_codec_cuda.py, on a GPU) check the kernel itself. Keep the two in step.

Unwritten shared memory starts as NaN here, so a read before a write shows up as a wrong state.
"""
from __future__ import annotations

import numpy as np
import torch

from fq.codec.viterbi import BIG, fma_f32

L = 256
NT = 1024


class Geo:
    def __init__(self, K: int):
        self.K = K
        self.Q = 1 << K
        self.E = 65536 >> K
        E, Q = self.E, self.Q
        self.NQ = 1 if E < NT else (Q if Q < 4 else min(E // NT, 4))
        self.NU = 1 if E < NT else E // (NT * self.NQ)
        self.P = NT // E if E < NT else 1
        self.NH = Q // self.P
        assert self.NU * self.NQ * self.NH == 64
        self.LOW = 24576 if K == 1 else E
        self.STAGE_U = self.LOW // (2 * NT) if K == 1 else self.NU
        self.BP_ROW = E // 8 if K == 1 else E


def _forward(g: Geo, x: np.ndarray, v: np.ndarray, pre: np.ndarray | None):
    """One pass for tiles x (n, 256). Returns (bp (n, 256, BP_ROW) uint8, best (n,) or None)."""
    K, E, NU, NQ, NH, P = g.K, g.E, g.NU, g.NQ, g.NH, g.P
    n = x.shape[0]
    t = np.arange(NT)
    lane = t & 31
    pass2 = pre is not None
    roll = 0 if pass2 else L // 2
    bp = np.zeros((n, L, g.BP_ROW), dtype=np.uint8)
    buf0 = np.full((n, E), np.nan, dtype=np.float32)
    buf1 = np.full((n, g.LOW if K == 1 else E), np.nan, dtype=np.float32)
    p = np.arange(E)
    if pass2:
        buf0[:] = np.where(p[None, :] == pre[:, None], np.float32(0), np.float32(BIG))
    else:
        buf0[:] = 0
    rows = np.arange(n)[:, None]
    mask = np.uint32(~(g.Q - 1) & 0xFFFFFFFF)
    key = np.full((n, NT), np.iinfo(np.uint64).max, dtype=np.uint64)
    for i in range(L):
        final = (not pass2) and i == L - 1
        pos = (i + roll) & (L - 1)
        store = pass2 or (L // 2 - 1 <= i <= L - 2)
        xi = x[:, pos][:, None].astype(np.float32)
        Mc, Mn = (buf1, buf0) if i & 1 else (buf0, buf1)
        stage = {}
        bits = np.zeros((n, NT), dtype=np.uint32)
        for u in range(NU):
            w = t + NT * u
            j0 = (w // P) * NQ
            part = w % P
            # every (hq, e) candidate of the unit at once (axes: tile, hq, e, thread): each thread's candidates read
            # the cost buffers before the unit writes any, so one array op per unit is the kernel's hq/e loops
            h = part[None, :] + P * np.arange(NH)[:, None]  # (NH, NT)
            pidx = h * (E >> K) + (j0 >> K)[None, :]
            assert np.array_equal(pidx, (h * E + j0[None, :]) >> K)
            # (n, NH, NT); K = 1: the high half's second edge reads buf0
            pm = np.stack([(buf0 if K == 1 and hq == 1 and u >= 8 else Mc)[:, pidx[hq]] for hq in range(NH)], axis=1)
            val = v[(h * E)[:, None, :] + j0[None, None, :] + np.arange(NQ)[None, :, None]]  # (NH, NQ, NT)
            d = torch.from_numpy((val[None] - xi[:, :, None, None]).astype(np.float32))
            c = fma_f32(d, d, torch.from_numpy(pm[:, :, None, :])).numpy().view(np.uint32)
            c = (c & mask) | h.astype(np.uint32)[None, :, None, :]
            best = [c[:, :, e, :].min(axis=1) for e in range(NQ)]
            if P > 1:
                off = 1
                while off < P:
                    src = np.where((lane + off) < 32, t + off, t)  # __shfl_down_sync: out of range keeps own
                    best[0] = np.minimum(best[0], best[0][:, src])
                    off <<= 1
            bh = [(b & np.uint32(g.Q - 1)).astype(np.int64) for b in best]
            keys = best
            best = [b.view(np.float32) for b in best]
            # costs
            if K == 1:
                if u < g.STAGE_U:
                    for e in range(2):
                        Mn[rows, (j0 + e)[None, :]] = best[e]
                else:
                    stage[u] = (j0, best[0], best[1])
            else:
                m = part == 0
                for e in range(NQ):
                    Mn[rows, (j0 + e)[None, m]] = best[e][:, m]
            # back pointers
            if K == 1:
                for e in range(2):  # thread t's word: edge e of unit u at bit 2u + e
                    bits += (bh[e].astype(np.uint32) & 1) << np.uint32(2 * u + e)
            elif store:
                m = part == 0
                for e in range(NQ):  # the key's low byte (cost bits above the h included)
                    bp[rows, pos, (j0 + e)[None, m]] = (keys[e][:, m] & np.uint32(0xFF)).astype(np.uint8)
            if final:
                m = part == 0
                for e in range(NQ):
                    kk = ((keys[e].astype(np.uint64) << np.uint64(32))
                          | (bh[e] * E + j0 + e).astype(np.uint64))
                    key = np.where(m[None, :], np.minimum(key, kk), key)
        if K == 1 and store:
            bp[:, pos, :] = bits.view(np.uint8).reshape(n, g.BP_ROW)  # thread t writes word t
        if K == 1:
            for u, (j0, b0, b1) in stage.items():
                buf0[rows, j0[None, :]] = b0
                buf0[rows, (j0 + 1)[None, :]] = b1
    best_state = None if pass2 else (key.min(axis=1) & np.uint64(0xFFFFFFFF)).astype(np.int64)
    return bp, best_state


def _bp_get(g: Geo, row: np.ndarray, j: np.ndarray) -> np.ndarray:
    """row: (n, BP_ROW) uint8, j: (n,) -> (n,) h."""
    n = row.shape[0]
    if g.K == 1:
        words = row.view(np.uint32).reshape(n, -1)
        w = j >> 1
        word = words[np.arange(n), w & (NT - 1)]
        return ((word >> (2 * (w // NT) + (j & 1)).astype(np.uint32)) & 1).astype(np.int64)
    return (row[np.arange(n), j] & (g.Q - 1)).astype(np.int64)


def viterbi_model(x: np.ndarray, K: int, v: np.ndarray) -> np.ndarray:
    """States (n, 256) as the CUDA kernel computes them. x: (n, 256) float32; v: 65536 float32 values."""
    g = Geo(K)
    x = np.ascontiguousarray(x, dtype=np.float32)
    v = np.asarray(v, dtype=np.float32)
    bp, best = _forward(g, x, v, None)
    s = best.copy()
    for i in range(L - 1, L // 2 - 1, -1):  # back1
        pos = (i - 1 + L // 2) & (L - 1)
        j = s >> K
        s = _bp_get(g, bp[:, pos], j) * g.E + j
    pre = s & (g.E - 1)
    bp, _ = _forward(g, x, v, pre)
    out = np.empty(x.shape, dtype=np.int64)
    j = pre
    s = _bp_get(g, bp[:, L - 1], j) * g.E + j
    out[:, L - 1] = s
    for pos in range(L - 2, -1, -1):  # back2
        j = s >> K
        s = _bp_get(g, bp[:, pos], j) * g.E + j
        out[:, pos] = s
    return out
