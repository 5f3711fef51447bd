"""The CPU Viterbi kernel gives the same states on every instruction set it dispatches to.

The kernel picks its ISA once, at import: FQ_CPU_ISA (avx512, avx2, generic) or the widest the CPU runs.
Each ISA this machine runs is imported in its own subprocess with FQ_CPU_ISA set; its states on golden and
random tiles must equal the generic (portable C) path's, and on the golden tiles the digests below, which
the kernel gave before it had hand-vectorized passes (commit b712542, its AVX-512 and AVX2 clones alike).
The subprocess loads only the compiled module (no torch), so an ISA costs well under a second, except
generic (its fmaf is a libm call on x86-64: ~20 tiles/s), which gets few tiles.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CODEBOOK_NAMES
from fq.codec import viterbi as viterbi_mod
from fq.codec.codebook import values_f32

_trellis = viterbi_mod._trellis
pytestmark = pytest.mark.skipif(_trellis is None, reason="the C kernel is not built")

ISAS = ("avx512", "avx2", "generic")
GOLDEN_TILES = 2  # the first tiles of k{K}_cb{K % 3}.tiles_in

# sha256 of the uint16 states of those tiles, K = 1..8 (computed with the kernel at b712542)
GOLDEN_SHA256 = {
    1: "02767342aac5d092ff80bb80c76642e6521b493c7dfe96a3cd15bd83462e22ff",
    2: "c8db1f9956d334587f2af3aa6af94c87458387b43fc84d25b9a2480f52af2606",
    3: "f7bb4f1f188e0371a2868cb346807072275b19131d562abf05a84754f9d150e9",
    4: "5b8492907aeec966b7c53639c271b7e5682e4f2674a23a9a955a036881580581",
    5: "79838e0f99ef67151c8a145fcad61f89305ec7477b98b2bab861dd2249821f1a",
    6: "679aa7cfd7918c4003cf5cb67c1ce8fc1c0d9a1c8b6bb737f5c1c1cc3f82768a",
    7: "4a94f838b44f69465578a6b6a8ce0083fea71dcc33313b981c0c04c4b14da7dd",
    8: "db4fd1474e96d6c063d4b587b4fef0b6d01c98c8ba502e30dabed8f7ad75ea67",
}

# Runs in the subprocess: load the compiled module by path, run every case, save the states.
WORKER = r"""
import importlib.util, json, sys
import numpy as np
so, cases_path, out_path = sys.argv[1:4]
spec = importlib.util.spec_from_file_location("_trellis", so)
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
cases = np.load(cases_path)
meta = json.loads(str(cases["meta"]))
res = {}
for name, K, cb in meta:
    x = np.ascontiguousarray(cases["x_" + name])
    out = np.empty(x.shape, dtype=np.uint16)
    m.viterbi(x, K, np.ascontiguousarray(cases["v_" + cb]), out, 2)
    res[name] = out
np.savez(out_path, **res)
print(json.dumps({"isa": m.isa(), "isas": m.isas()}))
"""
LOAD = (f"import importlib.util as u; s = u.spec_from_file_location('_trellis', {_trellis.__file__!r}); "
        "m = u.module_from_spec(s); s.loader.exec_module(m)") if _trellis is not None else ""


def _run(isa, *args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "FQ_CPU_ISA"}
    if isa is not None:
        env["FQ_CPU_ISA"] = isa
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", *args], env=env, capture_output=True, text=True, timeout=300)


def _cases(golden_tiles, tiles_per_k):
    """(name, K, codebook, tiles): golden tiles, Gaussian ones (scales 0.4 and 2.5 alternating), a zero tile
    with one spike."""
    rng = np.random.default_rng(20261130)
    out = []
    for K in range(1, 9):
        cb = CODEBOOK_NAMES[K % 3]
        out.append((f"golden_k{K}", K, cb, golden_tiles[f"k{K}_cb{K % 3}.tiles_in"][:GOLDEN_TILES].numpy()))
        g = rng.standard_normal((tiles_per_k, 256)).astype(np.float32)
        g *= np.where(np.arange(tiles_per_k) % 2 == 0, 0.4, 2.5).astype(np.float32)[:, None]
        spike = np.zeros((1, 256), dtype=np.float32)
        spike[0, rng.integers(256)] = 40.0
        out.append((f"random_k{K}", K, CODEBOOK_NAMES[(K + 1) % 3], np.concatenate([g, spike])))
    return out


def _states(isa, cases, tmp_path):
    path = tmp_path / f"cases_{isa}.npz"
    arrays = {f"x_{n}": x for n, _, _, x in cases}
    arrays.update({f"v_{cb}": values_f32(cb) for cb in CODEBOOK_NAMES})
    np.savez(path, meta=np.array(json.dumps([[n, K, cb] for n, K, cb, _ in cases])), **arrays)
    out = tmp_path / f"states_{isa}.npz"
    r = _run(isa, WORKER, _trellis.__file__, str(path), str(out))
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout.strip().splitlines()[-1])
    assert info["isa"] == isa
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


@pytest.fixture(scope="module")
def generic_states(golden_tiles, tmp_path_factory):
    return _states("generic", _cases(golden_tiles, 1), tmp_path_factory.mktemp("generic"))


@pytest.mark.parametrize("isa", ISAS)
def test_isa_states_equal_generic_and_pinned(isa, golden_tiles, generic_states, tmp_path):
    if isa not in _trellis.isas():
        pytest.skip(f"this CPU cannot run {isa}")
    got = generic_states if isa == "generic" else _states(isa, _cases(golden_tiles, 1), tmp_path)
    for K in range(1, 9):
        assert hashlib.sha256(got[f"golden_k{K}"].tobytes()).hexdigest() == GOLDEN_SHA256[K], (isa, K)
    for name, states in generic_states.items():
        assert np.array_equal(got[name], states), (isa, name)


def test_vector_isas_agree_on_more_tiles(golden_tiles, tmp_path):
    fast = [i for i in ("avx512", "avx2") if i in _trellis.isas()]
    if len(fast) < 2:
        pytest.skip("needs two vector ISAs (AVX-512 and AVX2) on this CPU")
    cases = _cases(golden_tiles, 12)
    a, b = (_states(i, cases, tmp_path) for i in fast)
    for name in a:
        assert np.array_equal(a[name], b[name]), name


def test_default_isa_is_the_widest_and_reported():
    r = _run(None, LOAD + "; print(m.isa(), ','.join(m.isas()))")
    assert r.returncode == 0, r.stderr
    isa, isas = r.stdout.split()
    assert isa == isas.split(",")[0] and "generic" in isas.split(",")
    assert set(isas.split(",")) <= set(ISAS)


@pytest.mark.parametrize("value", ["sse2", "AVX2", "avx512f", "auto"])
def test_unknown_isa_is_refused(value):
    r = _run(value, LOAD)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and f"FQ_CPU_ISA={value}" in r.stderr
    assert "avx512, avx2, generic" in r.stderr


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
def test_isa_the_cpu_cannot_run_is_refused(isa):
    if isa in _trellis.isas():
        pytest.skip(f"this CPU runs {isa}")
    r = _run(isa, LOAD)
    assert r.returncode != 0
    assert "ValueError" in r.stderr and f"FQ_CPU_ISA={isa}" in r.stderr and "cannot run" in r.stderr

