"""The encoder bundle identity and the determinism scope that every attestation records.

``encoder_identity(device)`` names exactly what produced the bytes: the sha256 of the fq source files
that determine a fragment's payload (``ENCODER_FILES``: the codec, its compiled CPU kernel, the CUDA
kernel's source (nvcc builds the kernel from it at first use; tests hold its states equal to the CPU
kernel's), the shard writer and the encode step), hashed as a sorted list of (relative path, sha256) so a rebuilt kernel or
an edited module is visible; the torch and CUDA versions; and the device architecture (``cpu-x86_64``,
``sm_90``). ``digest`` is the sha256 of the canonical JSON of the other fields; a campaign binds it
once and refuses any other. Code that cannot change a payload byte (CLI, report, planning, TP export,
verification) is deliberately outside the bundle: fixing it must not invalidate a paid-for campaign.

``determinism_scope()`` states what must be equal for a re-encode to be byte-identical.
"""
from __future__ import annotations

import hashlib
import importlib.util
import platform
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import fq
from fq.core.canonical import dumps, sha256_hex
from fq.errors import FqError

if TYPE_CHECKING:
    import torch

PACKAGE_ROOT = Path(fq.__file__).resolve().parent


# Every file whose content can change a fragment's bytes (globs relative to the package).
ENCODER_FILES = ("codec/*.py", "codec/*.c", "codec/*.cu", "codec/_trellis*.so", "model/shards.py",
                 "provenance/fragments.py", "model/experts.py", "workflow/encode.py",
                 "core/kbits.py")  # a fragment's K per projection: which K each matrix is encoded at, its header form


def bundle_files(root: Path = PACKAGE_ROOT) -> list[tuple[str, str]]:
    """(path relative to the package, sha256) of every file that shapes the encoder, sorted by path."""
    paths = {p for pattern in ENCODER_FILES for p in root.glob(pattern)}
    out = []
    for p in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        rel = p.relative_to(root).as_posix()
        if "__pycache__" in p.parts or not p.is_file():
            continue
        out.append((rel, hashlib.sha256(p.read_bytes()).hexdigest()))
    return out


def device_arch(device: str | torch.device | None) -> str:
    """``cpu-<machine>`` or ``sm_<major><minor>`` of a CUDA device; never guesses a device."""
    cpu = f"cpu-{platform.machine() or 'unknown'}"
    if device is None or device == "cpu":  # the CPU's needs no torch (see torch_versions)
        return cpu
    import torch  # here, not at import: checking an identity (verify, finalize) needs no torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return cpu
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise FqError(f"encoder identity: device {dev} requested but CUDA is not available")
        major, minor = torch.cuda.get_device_capability(dev)
        return f"sm_{major}{minor}"
    raise FqError(f"encoder identity: unsupported device type {dev.type!r}; expected cpu or cuda")


def torch_versions() -> tuple[str, str | None]:
    """(torch's version, the CUDA version it was built for), as ``torch.__version__`` and ``torch.version.cuda`` give
    them. Read from the installed ``torch/version.py`` (plain assignments) where torch is not imported yet: importing
    torch costs about 2 s of CPU, and the processes that only bind or check an identity on the CPU (the init job, the
    launcher's check before every campaign run) need nothing else of it. torch's own values otherwise."""
    if "torch" not in sys.modules:
        spec = importlib.util.find_spec("torch")  # locates the package without importing it
        path = Path(spec.origin).parent / "version.py" if spec and spec.origin else None
        if path is not None and path.is_file():
            ns: dict = {}
            exec(compile(path.read_text(encoding="utf-8"), str(path), "exec"), ns)  # noqa: S102 (torch's own file)
            if isinstance(ns.get("__version__"), str):
                return ns["__version__"], ns.get("cuda")
    import torch

    return str(torch.__version__), torch.version.cuda


def encoder_identity(device: str | torch.device | None = None) -> dict:
    files = bundle_files()
    torch_version, cuda = torch_versions()
    ident = {
        "fq_version": fq.__version__,
        "sources_sha256": sha256_hex(dumps([[p, h] for p, h in files])),
        "sources_count": len(files),
        "torch": torch_version,
        "cuda": cuda,
        "device_arch": device_arch(device),
    }
    ident["digest"] = sha256_hex(dumps(ident))
    return ident


def check_identity(ident: object, where: str) -> dict:
    """Recompute an identity's digest from its fields; refuses one edited after the fact."""
    if not isinstance(ident, dict) or "digest" not in ident:
        raise FqError(f"{where}: encoder identity must be an object with a digest")
    body = {k: v for k, v in ident.items() if k != "digest"}
    if sha256_hex(dumps(body)) != ident["digest"]:
        raise FqError(f"{where}: encoder identity digest does not match its fields")
    return ident


def determinism_scope() -> dict:
    return {
        "statement": ("payload bytes are a pure function of the source tensor bytes and the quant args (which, for a "
                      "calibrated encode, name the sha256 of the Hessian file it read: those bytes are an input too); a "
                      "re-encode is byte-identical when every field named in 'equal' is equal"),
        "equal": ["encoder.sources_sha256", "encoder.torch", "encoder.cuda", "encoder.device_arch",
                  "quant_args", "source tensor bytes"],
        "excluded": ["timestamps (none are written)", "host names", "file system paths"],
    }
