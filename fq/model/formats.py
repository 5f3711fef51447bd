"""Source weight formats as published, read without a converted copy.

``source_format(config, where)`` reads ``quantization_config``:

- none: dense bf16 / fp16 / fp32 weights.
- ``quant_method: "fp8"`` with ``weight_block_size [b0, b1]`` (DeepSeek-V3/R1, Kimi-K2, MiniMax-M2, Qwen3-FP8,
  GLM-FP8): a linear's ``NAME.weight`` is float8_e4m3fn and ``NAME.weight_scale_inv`` holds one float scale per
  b0 x b1 block. A matrix is read as ``dequantize_fp8`` defines it: every fp8 value (exact in float32) times its
  block's scale as float32, one rounding. For a routed expert the block must divide the matrix (EXL3 dims are
  multiples of 128), and then this is transformers' reference (``integrations.finegrained_fp8.Fp8Dequantize`` with
  a float32 output) bit for bit. exllamav3 computes the same product before its fp16 cast (``modules/linear.py``,
  ``apply_fp8_scales_inv_``), which is how it loads the FP8 tensors a base keeps verbatim in its skeleton, partial
  128-blocks included (DeepSeek-V3's 576-row kv_a_proj_with_mqa).

- ``quant_method: "fp8"`` with ``expert_dtype: "fp4"`` (top level, as DeepSeek-V4 ships it, or inside
  ``quantization_config``, as transformers moves it and DeepSeek-V4.1 ships it): DeepSeek-V4's release. Every linear
  but the routed experts is FP8 as above, its scale grid named ``NAME.scale`` (the family says which name:
  ``Family.scale_suffix``) and stored ue8m0 (``F8_E8M0``, each byte the power of two 2^(byte - 127)); each routed
  expert matrix is ``NAME.weight`` int8 (out, in/2), two e2m1 values a byte (low nibble first), beside ``NAME.scale``
  ue8m0 (out, in/32), one scale per 32 inputs of a row (``FP4_BLOCK``). That is MXFP4's element and scale encoding
  (gpt-oss below) in a per-matrix layout: ``dequantize_fp4`` reads it through ``dequantize_mxfp4``, exactly (an e2m1
  value times a power of two): DeepSeek's own dequantization value for value (its ``convert.py`` unpacks the low
  nibble first with the same value table, +0.0 for code 8 where ``E2M1`` has -0.0; its ``fp4_gemm`` scales each 32
  inputs by one ue8m0 byte) and transformers' ``Fp8Dequantize`` with a float32 output bit for bit.
  ``expert_dtype: "fp8"`` (or none): the experts are FP8 like the other linears. A scale grid is read by its stored
  dtype (float32, bfloat16 or ue8m0), whatever ``scale_fmt`` says: DeepSeek-V3.2 states ``scale_fmt: "ue8m0"`` and
  stores float32 powers of two.

- ``quant_method: "mxfp4"`` (gpt-oss): the routed experts' fused tensors are ``NAME_blocks`` uint8 (E, out, in/32,
  16), two e2m1 values a byte (low nibble first), and ``NAME_scales`` uint8 (E, out, in/32), one e8m0 exponent
  (2^(byte - 127)) per 32 inputs; ``dequantize_mxfp4`` gives each value times its scale in float32, exactly (an e2m1
  value times a power of two), which is transformers' ``convert_moe_packed_tensors`` with a float32 output, bit for
  bit, before its transpose to (E, in, out).

Anything else (another ``quant_method``, another fp8 ``fmt``, a block size that is not two positive integers, an
``expert_dtype`` other than fp8 / fp4 or without an fp8 ``quantization_config``) is refused naming the field.

``ExpertSource``: where one routed-expert matrix comes from (shard, tensor, and for FP8 the scale tensor and
block: (1, 32) for an FP4 matrix), in the JSON an encode job receives; ``read_matrix`` reads it as float32 (torch
(out, in)), checking dtype, shape and scale grid against what the plan expects. ``dense_state`` turns a checkpoint's
tensors (FP8 and FP4 with their scales, or dense) into the float32 tensors a transformers model is built from.
"""
from __future__ import annotations

from dataclasses import dataclass

from fq.errors import FqError

DENSE = "dense"
FP8 = "fp8"
MXFP4 = "mxfp4"
FP4 = "fp4"  # SourceFormat.experts: packed e2m1 routed experts with ue8m0 scales (DeepSeek-V4's expert_dtype)
MX_GROUP = 32  # inputs per e8m0 scale
FP4_BLOCK = (1, MX_GROUP)  # an FP4 matrix's scale block: one scale per 32 inputs of a row
# the e2m1 value of each 4-bit code (bit 3 the sign); code 8 is -0.0, as transformers and exllamav3 decode it
# (DeepSeek's convert.py table has +0.0 there: the same number)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_SUFFIX = "weight_scale_inv"
FP8_DTYPE = "F8_E4M3"
SCALE_DTYPES = ("F32", "BF16", "F8_E8M0")
EXPERT_DTYPES = ("fp8", FP4)
_SUPPORTED = ("none (bf16/fp16/fp32), fp8 with weight_block_size (DeepSeek-V3 layout; with expert_dtype fp4: "
              "DeepSeek-V4's), mxfp4 (gpt-oss)")


@dataclass(frozen=True)
class SourceFormat:
    kind: str  # DENSE | FP8 | MXFP4
    block: tuple[int, int] | None = None  # FP8: (rows, cols) of one scale block
    experts: str | None = None  # FP4: the routed experts are packed e2m1 (DeepSeek-V4); None: as the other linears

    def to_json(self) -> dict:
        out = {"kind": self.kind} if self.block is None else {"kind": self.kind, "block": list(self.block)}
        return {**out, "experts": self.experts} if self.experts else out

    @property
    def expert_block(self) -> tuple[int, int] | None:
        """(rows, cols) of one scale block of a routed expert matrix: FP4's (1, 32), else the FP8 block."""
        return FP4_BLOCK if self.experts == FP4 else self.block

    @property
    def weight_bytes(self) -> float | None:
        """Bytes per weight of a routed expert matrix, its scales apart (None: the config's dtype)."""
        return 0.5 if self.experts == FP4 else {FP8: 1, MXFP4: 0.5}.get(self.kind)


def source_format(config: dict, where: str) -> SourceFormat:
    q = config.get("quantization_config")
    experts = _expert_dtype(config, q, where)
    if q is None:
        if experts is not None:
            raise FqError(f"{where}: expert_dtype {experts!r} without a quantization_config: an fp4 / fp8 expert "
                          f"dtype is read with DeepSeek's fp8 quantization_config (quant_method fp8, "
                          f"weight_block_size)")
        return SourceFormat(DENSE)
    if not isinstance(q, dict):
        raise FqError(f"{where}: quantization_config: expected an object, got {q!r}")
    method = q.get("quant_method")
    if experts is not None and method != "fp8":
        raise FqError(f"{where}: expert_dtype {experts!r} with quantization_config.quant_method {method!r}: DeepSeek's "
                      f"fp4 / fp8 experts are read beside its fp8 quantization_config")
    if method == MXFP4:
        return SourceFormat(MXFP4)
    if method != "fp8":
        raise FqError(f"{where}: quantization_config.quant_method {method!r} is not a source format fq reads; "
                      f"supported: {_SUPPORTED}")
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise FqError(f"{where}: quantization_config.fmt {fmt!r}: fq reads fp8 e4m3 weights only")
    block = q.get("weight_block_size")
    if (not isinstance(block, list) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise FqError(f"{where}: quantization_config.weight_block_size: expected [rows, cols] of one scale block "
                      f"(two positive integers; per-tensor fp8 is not read), got {block!r}")
    return SourceFormat(FP8, (block[0], block[1]), FP4 if experts == FP4 else None)


def _expert_dtype(config: dict, q, where: str) -> str | None:
    """The routed experts' dtype DeepSeek states, ``expert_dtype`` at the top level (DeepSeek-V4) or in
    ``quantization_config`` (DeepSeek-V4.1; transformers moves V4's there): "fp4", "fp8", or None when unstated.
    Two spellings present must agree."""
    found = {k: v for k, v in (("expert_dtype", config.get("expert_dtype")),
                               ("quantization_config.expert_dtype",
                                q.get("expert_dtype") if isinstance(q, dict) else None)) if v is not None}
    for key, v in found.items():
        if v not in EXPERT_DTYPES:
            raise FqError(f"{where}: {key} {v!r}: fq reads DeepSeek's routed experts as fp4 (packed e2m1, a ue8m0 "
                          f"scale per 32 inputs) or fp8 (as the other linears)")
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{k}={v!r}" for k, v in found.items())
        raise FqError(f"{where}: {shown}: both name the routed experts' dtype and must agree")
    return next(iter(found.values()), None)


def scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv``."""
    if not weight.endswith(".weight"):
        raise FqError(f"{weight}: an FP8 weight's name ends in .weight")
    return weight[: -len("weight")] + SCALE_SUFFIX


@dataclass(frozen=True)
class ExpertSource:
    """One routed-expert matrix in the staged shards: ``shard``/``tensor`` and the torch (out, in) ``shape`` the
    config gives it, plus ``scale_shard``/``scale`` and ``block`` for an FP8 matrix."""

    shard: str
    tensor: str
    shape: tuple[int, int] | None = None
    scale_shard: str | None = None
    scale: str | None = None
    block: tuple[int, int] | None = None
    # a fused 3-D tensor with the expert first (gpt-oss, Qwen3.5 as published): the expert's index, which matrix
    # of it, and how the family lays it out (fq.model.families.base.FusedExperts)
    index: int | None = None
    part: str | None = None  # "gate" / "up" (along gate_up's output) or "down"
    order: str = "in_out"  # a dense tensor's dims after the expert's: (in, out) as gpt-oss, or (out, in)
    split: str = "interleaved"  # gate and up along the output: even / odd rows, or the two halves

    def to_json(self) -> dict:
        d = {"shard": self.shard, "tensor": self.tensor}
        if self.shape is not None:
            d["shape"] = list(self.shape)
        if self.scale is not None:
            d.update(scale_shard=self.scale_shard, scale=self.scale)
            if self.block is not None:
                d["block"] = list(self.block)
        if self.index is not None:
            d.update(index=self.index, part=self.part)
            if (self.order, self.split) != ("in_out", "interleaved"):  # gpt-oss's jobs read as they always did
                d.update(order=self.order, split=self.split)
        return d

    @classmethod
    def from_json(cls, obj, where: str) -> "ExpertSource":
        if isinstance(obj, list) and len(obj) == 2 and all(isinstance(x, str) for x in obj):
            return cls(obj[0], obj[1])  # [shard, tensor]: a dense matrix
        keys = {"shard", "tensor"}
        optional = {"shape", "block", "scale_shard", "scale", "index", "part", "order", "split"}
        names = set(obj) if isinstance(obj, dict) else set()
        if (not isinstance(obj, dict) or not keys <= names <= keys | optional
                or ("scale" in names) != ("scale_shard" in names) or ("index" in names) != ("part" in names)
                or ("order" in names) != ("split" in names) or ("order" in names and "index" not in names)
                or not all(isinstance(obj[k], str) for k in names & {"shard", "tensor", "scale_shard", "scale"})
                or obj.get("part", "gate") not in ("gate", "up", "down")
                or obj.get("order", "in_out") not in ("in_out", "out_in")
                or obj.get("split", "interleaved") not in ("interleaved", "halves")
                or not isinstance(obj.get("index", 0), int) or isinstance(obj.get("index"), bool)):
            raise FqError(f"{where}: expected {{shard, tensor[, shape][, scale_shard, scale[, block]][, index, part"
                          f"[, order, split]]}}, got {obj!r}")
        pairs = {}
        for k in ("shape", "block"):
            v = obj.get(k)
            if v is not None and not (isinstance(v, list) and len(v) == 2
                                      and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in v)):
                raise FqError(f"{where}: {k}: expected two positive integers, got {v!r}")
            pairs[k] = tuple(v) if v is not None else None
        return cls(obj["shard"], obj["tensor"], pairs["shape"], obj.get("scale_shard"), obj.get("scale"),
                   pairs["block"], obj.get("index"), obj.get("part"), obj.get("order", "in_out"),
                   obj.get("split", "interleaved"))

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted({self.shard} | ({self.scale_shard} if self.scale_shard else set())))


def scale_grid(shape: tuple[int, int], block: tuple[int, int], weight: str, where: str) -> tuple[int, int]:
    """The (rows, cols) of the scale tensor of an FP8 matrix; the block must divide the matrix."""
    (rows, cols), (b0, b1) = shape, block
    if rows % b0 or cols % b1:
        raise FqError(f"{where}: tensor {weight!r} is ({rows}, {cols}); the FP8 block {b0}x{b1} "
                      f"(quantization_config.weight_block_size) does not divide it")
    return rows // b0, cols // b1


def dequantize_fp8(q, scale_inv, block: tuple[int, int] = (128, 128), where: str = "fp8"):
    """float32 (rows, cols): each e4m3 value times its ``block``'s scale as float32, one rounding. The grid must be
    the ceil grid of the blocks; a last partial block (DeepSeek-V3's kv_a_proj_with_mqa: 576 rows) takes its
    block's scale, as exllamav3 (``apply_fp8_scales_inv_``) and DeepSeek's own dequantization read it. Where the
    blocks divide the weight this is transformers' reference (``Fp8Dequantize`` with a float32 output), bit for bit;
    transformers derives the block from the grid, so it cannot read a partial block."""
    import torch

    if q.dim() != 2 or scale_inv.dim() != 2:
        raise FqError(f"{where}: expected a 2-D fp8 weight and a 2-D scale grid, got {list(q.shape)} and "
                      f"{list(scale_inv.shape)}")
    (rows, cols), (b0, b1) = q.shape, block
    grid = (-(-rows // b0), -(-cols // b1))
    if tuple(scale_inv.shape) != grid:
        raise FqError(f"{where}: weight ({rows}, {cols}) has a {tuple(scale_inv.shape)} scale grid, expected {grid} "
                      f"(one scale per {b0}x{b1} block)")
    s = scale_inv.to(torch.float32).repeat_interleave(b0, 0)[:rows].repeat_interleave(b1, 1)[:, :cols]
    return q.to(torch.float32) * s


def dequantize_fp4(packed, scales, where: str = "fp4"):
    """float32 (out, in) of an FP4 matrix as DeepSeek-V4 stores it: ``packed`` int8 (out, in/2), two e2m1 values a
    byte (low nibble first), ``scales`` float8_e8m0fnu (out, in/32), one per 32 inputs of a row. That is MXFP4's
    encoding in a per-matrix layout: the same bytes are ``dequantize_mxfp4``'s (out, in/32, 16) blocks and
    (out, in/32) exponent bytes, so each value is its e2m1 value times 2^(byte - 127), exact."""
    import torch

    if packed.dtype != torch.int8 or packed.dim() != 2 or packed.shape[1] % (MX_GROUP // 2) \
            or scales.dtype != torch.float8_e8m0fnu or tuple(scales.shape) != (packed.shape[0],
                                                                               packed.shape[1] * 2 // MX_GROUP):
        raise FqError(f"{where}: expected int8 (out, in/2) packed e2m1 and float8_e8m0fnu (out, in/32) scales, got "
                      f"{packed.dtype} {list(packed.shape)} and {scales.dtype} {list(scales.shape)}")
    exponents = scales.view(torch.uint8)
    if bool((exponents == 0xFF).any()):  # ue8m0's one non-number
        raise FqError(f"{where}: a scale is 0xFF, which ue8m0 reserves for NaN")
    blocks = packed.view(torch.uint8).reshape(packed.shape[0], -1, MX_GROUP // 2)
    return dequantize_mxfp4(blocks, exponents, where)


def dequantize_mxfp4(blocks, scales, where: str = "mxfp4"):
    """float32 (..., out, in) of MXFP4 ``blocks`` uint8 (..., out, in/32, 16) and ``scales`` uint8 (..., out, in/32):
    each e2m1 value (low nibble first) times 2^(scale - 127), exact."""
    import torch

    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8 or blocks.dim() < 2 or blocks.shape[-1] != 16 \
            or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise FqError(f"{where}: expected uint8 blocks (..., out, in/32, 16) and uint8 scales (..., out, in/32), got "
                      f"{blocks.dtype} {list(blocks.shape)} and {scales.dtype} {list(scales.shape)}")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    b = blocks.to(torch.int64)
    values = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).reshape(*blocks.shape[:-1], MX_GROUP)
    w = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1).to(torch.float32))
    return w.reshape(*blocks.shape[:-2], blocks.shape[-2] * MX_GROUP)


def _fused_part(w, part: str, split: str = "interleaved"):
    """One expert's matrix, torch (out, in), from its slice of a fused tensor in (out, in) order: gate and up are the
    even and odd rows of gate_up (``interleaved``: gpt-oss) or its first and second half (``halves``: Qwen3.5,
    transformers' ``chunk(2)``), down is the whole slice."""
    if part == "down":
        return w
    if split == "halves":
        half = w.shape[0] // 2
        return w[:half] if part == "gate" else w[half:]
    return w[0::2] if part == "gate" else w[1::2]


def read_matrix(handles: dict, src: ExpertSource, where: str):
    """One routed-expert matrix as float32 torch (out, in), its shape the one ``src`` expects. ``handles``: open
    shards by path (the caller's, so each shard opens once: its header read with fq's reader, then a safe_open
    handle)."""
    import torch
    from safetensors import safe_open

    def handle(path, tensor):
        if path not in handles:
            from pathlib import Path

            from fq.model.shards import read_header

            if not Path(path).is_file():
                raise FqError(f"{path}: source shard is not staged (its window retired and the job was forced?); "
                              f"delete the fragment instead of forcing it, so Snakemake stages the shard again")
            with open(path, "rb") as fh:  # fq's reader first: a header that lies is refused by name, not by safetensors
                names = frozenset(e.name for e in read_header(fh, str(path)).entries)
            handles[path] = (names, safe_open(path, "pt"))
        names, f = handles[path]
        if tensor not in names:
            raise FqError(f"{path}: no tensor {tensor!r} (the checkpoint index names it in this shard)")
        return f

    if src.index is not None:
        return _read_fused(handle, src)
    t = handle(src.shard, src.tensor).get_tensor(src.tensor)
    if src.scale is None:
        _check_stored_shape(t, src, tuple(src.shape) if src.shape is not None else None)
        if not t.is_floating_point() or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise FqError(f"{src.shard}: tensor {src.tensor!r} is {t.dtype}; a matrix without a {SCALE_SUFFIX} is read "
                          f"as bf16/fp16/fp32")
        return t.to(torch.float32)
    return _read_scaled(t, handle(src.scale_shard, src.scale).get_tensor(src.scale), src)


def _check_stored_shape(t, src: ExpertSource, stored: tuple[int, int] | None) -> None:
    if stored is not None and tuple(t.shape) != stored:
        packed = f", stored {list(stored)} (two e2m1 values a byte)" if stored != tuple(src.shape) else ""
        raise FqError(f"{src.shard}: tensor {src.tensor!r} is {list(t.shape)}, the config makes it "
                      f"{list(src.shape)} (out, in){packed}")


def _read_scaled(t, s, src: ExpertSource):
    """An FP8 (float8_e4m3fn) or FP4 (int8, two e2m1 values a byte: ``src.block`` (1, 32)) matrix and its scale
    grid ``s``, float32 (out, in)."""
    import torch

    fp4 = tuple(src.block) == FP4_BLOCK
    want_dtype = torch.int8 if fp4 else torch.float8_e4m3fn
    if t.dtype != want_dtype:
        what = "int8 (packed FP4: the config's expert_dtype is fp4)" if fp4 else \
            "float8_e4m3fn (the config's quantization_config is fp8)"
        raise FqError(f"{src.shard}: tensor {src.tensor!r} is {t.dtype}, expected {what} beside its scales "
                      f"{src.scale!r}")
    stored = None if src.shape is None else (src.shape[0], src.shape[1] // 2) if fp4 else tuple(src.shape)
    _check_stored_shape(t, src, stored)
    rows, cols = (t.shape[0], t.shape[1] * 2) if fp4 else tuple(t.shape)
    # the ceil grid: a non-expert linear may end in a partial block (MLA's kv_a_proj_with_mqa, 576 rows), which
    # dequantize_fp8 reads as exllamav3 does; a routed expert's blocks were checked to divide it at plan time
    want = (-(-rows // src.block[0]), -(-cols // src.block[1]))
    dtypes = (torch.float8_e8m0fnu,) if fp4 else (torch.float32, torch.bfloat16, torch.float8_e8m0fnu)
    if tuple(s.shape) != want or s.dtype not in dtypes:
        kinds = "float8_e8m0fnu (ue8m0)" if fp4 else "float32, bfloat16 or float8_e8m0fnu (ue8m0)"
        raise FqError(f"{src.scale_shard}: tensor {src.scale!r} is {s.dtype} {list(s.shape)}, expected {kinds} "
                      f"{list(want)} (one scale per {src.block[0]}x{src.block[1]} block of {src.tensor})")
    if not bool(torch.isfinite(s.to(torch.float32)).all()):  # ue8m0: byte 0xFF is NaN
        raise FqError(f"{src.scale_shard}: tensor {src.scale!r} has non-finite scales")
    where = f"{src.shard}: {src.tensor}"
    return dequantize_fp4(t, s, where) if fp4 else dequantize_fp8(t, s, src.block, where)


def _read_fused(handle, src: ExpertSource):
    """Expert ``src.index``'s slice of a fused tensor, the only bytes read (safetensors slices the first dim)."""
    import torch

    def expert_slice(shard, name):
        sl = handle(shard, name).get_slice(name)
        shape = sl.get_shape()
        if not shape or not 0 <= src.index < shape[0]:
            raise FqError(f"{shard}: tensor {name!r} is {list(shape)}; expert {src.index} is not in it")
        return sl[src.index]

    t = expert_slice(src.shard, src.tensor)
    if src.scale is not None:  # MXFP4: (out, in/32, 16) blocks beside (out, in/32) scales, (out, in) once unpacked
        w = dequantize_mxfp4(t, expert_slice(src.scale_shard, src.scale), f"{src.shard}: {src.tensor}")
    else:  # dense: the expert's (in, out) slice of transformers' (E, in, out) (gpt-oss), or its (out, in) slice
        dims = "(in, out)" if src.order == "in_out" else "(out, in)"
        if not t.is_floating_point() or t.dim() != 2 or t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise FqError(f"{src.shard}: tensor {src.tensor!r}: expert {src.index} is {t.dtype} {list(t.shape)}, "
                          f"expected a 2-D bf16/fp16/fp32 {dims} slice")
        w = t.to(torch.float32)
        w = w.T if src.order == "in_out" else w
    w = _fused_part(w, src.part, src.split).contiguous()
    if src.shape is not None and tuple(w.shape) != tuple(src.shape):
        raise FqError(f"{src.shard}: tensor {src.tensor!r}: expert {src.index}'s {src.part} is {list(w.shape)}, the "
                      f"config makes it {list(src.shape)} (out, in)")
    return w


def dense_state(tensors: dict, where: str, block: tuple[int, int] = (128, 128)) -> dict:
    """float32 tensors from a checkpoint's (or a base skeleton's) tensors: every ``X.weight`` with its scale grid
    (``X.weight_scale_inv``, or DeepSeek-V4's ``X.scale`` beside an FP8 or packed-FP4 weight) dequantized, FP8 in
    ``block``s, FP4 per 32 inputs (the scale dropped), other floats upcast, integers as they are. A base's skeleton is
    read with 128x128 blocks, the only ones exllamav3 loads."""
    import torch

    out = {}
    for name, t in tensors.items():
        if name.endswith("_blocks") and name[: -len("_blocks")] + "_scales" in tensors:
            # gpt-oss MXFP4: the fused tensor in transformers' (E, in, out) order, as its bf16 checkpoint has it
            base = name[: -len("_blocks")]
            out[base] = dequantize_mxfp4(t, tensors[base + "_scales"], f"{where}: {name}").transpose(-1, -2).contiguous()
            continue
        if name.endswith("_scales") and name[: -len("_scales")] + "_blocks" in tensors:
            continue
        if name.endswith("." + SCALE_SUFFIX):
            weight = name[: -len(SCALE_SUFFIX)] + "weight"
            if weight not in tensors:
                raise FqError(f"{where}: {name} has no {weight} to scale")
            continue
        if name.endswith(".scale") and _quantized(tensors.get(name[: -len("scale")] + "weight")):
            continue  # read with its weight
        scale = _scale_of(name, t, tensors)
        if scale is not None:
            if t.dtype not in (torch.float8_e4m3fn, torch.int8):
                raise FqError(f"{where}: {name} is {t.dtype} beside a {SCALE_SUFFIX}; expected float8_e4m3fn")
            what = f"{where}: {name}"
            out[name] = dequantize_fp4(t, scale, what) if t.dtype == torch.int8 else \
                dequantize_fp8(t, scale, block, what)
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise FqError(f"{where}: {name} is {t.dtype} without a {SCALE_SUFFIX}")
        else:
            out[name] = t.float() if t.is_floating_point() else t
    return out


def _quantized(t) -> bool:
    """An FP8 weight or DeepSeek-V4's packed FP4 (int8), which a ``.scale`` beside it scales."""
    import torch

    return t is not None and t.dtype in (torch.float8_e4m3fn, torch.int8)


def _scale_of(name: str, t, tensors: dict):
    """The scale grid of weight ``name``: its ``weight_scale_inv``, or, beside an FP8 / packed FP4 weight,
    DeepSeek-V4's ``.scale`` (a ``.scale`` elsewhere is no block grid: a norm's, say); None: unscaled."""
    if not name.endswith(".weight"):
        return None
    stem = name[: -len("weight")]
    scale = tensors.get(stem + SCALE_SUFFIX)
    return scale if scale is not None or not _quantized(t) else tensors.get(stem + "scale")


def fuse_experts(tensors: dict, layout, fused, where: str) -> dict:
    """``tensors`` with every expert's ``layout`` matrices (torch (out, in), float32) put back into the fused tensors
    a family's checkpoint has, laid out as its ``FusedExperts`` says (in the order transformers saves it,
    ``saved_order``, where it has one): what transformers loads such a checkpoint from. gpt-oss:
    ``{prefix}gate_up_proj`` (E, in, 2·I) with gate and up interleaved along the output and ``{prefix}down_proj``
    (E, I, hidden); Qwen3-VL-MoE: (E, 2·I, in), gate then up (``halves``), and (E, hidden, I), torch (out, in)."""
    import torch

    gate_up, down = fused.gate_up, fused.down
    order = fused.saved_order or fused.order
    per: dict[int, dict[int, dict[str, object]]] = {}
    out = {}
    for name, t in tensors.items():
        parsed = layout.parse(name)
        if parsed is None or parsed[3] != "weight":
            out[name] = t
            continue
        layer, expert, proj, _ = parsed
        per.setdefault(layer, {}).setdefault(expert, {})[proj] = t
    g, u, d = layout.projections
    for layer, experts in sorted(per.items()):
        n = len(experts)
        if sorted(experts) != list(range(n)) or any(set(m) != {g, u, d} for m in experts.values()):
            raise FqError(f"{where}: layer {layer}: every expert 0..{n - 1} needs its {g}, {u} and {d} to be fused")
        prefix = layout.experts_prefix(layer)
        first = experts[0]
        gu = torch.empty(n, 2 * first[g].shape[0], first[g].shape[1], dtype=first[g].dtype)  # (E, 2I, in)
        for e, m in experts.items():
            if fused.split == "halves":
                gu[e] = torch.cat([m[g], m[u]])
            else:
                gu[e, 0::2], gu[e, 1::2] = m[g], m[u]
        dn = torch.stack([experts[e][d] for e in range(n)])  # (E, hidden, I)
        if order == "in_out":
            gu, dn = gu.transpose(1, 2), dn.transpose(1, 2)
        out[prefix + gate_up] = gu.contiguous()
        out[prefix + down] = dn.contiguous()
    return out
