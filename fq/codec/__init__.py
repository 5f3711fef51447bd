"""EXL3 trellis codec: bit-compatible decode, weight-only encoder, residual stages.

Public API (kept stable for the rest of fq):
    quantize(W, K, codebook="mul1", seed=0, device=None) -> {"trellis", "suh", "svh"[, "mul1"|"mcg"]}
    reconstruct(tensors) -> float32 (out, in)
    quantize_residual(W, parents, K, codebook="mul1", seed=0, device=None)
    reconstruct_chain([tensors, ...]) -> float32 (out, in)
    encode / encode_residual -> Encoded (tensors + the encoder's own reconstruction and relative MSE)
    encode_batch([W, ...], K, codebook, seeds, device, parents=None) -> [Encoded, ...] (one batched search)
    encode_ldlq(W, H, K, codebook="mul1", seed=0, device=None, *, parents=None, name="W") -> Encoded (calibrated:
        LDLQ with the input Hessian H (in, in); Encoded.proxy_err = tr(E H E^T) / tr(W H W^T))
    encode_ldlq_batch([W, ...], H, K, codebook, seeds, device, *, parents=None, names=None) -> [Encoded, ...]
    proxy_error(W, W_hat, H) -> float
    validate_tensors(tensors, name, K=None, codebook=None) -> Geometry
    padded(n), padded_shape(shape) (fq.codec.shape) -> the stored dims of a matrix: multiples of 128, as exllamav3
        pads them; encode* take W (out, in) with dims multiples of 16 and store it zero-padded there;
        reconstruct(tensors, shape=(out, in)) / reconstruct_chain(chain, shape=...) trim back to W's shape
"""
from fq.codec.codebook import CODEBOOKS, MARKERS, marker_value
from fq.codec.shape import padded, padded_shape

# The torch-backed parts load on first use (PEP 562): tensor names, markers and header checks need only the
# codebook constants, and importing torch is most of the start-up time of `fq verify` or a Snakemake job.
_LAZY = {"Encoded": "scale_search", "encode": "encoder", "encode_batch": "encoder", "encode_residual": "encoder",
         "quantize": "encoder", "quantize_residual": "encoder",
         "encode_ldlq": "ldlq", "encode_ldlq_batch": "ldlq", "proxy_error": "ldlq",
         "Geometry": "tensors", "reconstruct": "tensors", "reconstruct_chain": "tensors", "validate_tensors": "tensors"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"fq.codec.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fq.codec' has no attribute {name!r}")


__all__ = [
    "CODEBOOKS",
    "MARKERS",
    "Encoded",
    "Geometry",
    "encode",
    "encode_batch",
    "encode_ldlq",
    "encode_ldlq_batch",
    "encode_residual",
    "marker_value",
    "padded",
    "padded_shape",
    "proxy_error",
    "quantize",
    "quantize_residual",
    "reconstruct",
    "reconstruct_chain",
    "validate_tensors",
]
