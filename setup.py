"""Builds fq's one native piece: the CPU trellis (Viterbi) kernel, a plain C extension with OpenMP.

Why C and not numba: the kernel is ~200 lines, compiles in about a second with the gcc every
Python install already needs, adds no runtime dependency and no JIT warm-up, and its compiled
bytes are hashed into the encoder identity (fq.provenance.identity) so a rebuilt kernel is visible.
-ffp-contract=off: the only fused multiply-add is the explicit fmaf the algorithm specifies (the CUDA and
torch paths do the same); -fno-math-errno lets fmaf compile to the FMA instruction (it never sets errno).
"""
from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "fq.codec._trellis",
            sources=["fq/codec/_trellis.c"],
            extra_compile_args=["-O3", "-fopenmp", "-ffp-contract=off", "-fno-fast-math", "-fno-math-errno", "-std=c11"],
            extra_link_args=["-fopenmp"],
        )
    ]
)
