"""Half-integer K (1.5, 2.5, 3.5; exllamav3 1.6.5's frac_k rates, mul1 only): packing, decode, and the CPU Viterbi.

The format is checked here against a bit-by-bit model written from docs/codec.md "Half-integer K" (loops, not the
vectorized code) and against exllamav3 1.6.5's own CPU decode (its MoE runtime's decode_state_scalar, run by
benchmarks/frac_golden_cpu.py: tests/data/exl3_frac_cpu_golden.npz); exllamav3's GPU encoder, packer and kernels
need a GPU: benchmarks/frac_golden_device.py.
Optimality is tested two ways that do not share the kernel's structure: an exact float64 dynamic program over
the 65536 states (pass 2's problem: the best ring through the kernel's chosen seam node), and a brute-force
neighbourhood (every burst of up to 3 flipped ring bits away from the seam must not lower the error).
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from fq.codec import rate
from fq.codec.codebook import values_f32, values_torch
from fq.codec.packing import pack, tiles_to_matrix, unpack
from fq.codec.tensors import decode_inner, reconstruct, unrotate, validate_tensors
from fq.codec.viterbi import _trellis, viterbi
from fq.errors import FqError

pytestmark = pytest.mark.skipif(_trellis is None, reason="the C kernel is not built")
HALF = rate.HALF_KS
DATA = Path(__file__).parent / "data"


def _tiles(n, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 256, generator=g) * scale


@pytest.fixture(scope="module")
def encoded():
    x = _tiles(8, seed=1)
    return x, {K: viterbi(x, K, "mul1", threads=1) for K in HALF + (2,)}


# ---- the format, bit by bit ----

def _ring_bits(states, K):
    """Ring bits of one tile from the spec: step p appends its low D(p) bits, MSB first."""
    bits = []
    for p, s in enumerate(states):
        d = rate.ka(K) + (p & 1) if rate.is_half(K) else K
        bits += [(int(s) >> b) & 1 for b in range(d - 1, -1, -1)]
    return bits


def _words_from_bits(bits):
    """MSB-first 32-bit words stored little-endian: uint16 word 2w = the low half of uint32 w."""
    out = []
    for w in range(len(bits) // 32):
        u = 0
        for b in bits[32 * w : 32 * w + 32]:
            u = (u << 1) | b
        out += [u & 0xFFFF, u >> 16]
    return np.array(out, dtype=np.uint16).view(np.int16)


@pytest.mark.parametrize("K", HALF)
def test_pack_matches_the_spec_and_has_16k_words(encoded, K):
    x, st = encoded
    packed = pack(st[K], K)
    assert packed.shape == (8, rate.tile_words(K)) == (8, int(16 * K))
    for t in range(2):
        ring = _ring_bits(st[K][t].tolist(), K)
        assert len(ring) == 256 * K
        assert np.array_equal(packed[t].numpy(), _words_from_bits(ring))
        # state p is the 16-bit window of the ring that ends at S(p), wrapping around
        ends = np.cumsum([rate.ka(K) + (p & 1) for p in range(256)])
        for p in (0, 1, 2, 7, 128, 255):
            win = [ring[(ends[p] - 16 + b) % len(ring)] for b in range(16)]
            assert int("".join(map(str, win)), 2) == int(st[K][t, p])


@pytest.mark.parametrize("K", HALF)
def test_encode_pack_unpack_decode_round_trip(encoded, K):
    x, st = encoded
    states = st[K].reshape(2, 4, 256)
    trellis = pack(states, K)
    assert torch.equal(unpack(trellis, K), states)  # the states are a consistent ring (each window overlaps)
    want = tiles_to_matrix(values_torch("mul1")[states.long()])
    assert torch.equal(decode_inner(trellis, K, "mul1").view(torch.int32), want.view(torch.int32))


def test_random_words_unpack_then_pack_is_identity():
    for K in HALF:
        w = torch.randint(-32768, 32768, (3, 2, rate.tile_words(K)), generator=torch.Generator().manual_seed(3),
                          dtype=torch.int32).to(torch.int16)
        assert torch.equal(pack(unpack(w, K), K), w)


def test_unpack_and_pack_match_exllamav3_cpu_decode():
    g = np.load(DATA / "exl3_frac_cpu_golden.npz")
    for K in HALF:
        for tag in ("viterbi", "random"):
            packed = torch.from_numpy(g[f"k{K}_{tag}.packed"])
            ref = torch.from_numpy(g[f"k{K}_{tag}.states"].astype(np.int32))
            assert packed.shape == (6, rate.tile_words(K))
            assert torch.equal(unpack(packed, K), ref), (K, tag)
            assert torch.equal(pack(ref, K), packed), (K, tag)


# ---- quality ----

def test_mse_of_half_rates_lies_between_the_integer_rates():
    x = _tiles(48, seed=7)
    v = values_torch("mul1")
    mse = {}
    for K in (1, 1.5, 2, 2.5, 3, 3.5, 4):
        s = 1.0  # one scale for all: near every K's optimum for N(0,1) tiles (fq.codec.scale_search)
        q = v[viterbi(x * s, K, "mul1", threads=2).long()] / s
        mse[K] = float(((q - x) ** 2).mean())
    assert mse[1] > mse[1.5] > mse[2] > mse[2.5] > mse[3] > mse[3.5] > mse[4], mse
    for a, h, b in ((1, 1.5, 2), (2, 2.5, 3), (3, 3.5, 4)):  # about the geometric mean: ~3 dB per half bit
        assert 0.8 < mse[h] / (mse[a] * mse[b]) ** 0.5 < 1.25, mse


# ---- optimality ----

def _cost(x, states):
    v = values_f32("mul1").astype(np.float64)
    return float(((v[states] - x.astype(np.float64)) ** 2).sum())


def _dp_through(x, K, pre):
    """Exact (float64) minimum error over all closed rings whose node into position 0 is ``pre`` (the low
    16-D(0) bits of state 255): a plain state-indexed dynamic program, s_p = ((s_{p-1} << D(p)) | sym) & 0xFFFF."""
    v = values_f32("mul1").astype(np.float64)
    x = x.astype(np.float64)
    d = [rate.ka(K) + (p & 1) for p in range(256)] if rate.is_half(K) else [K] * 256
    s = np.arange(65536)
    cost = np.where((s >> d[0]) == pre, (v - x[0]) ** 2, np.inf)
    for p in range(1, 256):
        m = cost.reshape(1 << d[p], 65536 >> d[p]).min(axis=0)  # over the predecessors' dropped top bits
        cost = m[s >> d[p]] + (v - x[p]) ** 2
    return float(cost[(s & ((1 << (16 - d[0])) - 1)) == pre].min())


@pytest.mark.parametrize("K", HALF + (2,))  # K=2: the same check on the integer kernel (tests the test)
def test_viterbi_is_the_exact_optimum_through_its_seam(encoded, K):
    x, st = encoded
    for t in range(2):
        s = st[K][t].numpy().astype(np.int64)
        pre = int(s[255]) & ((1 << (16 - rate.ka(K))) - 1)
        best = _dp_through(x[t].numpy(), K, pre)
        got = _cost(x[t].numpy(), s)
        # no ring through pre beats the DP; the kernel's float32 keys (23-KOUT mantissa bits) may pick a
        # path within their resolution of it, never worse
        assert best <= got * (1 + 1e-12)
        assert got <= best * (1 + 1e-5), (t, got, best)


@pytest.mark.parametrize("K", HALF)
def test_no_burst_of_flipped_ring_bits_improves(encoded, K):
    x, st = encoded
    v = values_torch("mul1").double()
    nbits = 256 * K
    seam = 16 - rate.ka(K)  # the ring's last 16-KA bits are the seam node pass 2 is pinned to
    width = 3
    for t in range(2):
        packed = pack(st[K][t], K)
        ring = torch.tensor(_ring_bits(st[K][t].tolist(), K), dtype=torch.int64)
        variants = [ring]  # variant 0: unflipped, so the word assembly below is checked against pack
        for b in range(int(nbits) - seam - width + 1):
            for pat in range(1, 1 << width):
                r = ring.clone()
                for k in range(width):
                    r[b + k] ^= (pat >> (width - 1 - k)) & 1
                variants.append(r)
        R = torch.stack(variants).reshape(len(variants), -1, 32)
        u = (R * (1 << torch.arange(31, -1, -1))).sum(-1)  # MSB-first uint32 words
        words = torch.stack((u & 0xFFFF, u >> 16), -1).reshape(len(variants), -1)
        words = torch.where(words >= 32768, words - 65536, words).to(torch.int16)
        assert torch.equal(words[0], packed)
        xt = x[t].double()
        costs = ((v[unpack(words, K).long()] - xt) ** 2).sum(-1)
        base = float(((v[st[K][t].long()] - xt) ** 2).sum())
        assert float(costs.min()) >= base * (1 - 1e-5), (t, float(costs.min()), base)


# ---- determinism and ISAs ----

def test_deterministic_and_thread_independent():
    x = _tiles(6, seed=11)
    for K in HALF:
        a = viterbi(x, K, "mul1", threads=1)
        assert torch.equal(a, viterbi(x, K, "mul1", threads=2))
        assert torch.equal(a, viterbi(x.clone(), K, "mul1", threads=1))


WORKER = r"""
import importlib.util, sys, numpy as np
spec = importlib.util.spec_from_file_location("_trellis", sys.argv[1])
m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)
x = np.load(sys.argv[2]); v = np.load(sys.argv[3]); res = {}
for ka in (1, 2, 3):
    out = np.empty(x.shape, dtype=np.uint16); m.viterbi_frac(x, ka, v, out, 1); res["k%d" % ka] = out
np.savez(sys.argv[4], **res)
"""


def test_every_isa_gives_the_same_states(tmp_path):
    x = _tiles(2, seed=5).numpy()
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "v.npy", values_f32("mul1"))
    results = {}
    for isa in _trellis.isas():
        out = tmp_path / f"{isa}.npz"
        env = dict(os.environ, FQ_CPU_ISA=isa)
        subprocess.run([sys.executable, "-c", WORKER, _trellis.__file__, str(tmp_path / "x.npy"),
                        str(tmp_path / "v.npy"), str(out)], check=True, env=env)
        results[isa] = np.load(out)
    for isa, r in results.items():
        for ka in (1, 2, 3):
            want = viterbi(torch.from_numpy(x), ka + 0.5, "mul1").numpy().astype(np.uint16)
            assert np.array_equal(r[f"k{ka}"], want), (isa, ka)


# ---- errors and the tensor set ----

@pytest.mark.parametrize("K", [0, 9, 2.0, 4.5, 0.5, True, "1.5", None])
def test_bad_k_is_refused(K):
    with pytest.raises(FqError, match=r"K: expected an integer in 1\.\.8 or a half-integer rate 1\.5, 2\.5 or 3\.5"):
        rate.check_k(K)


@pytest.mark.parametrize("cb", ["mcg", "3inst"])
def test_half_k_needs_mul1(cb):
    with pytest.raises(FqError, match=rf"half-integer rate 2\.5 needs the mul1 codebook.*{cb}"):
        viterbi(_tiles(1), 2.5, cb)
    with pytest.raises(FqError, match=r"needs the mul1 codebook"):
        decode_inner(torch.zeros(8, 8, 40, dtype=torch.int16), 2.5, cb)


def _half_tensor_set(K):
    g = torch.Generator().manual_seed(2)
    w = torch.randint(-32768, 32768, (8, 16, rate.tile_words(K)), generator=g, dtype=torch.int32).to(torch.int16)
    return {"trellis": w, "suh": torch.ones(128, dtype=torch.float16), "svh": torch.ones(256, dtype=torch.float16),
            "mul1": torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)}


def test_a_tensor_set_at_half_k_validates_and_reconstructs_with_mul1_only():
    t = _half_tensor_set(1.5)
    g = validate_tensors(t, "w")
    assert (g.K, g.codebook, g.in_features, g.out_features) == (1.5, "mul1", 128, 256)
    W = reconstruct(t, "w")
    assert torch.equal(W, unrotate(decode_inner(t["trellis"], 1.5, "mul1"), t["suh"], t["svh"]))
    mcg = dict(t, mcg=torch.tensor(0xCBAC1FED - (1 << 32), dtype=torch.int32))
    del mcg["mul1"]
    with pytest.raises(FqError, match=r"last dimension 24 is not 16\*K .*half-integer rate K=1\.5 is mul1's only"):
        validate_tensors(mcg, "w")


def test_a_header_at_half_k_implies_its_rate_with_mul1_only():
    """fq.model.experts.derive_linear, which every consumer runs on fragment headers: a trellis of 24, 40 or 56 words
    is K 1.5, 2.5 or 3.5 with the mul1 marker, and refused by name with another."""
    from fq.model.experts import derive_linear

    specs = {"trellis": ("I16", (8, 16, 40)), "suh": ("F16", (128,)), "svh": ("F16", (256,)), "mul1": ("I32", ())}
    lin = derive_linear(specs, "w")
    assert (lin.K, lin.codebook, lin.in_features, lin.out_features) == (2.5, "mul1", 128, 256)
    mcg = {k: v for k, v in specs.items() if k != "mul1"} | {"mcg": ("I32", ())}
    with pytest.raises(FqError, match=r"w.trellis: last dimension 40 is the half-integer K 2.5, which is mul1's only"):
        derive_linear(mcg, "w")
    with pytest.raises(FqError, match=r"last dimension 44 is not 16\*K for K in 1..8 or a half-integer K"):
        derive_linear(dict(specs, trellis=("I16", (8, 16, 44))), "w")


@pytest.mark.parametrize("K", HALF)
def test_the_torch_frac_path_gives_the_c_kernels_states(K):
    """viterbi_torch at a half-integer K (a CUDA device's FQ_VITERBI_FRAC=device path: no CUDA frac kernel yet) is the C
    kernel's frac pass batched: the same states, bit for bit. One tile on the CPU here (the torch path is slow on a
    CPU); many on a GPU in the CUDA case below."""
    from fq.codec.viterbi import viterbi_torch

    x = _tiles(1, seed=7)
    assert torch.equal(viterbi_torch(x, K, "mul1", "cpu"), viterbi(x, K, "mul1", threads=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("K", HALF)
def test_the_torch_frac_path_on_cuda_gives_the_c_kernels_states(K, monkeypatch):
    from fq.codec.viterbi import viterbi_gpu

    monkeypatch.setenv("FQ_VITERBI_FRAC", "device")
    x = _tiles(64, seed=8)
    assert torch.equal(viterbi_gpu(x, K, "mul1", "cuda").cpu(), viterbi(x, K, "mul1"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_half_integer_k_runs_on_the_host_for_a_cuda_device_by_default(monkeypatch):
    """The default: the host's C kernel, states returned on the CUDA device, equal to the torch frac path's
    (FQ_VITERBI_FRAC=device)."""
    from fq.codec.viterbi import viterbi_gpu

    x = _tiles(16, seed=9)
    monkeypatch.setenv("FQ_VITERBI_FRAC", "device")
    want = viterbi_gpu(x, 1.5, "mul1", "cuda")
    monkeypatch.delenv("FQ_VITERBI_FRAC")
    got = viterbi_gpu(x, 1.5, "mul1", "cuda")
    assert got.device.type == "cuda" and torch.equal(got, want)
