"""EXL3 trellis codec: bit-compatible decode, weight-only encoder, residual stages.

Public API (kept stable for the rest of fq):
    quantize(W, K, codebook="mul1", seed=0, device=None) -> {"trellis", "suh", "svh"[, "mul1"|"mcg"]}
    reconstruct(tensors) -> float32 (out, in)
    quantize_residual(W, parents, K, codebook="mul1", seed=0, device=None)
    reconstruct_chain([tensors, ...]) -> float32 (out, in)
    encode / encode_residual -> Encoded (tensors + the encoder's own reconstruction and relative MSE)
    encode_batch([W, ...], K, codebook, seeds, device, parents=None) -> [Encoded, ...] (one batched search)
    validate_tensors(tensors, name, K=None, codebook=None) -> Geometry
"""
from fq.codec.codebook import CODEBOOKS, MARKERS, marker_value
from fq.codec.encoder import Encoded, encode, encode_batch, encode_residual, quantize, quantize_residual
from fq.codec.tensors import Geometry, reconstruct, reconstruct_chain, validate_tensors

__all__ = [
    "CODEBOOKS",
    "MARKERS",
    "Encoded",
    "Geometry",
    "encode",
    "encode_batch",
    "encode_residual",
    "marker_value",
    "quantize",
    "quantize_residual",
    "reconstruct",
    "reconstruct_chain",
    "validate_tensors",
]
