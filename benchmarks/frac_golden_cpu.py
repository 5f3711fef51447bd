"""Writes tests/data/exl3_frac_cpu_golden.npz: exllamav3 1.6.5's own CPU decode of half-integer-K tiles, no GPU.

exllamav3's CPU MoE runtime (exllamav3_ext/cpu/moe_mul1.cpp) reads a frac tile with its scalar fallback,
``decode_state_scalar<bits, hb>`` (the 16-bit window of state t) -- the decode side, which defines the format. This
script compiles a small harness that #includes that file unchanged (against the venv's torch headers; ~2.5 min on the
2-core dev machine), feeds it packed tiles -- fq's Viterbi output (6 seeded N(0,1) tiles) and random words -- at
K = 1.5, 2.5, 3.5 (and 1, 2, 3 as a control, not stored), and stores the packed words with exllamav3's states.
tests/test_codec_frac.py checks fq's unpack and pack against them. (Its values are not stored: the CPU runtime
computes mul1 in float32, (byte sum - 510) * fp16(0x1eee), which is not the GPU's fp16 codebook that fq matches;
they differ by up to 0.0028.)

    .venv/bin/python benchmarks/frac_golden_cpu.py [--wheel DIR] [--harness BIN]
--wheel: an extracted exllamav3 package (default: extract it from .devpack/site.tar.xz into /tmp/frac-golden);
--harness: reuse a built harness binary.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import sysconfig
import tarfile
from pathlib import Path

import numpy as np
import torch

from fq.codec import rate
from fq.codec.packing import pack, unpack
from fq.codec.viterbi import viterbi

ROOT = Path(__file__).resolve().parent.parent
WORK = Path("/tmp/frac-golden")
HARNESS = r"""
#include "EXL3_EXT/cpu/moe_mul1.cpp"
#include <cstdio>
template <int bits, bool hb> static void run(const uint16_t* p, int n, uint16_t* st) {
    constexpr int ps = tile_u16(bits, hb);
    for (int i = 0; i < n; ++i)
        for (int t = 0; t < 256; ++t) st[(size_t) i * 256 + t] = decode_state_scalar<bits, hb>(p + (size_t) i * ps, t);
}
int main(int argc, char** argv) {  // bits hb ntiles in.bin out.bin
    int bits = atoi(argv[1]), hb = atoi(argv[2]), n = atoi(argv[3]);
    std::vector<uint16_t> p((size_t) n * tile_u16(bits, hb != 0)), st((size_t) n * 256);
    FILE* f = fopen(argv[4], "rb"); if (fread(p.data(), 2, p.size(), f) != p.size()) return 2; fclose(f);
    if (hb) { if (bits == 1) run<1, true>(p.data(), n, st.data());
              else if (bits == 2) run<2, true>(p.data(), n, st.data()); else run<3, true>(p.data(), n, st.data()); }
    else { if (bits == 1) run<1, false>(p.data(), n, st.data());
           else if (bits == 2) run<2, false>(p.data(), n, st.data()); else run<3, false>(p.data(), n, st.data()); }
    f = fopen(argv[5], "wb"); fwrite(st.data(), 2, st.size(), f); fclose(f);
    return 0;
}
"""


def wheel_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    dest = WORK / "site"
    if not (dest / "exllamav3").is_dir():
        dest.mkdir(parents=True, exist_ok=True)
        with tarfile.open(ROOT / ".devpack" / "site.tar.xz") as t:
            t.extractall(dest, members=[m for m in t.getmembers()
                                        if m.name.removeprefix("./").startswith("exllamav3/")])
    return dest / "exllamav3"


def build(exl3: Path) -> Path:
    src = WORK / "harness.cpp"
    src.write_text(HARNESS.replace("EXL3_EXT", str(exl3 / "exllamav3_ext")))
    ti = Path(torch.__file__).parent
    pylib = sysconfig.get_config_var("LIBDIR")
    out = WORK / "harness"
    isa = "-mavx2 -mfma -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni -mavx512vbmi -mbmi2 -mf16c".split()
    subprocess.run(["g++", "-std=c++17", "-O1", "-w", *isa, f"-I{ti}/include",
                    f"-I{ti}/include/torch/csrc/api/include", f"-I{sysconfig.get_paths()['include']}", str(src),
                    "-o", str(out), f"-L{ti}/lib", f"-L{pylib}", f"-Wl,-rpath,{ti}/lib", f"-Wl,-rpath,{pylib}",
                    "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python", f"-lpython{sysconfig.get_python_version()}",
                    "-lpthread"], check=True)
    return out


def reference_states(harness: Path, packed: torch.Tensor, K) -> np.ndarray:
    n = packed.shape[0]
    packed.numpy().astype(np.int16).tofile(WORK / "in.bin")
    subprocess.run([str(harness), str(int(K)), str(int(rate.is_half(K))), str(n), str(WORK / "in.bin"),
                    str(WORK / "st.bin")], check=True)
    return np.fromfile(WORK / "st.bin", dtype=np.uint16).reshape(n, 256)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheel")
    ap.add_argument("--harness")
    ap.add_argument("--out", default=str(ROOT / "tests" / "data" / "exl3_frac_cpu_golden.npz"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    harness = Path(args.harness) if args.harness else build(wheel_dir(args.wheel))
    n = 6
    g = torch.Generator().manual_seed(2024)
    x = torch.randn(n, 256, generator=g)
    stored, ok = {}, True
    for K in (1.5, 2.5, 3.5, 1, 2, 3):
        cases = {"viterbi": pack(viterbi(x, K, "mul1", threads=2), K),
                 "random": torch.randint(-32768, 32768, (n, rate.tile_words(K)), generator=g,
                                         dtype=torch.int32).to(torch.int16)}
        for tag, packed in cases.items():
            ref = reference_states(harness, packed, K)
            same = np.array_equal(unpack(packed, K).numpy(), ref.astype(np.int32))
            ok &= same
            print(f"K={K} {tag}: fq unpack == exllamav3 decode_state_scalar: {same}")
            if rate.is_half(K):
                stored[f"k{K}_{tag}.packed"] = packed.numpy()
                stored[f"k{K}_{tag}.states"] = ref
    np.savez_compressed(args.out, **stored)
    print("wrote", args.out)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
