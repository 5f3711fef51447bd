"""CUDA tail-biting Viterbi (``_viterbi_cuda.cu``): build, load and call; the same library holds the LDL's 16x16
block factor (``chol_inv16_cuda``, fq.codec.ldl), so that a calibrated encode never waits on the host per block.

Imported only when a CUDA device is asked for, so CPU installs never need nvcc.

Why nvcc + ctypes (and not ``torch.utils.cpp_extension``): the kernel has a plain C interface (device
pointers, a stream handle), so it needs no torch headers; nvcc builds it in a few seconds instead of the
minute a torch extension takes to compile against the torch headers; the exact command is the one CI
checks on a CPU-only machine (``nvcc -arch=sm_90``), and the library does not depend on torch's C++ ABI.
The library links the CUDA runtime statically; it runs on torch's current stream and on memory torch
allocated, and selects the device itself (its runtime keeps its own current device).

The build is cached under ``$FQ_CUDA_CACHE`` (default ``~/.cache/fq/cuda``), keyed by the sha256 of the
source, the flags, the target architecture and ``nvcc --version``; it is written to a temporary name and
renamed, so concurrent jobs never load a half-written file. ``FQ_NVCC`` names the compiler (default:
``nvcc`` on PATH, then ``$CUDA_HOME/bin/nvcc``, then ``/usr/local/cuda/bin/nvcc``).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from fq.codec.codebook import values_f16
from fq.codec.packing import TILE_LEN

SOURCE = Path(__file__).with_name("_viterbi_cuda.cu")
ABI = 3
# -fmad=false is belt and braces: the kernel's float arithmetic uses __fsub_rn/__fmul_rn/__fadd_rn,
# which are never contracted into an FMA.
NVCC_FLAGS = ("-O3", "-std=c++17", "-fmad=false", "-shared", "-Xcompiler", "-fPIC", "-lineinfo")
# Back-pointer scratch per batch of tiles (bytes); 4 GiB holds 1024 tiles at K=2, 4096 at K=1.
DEFAULT_SCRATCH = 4 << 30

_lock = threading.Lock()


class CudaViterbiUnavailable(RuntimeError):
    """The CUDA kernel cannot be built or loaded here (the caller may fall back to the torch path)."""


def nvcc_path() -> str:
    env = os.environ.get("FQ_NVCC")
    if env:
        return env
    found = shutil.which("nvcc")
    if found:
        return found
    for root in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if root and Path(root, "bin", "nvcc").is_file():
            return str(Path(root, "bin", "nvcc"))
    raise CudaViterbiUnavailable("nvcc not found (set FQ_NVCC or put nvcc on PATH)")


def arch_flags(capability: tuple[int, int]) -> list[str]:
    major, minor = capability
    sm = f"{major}{minor}"
    # SASS for this GPU, plus PTX so a newer driver/GPU can still JIT it
    return [f"-gencode=arch=compute_{sm},code=sm_{sm}", f"-gencode=arch=compute_{sm},code=compute_{sm}"]


def build_command(nvcc: str, capability: tuple[int, int], out: str) -> list[str]:
    return [nvcc, *NVCC_FLAGS, *arch_flags(capability), "-o", out, str(SOURCE)]


def cache_dir() -> Path:
    base = os.environ.get("FQ_CUDA_CACHE")
    if base:
        return Path(base)
    from fq.core import cache

    return cache.root() / "cuda"


@functools.lru_cache(maxsize=None)
def _nvcc_version(nvcc: str) -> str:
    try:
        return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise CudaViterbiUnavailable(f"{nvcc} --version failed: {e}") from e


def build(capability: tuple[int, int]) -> Path:
    """Path of the compiled library for this GPU architecture, building it if needed."""
    nvcc = nvcc_path()
    key = hashlib.sha256()
    key.update(SOURCE.read_bytes())
    key.update(repr((NVCC_FLAGS, arch_flags(capability))).encode())
    key.update(_nvcc_version(nvcc).encode())
    digest = key.hexdigest()[:24]
    d = cache_dir()
    lib = d / f"fq_viterbi_sm{capability[0]}{capability[1]}_{digest}.so"
    if lib.is_file():
        return lib
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=lib.name + ".", suffix=".tmp", dir=d)
    os.close(fd)
    cmd = build_command(nvcc, capability, tmp)
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise CudaViterbiUnavailable(f"nvcc failed ({' '.join(cmd)}):\n{r.stderr[-4000:]}")
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        raise CudaViterbiUnavailable(f"nvcc could not run ({' '.join(cmd)}): {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return lib


@functools.lru_cache(maxsize=None)
def _load(capability: tuple[int, int]) -> ctypes.CDLL:
    path = build(capability)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        raise CudaViterbiUnavailable(f"cannot load {path}: {e}") from e
    lib.fq_viterbi_abi.restype = ctypes.c_int
    if lib.fq_viterbi_abi() != ABI:
        raise CudaViterbiUnavailable(f"{path}: interface version {lib.fq_viterbi_abi()}, expected {ABI}")
    lib.fq_viterbi_bp_bytes.restype = ctypes.c_longlong
    lib.fq_viterbi_bp_bytes.argtypes = [ctypes.c_int]
    lib.fq_viterbi_error_string.restype = ctypes.c_char_p
    lib.fq_viterbi_error_string.argtypes = [ctypes.c_int]
    lib.fq_viterbi_run.restype = ctypes.c_int
    lib.fq_viterbi_run.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                                   ctypes.c_void_p, ctypes.c_void_p]
    lib.fq_chol_inv16.restype = ctypes.c_int
    lib.fq_chol_inv16.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_longlong,
                                  ctypes.c_longlong, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong,
                                  ctypes.c_void_p]
    return lib


def library(device) -> ctypes.CDLL:
    """The loaded kernel library for ``device`` (built on first use); raises CudaViterbiUnavailable."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise CudaViterbiUnavailable(f"{device}: not a usable CUDA device")
    cap = torch.cuda.get_device_capability(device)
    with _lock:
        return _load(tuple(cap))


@functools.lru_cache(maxsize=None)
def _values_cached(codebook: str, device: str) -> torch.Tensor:
    v = torch.from_numpy(values_f16(codebook).view("int16").copy())
    return v.to(device)


def scratch_bytes() -> int:
    env = os.environ.get("FQ_CUDA_VITERBI_SCRATCH_MB")
    return int(env) << 20 if env else DEFAULT_SCRATCH


def batch_tiles(K: int, n: int, device, lib: ctypes.CDLL | None = None) -> int:
    """Tiles per kernel batch: as many as the back-pointer scratch holds, whole waves of SMs when n is larger."""
    lib = lib or library(device)
    per_tile = lib.fq_viterbi_bp_bytes(int(K))
    b = max(1, scratch_bytes() // per_tile)
    if n <= b:
        return max(1, n)
    sms = torch.cuda.get_device_properties(torch.device(device)).multi_processor_count
    return max(sms, b // sms * sms)


def viterbi_cuda(tiles: torch.Tensor, K: int, codebook: str, device, check: bool = True) -> torch.Tensor:
    """Best tail-biting states per tile on ``device``: (n, 256) float32 -> (n, 256) int32 (on ``device``).
    ``check``: refuse non-finite tiles (a host round trip; a caller whose tiles are finite by construction and
    that checks its own result skips it, so that its steps queue without waiting).

    Same states as the CPU kernel (fq.codec.viterbi.viterbi_cpu), bit for bit."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if not 1 <= int(K) <= 8:
        raise ValueError("K must be in 1..8")
    lib = library(device)
    x = tiles.reshape(-1, TILE_LEN).to(device=device, dtype=torch.float32).contiguous()
    n = x.shape[0]
    out = torch.empty((n, TILE_LEN), dtype=torch.int32, device=device)
    if n == 0:
        return out
    if check and not bool(torch.isfinite(x).all()):
        raise ValueError("viterbi: tiles contain NaN or Inf")
    vals = _values_cached(codebook, str(device))
    b = batch_tiles(K, n, device, lib)
    bp = torch.empty(b * lib.fq_viterbi_bp_bytes(int(K)), dtype=torch.uint8, device=device)
    best = torch.empty(b, dtype=torch.int32, device=device)
    pre = torch.empty(b, dtype=torch.int32, device=device)
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        err = lib.fq_viterbi_run(device.index, int(K), x.data_ptr(), n, vals.data_ptr(), out.data_ptr(), bp.data_ptr(),
                                 b, best.data_ptr(), pre.data_ptr(), ctypes.c_void_p(stream.cuda_stream))
    if err != 0:
        msg = "bad arguments" if err == -1 else lib.fq_viterbi_error_string(err).decode(errors="replace")
        raise RuntimeError(f"CUDA Viterbi (K={K}, {n} tiles) failed: {msg} (code {err})")
    # Everything was allocated on this stream and the kernels run on it, so the caching allocator can only
    # hand these buffers out again to later work on the same stream: no record_stream is needed.
    return out


def chol_inv16_cuda(D: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fq.codec.ldl.chol_inv16 on the GPU, bit for bit: D (B, 16, 16) float64 CUDA (any strides; its lower
    triangle is read) -> (D^-1 (B, 16, 16) float64, good (B,) bool), both on D's device, queued on the current
    stream without a host round trip."""
    if D.device.type != "cuda" or D.dtype != torch.float64 or D.dim() != 3 or tuple(D.shape[1:]) != (16, 16):
        raise ValueError(f"chol_inv16_cuda: expected a (B, 16, 16) float64 CUDA tensor, got {D.dtype} "
                         f"{tuple(D.shape)} on {D.device}")
    device = D.device
    lib = library(device)
    n = D.shape[0]
    inv = torch.empty((n, 16, 16), dtype=torch.float64, device=device)
    good = torch.empty(n, dtype=torch.int32, device=device)
    sb, sr, sc = D.stride()
    with torch.cuda.device(device):
        stream = torch.cuda.current_stream(device)
        err = lib.fq_chol_inv16(device.index, D.data_ptr(), sb, sr, sc, inv.data_ptr(), good.data_ptr(), n,
                                ctypes.c_void_p(stream.cuda_stream))
    if err != 0:
        msg = "bad arguments" if err == -1 else lib.fq_viterbi_error_string(err).decode(errors="replace")
        raise RuntimeError(f"CUDA chol_inv16 ({n} blocks) failed: {msg} (code {err})")
    return inv, good.bool()
