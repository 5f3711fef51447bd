"""The EXL3 model config of a published base: declared derived files, recomputed byte for byte.

A published base is a directory an EXL3 runtime loads (docs/provenance.md, "Derived files"). Its
``config.json`` is the source's config plus the ``quantization_config`` block that selects EXL3 (exllamav3's
transformers integration and the vLLM EXL3 backends read ``quant_method: "exl3"``), and
``quantization_config.json`` beside it is that block plus ``tensor_storage``: every module of the base's
shards, its stored tensors (shape, bytes, dtype) and, for the EXL3-coded ones, ``quant_format`` and
``bits_per_weight`` -- the fields exllamav3's converter writes (``conversion/compile.py``,
``conversion/quant_config.py``), with fq's own values.

The source's ``config.json`` is kept verbatim as ``source_config.json`` (the digest that pins the source),
and the two files are **derived**: the base manifest names, per file, the rule and the inputs (with their
sha256), and every consumer of the manifest recomputes them (``check_derived``). Rules:

``fq-exl3-config/1`` -> ``config.json`` from ``source_config.json`` and params ``{bits, codebook}``:
    the source config parsed (fq's strict JSON loader; an object whose ``quantization_config``, if any, is a source
    format fq reads: ``fq.model.formats``, FP8 with block scales), with ``quantization_config`` set to
    ``quantization_block(bits, codebook)`` and, where the family's exllamav3 class reads a key under another
    spelling than the source's (``fq.model.families``: ``Exl3Needs.aliases``, e.g. Qwen3-MoE's ``num_experts``
    when transformers 5.x saved ``num_local_experts``), that key stated with the source's value, and where it reads
    with no default a key that transformers' config class computes when absent (``Exl3Needs.computed``: GLM-5's
    ``indexer_types``), that key stated as transformers computes it; nothing else changes (``tie_word_embeddings`` keeps the source's
    value: fq leaves lm_head and the embeddings as they are, where the converter writes a separate lm_head and
    unties them). Written as ``fq.core.canonical.pretty`` (sorted keys, indent 2, trailing newline).
``fq-exl3-quantization-config/1`` -> ``quantization_config.json`` from every ``*.safetensors`` of the base
    (its top level, sorted; the files exllamav3's loader globs) and the same params: ``quantization_block`` plus
    ``tensor_storage``, one entry per module (a tensor ``A.B.C`` belongs to module ``A.B``, the key a loader
    looks up as ``KEY.trellis`` / ``KEY.weight``), each ``{"stored_tensors": {name: {"shape", "n_bytes",
    "dtype"}}}`` with the dtype as torch names it (``torch.bfloat16``, exllamav3's spelling); a module with a
    ``trellis`` is EXL3 and adds ``quant_format: "exl3"``, ``bits_per_weight`` (trellis last dim / 16) and
    ``mul1_multiplier`` / ``mcg_multiplier`` (the marker's value as uint32), as the converter does. Modules fq
    keeps 16-bit carry ``stored_tensors`` only, as the converter writes them (loaders test ``quant_format ==
    "exl3"``). Every EXL3 module must have K = ``bits`` and the ``codebook``'s marker (value checked), so the
    params are the tensors' own. Written as canonical JSON (``fq.core.canonical.dumps``: sorted keys, no
    whitespace) and a final newline: a GLM-5 base lists 57,600 expert modules, about 19 MB this way (the
    pretty form would be 50 MB).

``fq-exl3-expert-bias/1`` -> ``expert_bias.safetensors``, only in a base whose skeleton keeps fused expert biases
    (gpt-oss: ``{P}.experts.gate_up_proj_bias`` [E, 2I], gate and up interleaved, and ``{P}.experts.down_proj_bias``
    [E, H]), from every other top-level ``*.safetensors`` of the base and the same params: per layer and expert
    ``{P}.experts.{e}.gate_proj.bias`` (the fused bias's even columns), ``.up_proj.bias`` (odd) and
    ``.down_proj.bias``, float16 (exllamav3's runtime dtype for biases: rounded as its own loader rounds the fused
    ones; a value beyond float16's range is refused), where exllamav3 1.6.5's gpt-oss class reads an EXL3 expert's
    bias (``{key}.bias`` beside its trellis), each zero-padded to its linear's stored output width
    (``fq.codec.shape.padded``: gpt-oss's 2880 -> 2944; a 128-aligned width is unchanged, so are its bytes): exllamav3
    loads an EXL3 linear's bias as stored (``Linear.load_exl3``; only its fp16 path pads a bias) and adds it to the
    padded output, and its fused decode kernels read a padded width per expert. Layers in order, experts in order,
    gate/up/down; metadata
    ``{"format": "fq-exl3-expert-bias/1"}``. The fused tensors stay in the skeleton as published (fq's runtime
    and transformers read those). It is listed among the files ``quantization_config.json`` is derived from, so
    it is derived first.
``fq-exl3-tensor-aliases/1`` -> ``tensor_aliases.safetensors``, only in a base whose family's exllamav3 class reads a
    tensor under another name than the family's checkpoints store it (``Exl3Needs.tensor_aliases``: MiniMax-M2's
    router score bias, stored at ``{layer}.block_sparse_moe.e_score_correction_bias``, which exllamav3 1.6.5 looks
    up only at ``{layer}.block_sparse_moe.gate.e_score_correction_bias``), from ``source_config.json`` (the family)
    and every other top-level ``*.safetensors`` of the base and the same params: each such tensor of the shards,
    its dtype, shape and bytes verbatim, under the name exllamav3 reads; layers in order, then the family's aliases
    in order; metadata ``{"format": "fq-exl3-tensor-aliases/1"}``. A skeleton that already holds a target name
    with the same bytes needs no copy of it; with other bytes it is refused (exllamav3 and transformers would read
    different tensors). Derived after ``expert_bias.safetensors``, before ``quantization_config.json``.

Both tensor files are one machinery (``TensorRule``): inputs are the shards no such rule derives, the output is
refused when it would hold a name an input holds (exllamav3's loader globs ``*.safetensors`` in directory order and
keeps, of a key in two files, the one it reads last: a derived file never shadows a tensor of the base) or when it
derives nothing, and a base whose inputs need the file and whose manifest declares none is refused by every
consumer (``needed``).

The block (``quantization_block``), and why each value is fq's true one:

- ``bits``: the base's K, the bits per weight of every EXL3-coded tensor (the routed experts); what fq does
  not code is 16-bit, module by module in ``tensor_storage``.
- ``head_bits``: 16, the converter's value for an lm_head stored unquantized (``--head_bits 16``): fq never
  quantizes lm_head.
- ``calibration``: ``{"rows": R, "cols": C}``, the converter's fields: the calibration rows (token sequences) and
  columns (tokens per row) the base's LDLQ Hessians were captured from (config ``calibration: {rows, columns}``,
  the ``calibration`` param of both rules); ``{"rows": 0, "cols": 0}`` for a weight-only base (no Hessian, no
  calibration data, and the param absent). Loaders treat it as informational (exllamav3's ``Exl3Config``:
  "everything but quant_method is informational").
- ``out_scales``: ``"always"``: fq's regularization always applies the output-channel RMS scales
  (``fq.codec.regularize``), the converter's ``apply_out_scales = True``.
- ``codebook``: the base's codebook, ``3inst`` / ``mcg`` / ``mul1``, which is exllamav3's spelling
  (``--codebook``); loaders pick the marker tensor they expect from it.
- ``version``: ``VERSION`` = ``1.6.5+fq.exl3config.1``: the public part is the exllamav3 release whose tensor
  format and loader fq's bases are written for (docs: ../shared/EXL3-RUNTIME.md), the local label says fq's
  rule wrote it, not that release's converter (a PEP 440 version, so a loader that parses it still can).

    quantization_block(bits, codebook, calibration=None) -> dict
    derive_config(source_bytes, bits, codebook, where, calibration=None) -> bytes
    derive_quantization_config(base_dir, shards, bits, codebook, calibration=None) -> bytes
    derive_expert_bias(base_dir, shards) -> bytes              # gpt-oss: per-expert biases for exllamav3
    derive_tensor_aliases(base_dir, inputs) -> bytes           # MiniMax-M2: the router bias under exllamav3's name
    needed_tensor_files(base_dir, listed) -> [name]            # the derived tensor files a base must declare
    write_derived(base_dir, *, bits, codebook, calibration=None) -> [spec]   # producer: writes them, returns the specs
    rule_inputs(rule, listed_names) -> [name]               # what a rule derives from, in order
    check_derived(base_dir, entry, where) -> problem | None  # consumer: recompute one declared file
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from fq.codec.codebook import CODEBOOKS, MARKERS
from fq.core import atomic, canonical, kbits
from fq.core.safepath import open_regular
from fq.core.targets import EXLLAMAV3
from fq.errors import FqError
from fq.model import families
from fq.model.experts import LANGUAGE_MODEL, MIXTRAL, STANDARD
from fq.model.formats import source_format
from fq.model.shards import DTYPES, read_header

SOURCE_CONFIG = "source_config.json"
CONFIG = "config.json"
QUANTIZATION_CONFIG = "quantization_config.json"
RULE_CONFIG = "fq-exl3-config/1"
RULE_QUANTIZATION_CONFIG = "fq-exl3-quantization-config/1"
EXPERT_BIAS = "expert_bias.safetensors"
RULE_EXPERT_BIAS = "fq-exl3-expert-bias/1"
MAX_EXPERT_BIAS_BYTES = 1 << 30  # gpt-oss-120b's: 36 layers x 128 experts x 8640 float16 = 80 MB
TENSOR_ALIASES = "tensor_aliases.safetensors"
RULE_TENSOR_ALIASES = "fq-exl3-tensor-aliases/1"
MAX_TENSOR_ALIASES_BYTES = 1 << 24  # MiniMax-M2's: 62 layers x 256 float32 router biases = 64 KB
TENSOR_OUTPUTS = (EXPERT_BIAS, TENSOR_ALIASES)  # the derived safetensors files (TensorRule), never a rule's input
VERSION = f"{EXLLAMAV3}+fq.exl3config.1"  # a label in every published config: it names the rule, not the module path
HEAD_BITS = 16
MAX_DERIVED_BYTES = canonical.MAX_JSON_BYTES  # a file fq would derive larger than this is refused


WEIGHT_ONLY = {"rows": 0, "cols": 0}  # the calibration block of a base encoded without Hessians


def rule_params(bits: int, codebook: str, calibration: dict | None = None, where: str = "derived files", *,
                linears: dict | None = None, model_bits: float | None = None) -> dict:
    """The params both rules take, checked: ``calibration`` (``{"rows", "cols"}`` of a calibrated base's
    Hessians) only for a calibrated base, None for a weight-only one; ``linears`` ({class: K} of the non-expert
    classes a whole-model base quantizes) only for a whole-model base; ``model_bits`` (the base's bits per weight
    over every linear but the head, ``storage_bits``) for every base fq now publishes (required with ``linears``;
    absent in the derived files of earlier campaigns, whose ``bits`` is K)."""
    params = {"bits": bits, "codebook": codebook, **({"calibration": dict(calibration)} if calibration is not None else {})}
    if linears:
        params["linears"] = dict(linears)
    if linears or model_bits is not None:
        params["model_bits"] = model_bits
    _check_params(params, where)
    return params


def quantization_block(bits: int, codebook: str, calibration: dict | None = None, *, linears: dict | None = None,
                       model_bits: float | None = None) -> dict:
    """The ``quantization_config`` of a base whose routed experts are EXL3 at K=``bits`` (module docstring);
    ``calibration``: ``{"rows", "cols"}`` of a calibrated base's Hessians, None for a weight-only one. With
    ``model_bits`` it states ``bits`` over the whole model, as exllamav3's converter does, and ``expert_bits`` K; a
    whole-model base (``linears``) also ``head_bits`` and ``linear_bits`` (its quantized classes)."""
    rule_params(bits, codebook, calibration, "quantization_config", linears=linears, model_bits=model_bits)
    block = {"quant_method": "exl3", "version": VERSION, "bits": bits, "head_bits": HEAD_BITS,
             "calibration": dict(calibration or WEIGHT_ONLY), "out_scales": "always", "codebook": codebook}
    if model_bits is not None:
        block.update(bits=model_bits, expert_bits=bits)
    if linears:
        head = linears.get("head", HEAD_BITS)
        block.update(head_bits=head["head"] if isinstance(head, dict) else head, linear_bits=dict(linears))
    return block


def _class_of(module: str) -> str:
    """The class of an EXL3 module of a base, from its name: routed expert, or a non-expert class
    (fq.model.linears; the head is ``lm_head``)."""
    if re.search(r"\.experts\.\d+\.", module + "."):
        return "expert"
    if module == "lm_head":
        return "head"
    if ".self_attn." in module:
        return "attention"
    if ".shared_expert" in module:
        return "shared"
    return "dense"


# a routed expert module's projection name -> fq.core.kbits' canonical projection, from the layouts fq writes
_PROJECTION = {name: p for layout in (STANDARD, MIXTRAL, LANGUAGE_MODEL)
               for name, p in zip(layout.projections, kbits.PROJECTIONS)}
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _want_K(key: str, cls: str, bits, linears: dict | None, where: str):
    """The K a base's params give EXL3 module ``key`` of class ``cls``: ``bits`` (a fq.core.kbits node spec as JSON:
    K, or per layer K or {gate, up, down: K}) for a routed expert, its class's entry of ``linears`` (K, or per layer
    {"<layer>"|"head": K}) otherwise; None where the params quantize no such module."""
    m = _LAYER.search(key)
    layer = int(m.group(1)) if m else None
    if cls == "expert":
        spec = kbits.node(bits, "bits")
        if kbits.is_one(spec):
            return spec
        proj = _PROJECTION.get(key.rsplit(".", 1)[-1])
        if layer is None or proj is None:
            raise FqError(f"{where}: a routed-expert module fq cannot place in a layer and projection")
        return kbits.proj(kbits.at_layer(spec, layer, "bits"), proj)
    want = (linears or {}).get(cls)
    if isinstance(want, dict):
        return want.get("head" if layer is None else str(layer))
    return want


def storage_bits(modules: dict) -> float:
    """Bits per weight over every linear of a base but the embeddings and the head: 8 x the bytes of their stored
    tensors (EXL3: trellis, scales and marker; 16-bit or FP8: weight and scales) over their weights, rounded to 4
    decimals. Linears: EXL3 modules, and 2-D ``.weight`` tensors of modules other than the embeddings, the head and
    the routers (``.gate``, ``.router``)."""
    n_bytes = n_weights = 0
    for key, entry in modules.items():
        stored = entry["stored_tensors"]
        if key == "lm_head" or key.endswith(("embed_tokens", ".gate", ".router")):
            continue
        if f"{key}.trellis" in stored:
            rows, cols, _ = stored[f"{key}.trellis"]["shape"]
            n_weights += rows * 16 * cols * 16
        elif len(stored.get(f"{key}.weight", {}).get("shape", ())) == 2:
            o, i = stored[f"{key}.weight"]["shape"]
            n_weights += o * i
        else:
            continue
        n_bytes += sum(t["n_bytes"] for name, t in stored.items() if not name.endswith(".bias"))
    return round(8 * n_bytes / n_weights, 4) if n_weights else 0.0


def _one_k(k) -> bool:
    """An integer K 1..8 or a half-integer 1.5, 2.5, 3.5 (fq.core.kbits), not a bool nor 2.0."""
    return kbits.is_one(k) and (type(k) is int and 1 <= k <= 8 or type(k) is float and k in kbits.HALF_KS)


def _check_params(params: dict, where: str) -> None:
    bits, codebook = params.get("bits"), params.get("codebook")
    if isinstance(bits, dict):  # a budgeted base: K per layer (and projection) of its routed experts
        if not bits or not all(isinstance(k, str) and k.isdigit() for k in bits):
            raise FqError(f"{where}: bits {bits!r}: expected an integer K in 1..8, or K per layer "
                          "{\"<layer>\": K or {gate, up, down: K}}")
        kbits.node(bits, f"{where}: bits")
    elif not _one_k(bits):
        raise FqError(f"{where}: bits {bits!r}: expected an integer K in 1..8 or a half-integer K 1.5, 2.5, 3.5")
    if codebook not in CODEBOOKS:
        raise FqError(f"{where}: codebook {codebook!r}: expected one of {', '.join(CODEBOOKS)}")
    extra = sorted(set(params) - {"bits", "codebook", "calibration", "linears", "model_bits"})
    if extra:
        raise FqError(f"{where}: unknown param(s) {', '.join(extra)}; expected bits, codebook and, for a calibrated "
                      "base, calibration; model_bits; for a whole-model base, linears")
    if "linears" in params and "model_bits" not in params:
        raise FqError(f"{where}: linears without model_bits: a whole-model base states its bits over the model")
    if "linears" in params:
        lin = params["linears"]
        classes = ("attention", "shared", "dense", "head")
        ok = _one_k

        def ok_class(cls, v):  # K, or (a budgeted base) K per layer: {"<layer>": K}, the head's {"head": K}
            if isinstance(v, dict):
                keys_ok = all((k == "head") if cls == "head" else (isinstance(k, str) and k.isdigit()) for k in v)
                return bool(v) and keys_ok and all(ok(k) for k in v.values())
            return ok(v)

        if not isinstance(lin, dict) or not lin or not set(lin) <= set(classes) or not all(
                ok_class(c, v) for c, v in lin.items()):
            raise FqError(f"{where}: linears {lin!r}: expected {{class: K}} (a budgeted base: K per layer "
                          f"{{\"<layer>\": K}}), classes among {', '.join(classes)}, K in 1..8 or 1.5, 2.5, 3.5")
    if "model_bits" in params:
        mb = params["model_bits"]
        if isinstance(mb, bool) or not isinstance(mb, (int, float)) or not 0 < mb <= 32:
            raise FqError(f"{where}: model_bits {mb!r}: expected a positive number of bits per weight")
    if "calibration" in params:
        cal = params["calibration"]
        if not isinstance(cal, dict) or set(cal) != {"rows", "cols"} or not all(
                type(cal[k]) is int and cal[k] >= 1 for k in ("rows", "cols")):
            raise FqError(f"{where}: calibration {cal!r}: expected {{\"rows\": R, \"cols\": C}}, two positive "
                          "integers (a weight-only base has no calibration param)")


def derive_config(source: bytes, bits: int, codebook: str, where: str = SOURCE_CONFIG,
                  calibration: dict | None = None, *, linears: dict | None = None,
                  model_bits: float | None = None) -> bytes:
    """``config.json`` of a base (rule ``fq-exl3-config/1``) from the source config's bytes."""
    cfg = canonical.loads(source, where)
    if not isinstance(cfg, dict):
        raise FqError(f"{where}: expected a JSON object (a model config)")
    # A source format fq reads (FP8 with block scales) is replaced: the skeleton keeps its FP8 tensors and their
    # scales verbatim, which EXL3 loaders dequantize per tensor; the block names how the experts are stored now.
    source_format(cfg, where)
    # keys the family's exllamav3 class reads under another spelling than the source's (Qwen3-MoE saved by
    # transformers 5.x: num_local_experts, exllamav3 reads num_experts), stated from the source's own value
    family = families.for_config(cfg, where)
    stated = family.exl3_needs.derived_keys(family.text_view(cfg, where))
    if family.text_config is not None and stated:  # a vision-language wrapper: exllamav3 reads them in text_config
        cfg, stated = {**cfg, family.text_config: {**cfg[family.text_config], **stated}}, {}
    block = quantization_block(bits, codebook, calibration, linears=linears, model_bits=model_bits)
    return canonical.pretty({**cfg, **stated, "quantization_config": block}).encode()


def _torch_dtype(dtype: str) -> str:
    return f"torch.{DTYPES[dtype][1]}"


def _module(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0] if "." in tensor else tensor


def tensor_storage(base_dir: str | os.PathLike, shards: list[str], bits: int, codebook: str,
                   linears: dict | None = None) -> dict:
    """module -> its entry, from the headers of ``shards`` (and the 4 bytes of each codebook marker). Every EXL3
    module is at K=``bits`` (a routed expert) or at its class's K in ``linears`` (a whole-model base)."""
    base_dir = Path(base_dir)
    modules: dict[str, dict] = {}
    owner: dict[str, str] = {}  # tensor -> shard holding it
    markers: dict[str, int] = {}  # marker tensor -> its value as uint32
    for shard in shards:
        where = f"{base_dir}/{shard}"
        with open_regular(base_dir, shard, where) as fh:
            header = read_header(fh, where)
            for e in header.entries:
                if e.name in owner:
                    raise FqError(f"{where}: tensor {e.name} is also stored in {owner[e.name]}; a loader would "
                                  "take one of the two")
                owner[e.name] = shard
                entry = modules.setdefault(_module(e.name), {"stored_tensors": {}})
                entry["stored_tensors"][e.name] = {"shape": list(e.shape), "n_bytes": e.length,
                                                   "dtype": _torch_dtype(e.dtype)}
                if e.name.rsplit(".", 1)[-1] in MARKERS and e.dtype == "I32" and e.shape == ():
                    fh.seek(e.start)
                    markers[e.name] = int.from_bytes(fh.read(4), "little")
    want_marker = MARKERS.get(codebook)
    exl3 = 0
    for key, entry in sorted(modules.items()):
        stored = entry["stored_tensors"]
        trellis = stored.get(f"{key}.trellis")
        if trellis is None:
            continue
        exl3 += 1
        where = f"{base_dir}/{owner[f'{key}.trellis']}: {key}"
        shape = trellis["shape"]
        half = len(shape) == 3 and shape[-1] / 16 in kbits.HALF_KS
        if trellis["dtype"] != "torch.int16" or len(shape) != 3 or (shape[-1] % 16 and not half):
            raise FqError(f"{where}.trellis: {trellis['dtype']} {shape}, an EXL3 trellis is int16 (in/16, out/16, 16*K)")
        K = shape[-1] / 16 if half else shape[-1] // 16  # as exllamav3's converter: 1.5, 2.5, 3.5 stay floats
        cls = _class_of(key)
        want = _want_K(key, cls, bits, linears, where)
        if want is None:
            raise FqError(f"{where}: an EXL3 {cls} module; this base's quantization_config quantizes routed experts "
                          f"only{' and ' + ', '.join(linears) if linears else ''}")
        if K != want:
            what = "bits" if cls == "expert" else f"linear_bits.{cls}"
            raise FqError(f"{where}: an EXL3 module at K={K}; this base's quantization_config says {what} {want}")
        entry["quant_format"] = "exl3"
        entry["bits_per_weight"] = K
        present = [cb for cb in MARKERS if f"{key}.{cb}" in stored]
        got = present[0] if len(present) == 1 else "3inst" if not present else "+".join(present)
        if got != codebook:
            raise FqError(f"{where}: codebook marker {got!r}; this base's quantization_config says {codebook!r}")
        if want_marker is not None:
            value = markers.get(f"{key}.{codebook}")
            if value != want_marker:
                raise FqError(f"{where}.{codebook}: marker value {value!r}, the {codebook} codebook's is {want_marker}")
            entry[f"{codebook}_multiplier"] = value
    if not exl3:
        raise FqError(f"{base_dir}: no EXL3 tensors (no module with a trellis) in {len(shards)} shard(s)")
    return modules


def derive_quantization_config(base_dir: str | os.PathLike, shards: list[str], bits: int, codebook: str,
                               calibration: dict | None = None, *, linears: dict | None = None,
                               model_bits: float | None = None) -> bytes:
    """``quantization_config.json`` of a base (rule ``fq-exl3-quantization-config/1``). A whole-model base's
    ``model_bits``, where given, must be what its shards hold (``storage_bits`` of the tensor storage)."""
    storage = tensor_storage(base_dir, shards, bits, codebook, linears)
    if model_bits is not None:
        got = storage_bits(storage)
        if got != model_bits:
            raise FqError(f"{base_dir}: the shards hold {got} bits per weight over the model's linears, the params "
                          f"say model_bits {model_bits}")
    doc = {**quantization_block(bits, codebook, calibration, linears=linears, model_bits=model_bits),
           "tensor_storage": storage}
    return canonical.dumps(doc) + b"\n"


@dataclass(frozen=True)
class Rule:
    output: str
    max_bytes: int = MAX_DERIVED_BYTES  # a file at this name larger than this is refused unread
    json: bool = True  # the output is JSON (a mismatch is explained field by field)

    def inputs(self, listed: list[str]) -> list[str]:
        raise NotImplementedError

    def derive(self, base_dir: Path, inputs: list[str], params: dict) -> bytes:
        raise NotImplementedError


class _ConfigRule(Rule):
    def inputs(self, listed):
        return [SOURCE_CONFIG]

    def derive(self, base_dir, inputs, params):
        where = f"{base_dir}/{SOURCE_CONFIG}"
        with open_regular(base_dir, SOURCE_CONFIG, where) as fh:
            data = fh.read(MAX_DERIVED_BYTES + 1)
        _check_params(params, f"{where}: rule {RULE_CONFIG} params")
        return derive_config(data, params["bits"], params["codebook"], where, params.get("calibration"),
                             linears=params.get("linears"), model_bits=params.get("model_bits"))


class _QuantizationConfigRule(Rule):
    def inputs(self, listed):
        return sorted(n for n in listed if n.endswith(".safetensors") and "/" not in n)

    def derive(self, base_dir, inputs, params):
        _check_params(params, f"{base_dir}/{QUANTIZATION_CONFIG}: rule {RULE_QUANTIZATION_CONFIG} params")
        return derive_quantization_config(base_dir, inputs, params["bits"], params["codebook"], params.get("calibration"),
                                          linears=params.get("linears"), model_bits=params.get("model_bits"))


# -- derived tensor files: tensors exllamav3 1.6.5 reads under another name (or form) than the skeleton's ---------

def _headers(base_dir: Path, shards: list[str]) -> dict:
    """tensor name -> (shard, header entry) of the base's ``shards`` (headers only); a name in two shards is refused
    (a loader would take one of the two)."""
    found: dict = {}
    for shard in shards:
        where = f"{base_dir}/{shard}"
        with open_regular(base_dir, shard, where) as fh:
            for e in read_header(fh, where).entries:
                if e.name in found:
                    raise FqError(f"{where}: tensor {e.name} is also stored in {found[e.name][0]}; a loader would take "
                                  "one of the two")
                found[e.name] = (shard, e)
    return found


def _payload(base_dir: Path, shard: str, e, where: str) -> bytes:
    with open_regular(base_dir, shard, where) as fh:
        fh.seek(e.start)
        data = fh.read(e.length)
    if len(data) != e.length:
        raise FqError(f"{where}: truncated ({len(data)} of {e.length} bytes)")
    return data


class TensorRule(Rule):
    """A derived safetensors file of tensors exllamav3 1.6.5 reads under another name (or in another form) than the
    base's skeleton stores them: the one machinery of ``expert_bias.safetensors`` and ``tensor_aliases.safetensors``.

    Inputs: every top-level ``*.safetensors`` of the base that no such rule derives, sorted (and, for a rule that
    reads the family, ``source_config.json`` first). Output: the tensors ``tensors`` gives, in its order, as one
    safetensors file with metadata ``{"format": RULE}``; refused when it derives nothing (a base that needs no such
    file declares none), and when a tensor it derives is also in an input (exllamav3's loader globs
    ``*.safetensors`` in directory order and keeps, of a key in two files, the one it reads last: the derived file
    must never hold a name the skeleton or a fragment has). ``needed``: whether a base of these inputs must declare
    the file (a manifest that leaves it out is refused: an EXL3 runtime would misread the base)."""

    rule = ""  # the rule's name
    reads_config = False  # the family (source_config.json) says what is derived
    nothing = missing = consequence = ""  # messages: derives nothing; needed and undeclared (what, and what follows)

    def inputs(self, listed):
        shards = sorted(n for n in listed if n.endswith(".safetensors") and "/" not in n and n not in TENSOR_OUTPUTS)
        return ([SOURCE_CONFIG] if self.reads_config else []) + shards

    def tensors(self, base_dir: Path, config: dict | None, headers: dict) -> list:
        """[RawTensor] this rule derives from the inputs' headers (name -> (shard, entry))."""
        raise NotImplementedError

    def applies(self, base_dir: Path, config: dict) -> bool:
        """Whether the family (``reads_config``) can need this file at all (else no shard is opened)."""
        return True

    def _derive_tensors(self, base_dir: Path, inputs: list[str]) -> list:
        config = None
        if self.reads_config:
            if not inputs or inputs[0] != SOURCE_CONFIG:
                raise FqError(f"{base_dir}: rule {self.rule} derives from {SOURCE_CONFIG} and the shards")
            where = f"{base_dir}/{SOURCE_CONFIG}"
            with open_regular(base_dir, SOURCE_CONFIG, where) as fh:
                config = canonical.loads(fh.read(MAX_DERIVED_BYTES + 1), where)
            if not isinstance(config, dict):
                raise FqError(f"{where}: expected a JSON object (a model config)")
            if not self.applies(base_dir, config):
                return []
        headers = _headers(base_dir, [n for n in inputs if n != SOURCE_CONFIG])
        out = self.tensors(base_dir, config, headers)
        for t in out:
            if t.name in headers:
                raise FqError(f"{base_dir}/{headers[t.name][0]}: holds {t.name}, which rule {self.rule} derives: "
                              f"exllamav3's loader would take one of the two ({self.output} must not shadow a tensor "
                              "of the base)")
        return out

    def needed(self, base_dir: Path, inputs: list[str]) -> bool:
        return bool(self._derive_tensors(base_dir, inputs))

    def derive(self, base_dir, inputs, params):
        _check_params(params, f"{base_dir}/{self.output}: rule {self.rule} params")
        return self.build(base_dir, inputs)

    def build(self, base_dir: Path, inputs: list[str]) -> bytes:
        """The file's bytes (the rule takes the params only to check them: the tensors are the inputs' own)."""
        from fq.model.shards import encode_header

        out = self._derive_tensors(base_dir, inputs)
        if not out:
            raise FqError(f"{base_dir}: {self.nothing}; rule {self.rule} derives nothing")
        data = encode_header(out, {"format": self.rule}) + b"".join(t.data for t in out)
        if len(data) > self.max_bytes:
            raise FqError(f"{base_dir}/{self.output}: {len(data)} bytes, more than rule {self.rule} ever derives "
                          f"({self.max_bytes})")
        return data


_FUSED_BIAS = re.compile(r"(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)_bias")


def _fused_biases(headers: dict) -> dict:
    """(experts prefix, "gate_up_proj" | "down_proj") -> (shard, header entry) of the fused expert biases among
    ``headers`` (name -> (shard, entry))."""
    found: dict = {}
    for name, (shard, e) in headers.items():
        m = _FUSED_BIAS.fullmatch(name)
        if m:
            found[(m["prefix"], m["proj"])] = (shard, e)
    return found


class _ExpertBiasRule(TensorRule):
    """gpt-oss: the fused expert biases split per expert (module docstring)."""

    rule = RULE_EXPERT_BIAS
    nothing = "no fused expert biases ({P}.experts.gate_up_proj_bias / down_proj_bias) in the shards"
    missing = "the skeleton keeps fused expert biases"
    consequence = "an EXL3 runtime would load the experts without their biases"

    def tensors(self, base_dir, config, headers):
        fused = _fused_biases(headers)
        if not fused:  # every base is asked (finalize, fq verify): one without fused biases imports no torch
            return []
        import torch

        from fq.codec.shape import padded
        from fq.model.checkpoint_model import tensor_from
        from fq.model.shards import RawTensor

        prefixes = sorted({p for p, _ in fused}, key=lambda p: [int(t) if t.isdigit() else t for t in p.split(".")])
        out: list[RawTensor] = []
        for prefix in prefixes:
            parts = {}
            for proj in ("gate_up_proj", "down_proj"):
                if (prefix, proj) not in fused:
                    raise FqError(f"{base_dir}: {prefix}.{proj}_bias missing; rule {RULE_EXPERT_BIAS} splits both "
                                  "fused expert biases of a layer")
                shard, e = fused[(prefix, proj)]
                where = f"{base_dir}/{shard}: {e.name}"
                if len(e.shape) != 2 or e.dtype not in ("BF16", "F16", "F32"):
                    raise FqError(f"{where}: {e.dtype} {list(e.shape)}, expected a 2-D [experts, features] float tensor")
                t = tensor_from(e.dtype, e.shape, _payload(base_dir, shard, e, where)).to(torch.float32)
                half = t.to(torch.float16)  # as exllamav3 rounds a bias it loads from the fused tensors
                if not torch.isfinite(half).all():
                    raise FqError(f"{where}: values beyond float16's range (exllamav3 runs biases in float16)")
                parts[proj] = half
            gate_up, down = parts["gate_up_proj"], parts["down_proj"]
            if gate_up.shape[0] != down.shape[0] or gate_up.shape[1] % 2:
                raise FqError(f"{base_dir}: {prefix}: gate_up_proj_bias {list(gate_up.shape)} and down_proj_bias "
                              f"{list(down.shape)} are not [E, 2I] and [E, H]")
            for x in range(gate_up.shape[0]):
                for proj, row in (("gate_proj", gate_up[x, 0::2]), ("up_proj", gate_up[x, 1::2]),
                                  ("down_proj", down[x])):
                    # zero-padded to the linear's stored output width (fq.codec.shape; a no-op when 128-aligned)
                    row = torch.nn.functional.pad(row, (0, padded(row.shape[0]) - row.shape[0])).contiguous()
                    out.append(RawTensor(f"{prefix}.{x}.{proj}.bias", "F16", tuple(row.shape),
                                         row.view(torch.uint8).numpy().tobytes()))
        return out


class _TensorAliasRule(TensorRule):
    """Tensors exllamav3 reads under another name than the family's checkpoints store them (``Exl3Needs.
    tensor_aliases``: MiniMax-M2's router score bias), copied verbatim (module docstring)."""

    rule = RULE_TENSOR_ALIASES
    reads_config = True
    nothing = "no tensor the family's exllamav3 class reads under another name"
    missing = "the skeleton keeps tensors its family's exllamav3 class reads under another name"
    consequence = "exllamav3 would not find them (MiniMax-M2's router would run without its score bias)"

    def applies(self, base_dir, config):
        return bool(families.for_config(config, f"{base_dir}/{SOURCE_CONFIG}").exl3_needs.tensor_aliases)

    def tensors(self, base_dir, config, headers):
        from fq.model.shards import RawTensor

        family = families.for_config(config, f"{base_dir}/{SOURCE_CONFIG}")
        layers = family.layout.layers  # the layers' prefix: a vision-language model's model.language_model.layers.
        aliases = family.exl3_needs.tensor_aliases
        patterns = [(re.compile(re.escape(layers) + r"(?P<layer>0|[1-9][0-9]{0,8})\." + re.escape(src)), dst)
                    for src, dst in aliases]
        found = []  # (layer, alias index, source name, target name)
        for name in headers:
            for i, (pattern, dst) in enumerate(patterns):
                m = pattern.fullmatch(name)
                if m:
                    layer = int(m["layer"])
                    found.append((layer, i, name, f"{family.layout.layer_prefix(layer)}.{dst}"))
        out: list[RawTensor] = []
        for _, _, name, target in sorted(found):
            shard, e = headers[name]
            data = _payload(base_dir, shard, e, f"{base_dir}/{shard}: {name}")
            if target in headers:  # the skeleton states it under exllamav3's name already: the same bytes, or refused
                tshard, te = headers[target]
                same = (te.dtype, tuple(te.shape)) == (e.dtype, tuple(e.shape)) and \
                    _payload(base_dir, tshard, te, f"{base_dir}/{tshard}: {target}") == data
                if not same:
                    raise FqError(f"{base_dir}/{tshard}: {target} is not {name} ({base_dir}/{shard}): exllamav3 would "
                                  f"read the first, transformers the second")
                continue
            out.append(RawTensor(target, e.dtype, tuple(e.shape), data))
        return out


RULES: dict[str, Rule] = {RULE_CONFIG: _ConfigRule(CONFIG),
                          RULE_QUANTIZATION_CONFIG: _QuantizationConfigRule(QUANTIZATION_CONFIG),
                          RULE_EXPERT_BIAS: _ExpertBiasRule(EXPERT_BIAS, MAX_EXPERT_BIAS_BYTES, json=False),
                          RULE_TENSOR_ALIASES: _TensorAliasRule(TENSOR_ALIASES, MAX_TENSOR_ALIASES_BYTES, json=False)}
TENSOR_RULES = (RULE_EXPERT_BIAS, RULE_TENSOR_ALIASES)  # in the order they are derived (after config.json)
# every file a base may declare derived, in the order they are derived (quantization_config.json lists the shards last)
DERIVED_ORDER = (CONFIG, EXPERT_BIAS, TENSOR_ALIASES, QUANTIZATION_CONFIG)


def derive_expert_bias(base_dir: str | os.PathLike, shards: list[str]) -> bytes:
    """``expert_bias.safetensors`` (rule ``fq-exl3-expert-bias/1``, module docstring) from ``shards``."""
    return RULES[RULE_EXPERT_BIAS].build(Path(base_dir), list(shards))


def derive_tensor_aliases(base_dir: str | os.PathLike, inputs: list[str]) -> bytes:
    """``tensor_aliases.safetensors`` (rule ``fq-exl3-tensor-aliases/1``) from ``source_config.json`` and shards."""
    return RULES[RULE_TENSOR_ALIASES].build(Path(base_dir), list(inputs))


def rule_inputs(rule: str, listed: list[str]) -> list[str]:
    return RULES[rule].inputs(sorted(listed))


def needed_tensor_files(base_dir: str | os.PathLike, listed: list[str]) -> list[str]:
    """The derived tensor files (``expert_bias.safetensors``, ``tensor_aliases.safetensors``) a base of the files
    ``listed`` must declare, in the order they are derived."""
    base_dir = Path(base_dir)
    return [RULES[r].output for r in TENSOR_RULES if RULES[r].needed(base_dir, rule_inputs(r, listed))]


def specs(bits: int, codebook: str, calibration: dict | None = None, expert_bias: bool = False,
          tensor_aliases: bool = False, *, linears: dict | None = None, model_bits: float | None = None) -> list[dict]:
    """What a base manifest declares for a base at K=``bits`` (the ``from`` lists are filled by its writer), in the
    order they are derived; ``calibration`` (``{"rows", "cols"}``) only for a calibrated base; ``expert_bias``: the
    skeleton keeps fused expert biases (``expert_bias.safetensors``), ``tensor_aliases``: tensors exllamav3 reads
    under another name (``tensor_aliases.safetensors``), each derived before quantization_config.json."""
    params = rule_params(bits, codebook, calibration, linears=linears, model_bits=model_bits)
    want = {CONFIG, QUANTIZATION_CONFIG} | ({EXPERT_BIAS} if expert_bias else set()) | \
        ({TENSOR_ALIASES} if tensor_aliases else set())
    rule_of = {r.output: name for name, r in RULES.items()}
    return [{"name": n, "rule": rule_of[n], "params": dict(params)} for n in DERIVED_ORDER if n in want]


def write_derived(base_dir: str | os.PathLike, *, bits: int, codebook: str, calibration: dict | None = None,
                  linears: dict | None = None, whole_model_bits: bool = False) -> list[dict]:
    """Producer: write ``config.json``, the derived tensor files the base needs and ``quantization_config.json`` of
    ``base_dir`` (which holds ``source_config.json`` and every shard) and return the specs its manifest declares. A
    file that already holds the derived bytes is left alone (finalize is idempotent). ``whole_model_bits`` (implied
    by ``linears``): ``bits`` states the bits over the whole model (``model_bits``), ``expert_bits`` K."""
    base_dir = Path(base_dir)
    if not (base_dir / SOURCE_CONFIG).is_file():
        raise FqError(f"{base_dir}/{SOURCE_CONFIG}: missing; a published base keeps its source's config.json "
                      "under that name and derives config.json from it")
    listed = sorted(p.name for p in base_dir.iterdir() if p.is_file() and not p.name.startswith(".tmp-"))
    tensor_files = needed_tensor_files(base_dir, listed)
    mb = None
    if linears or whole_model_bits:  # the bits the shards hold: what the quantization_config rule recomputes, checks
        shards = [n for n in listed if n.endswith(".safetensors") and n not in TENSOR_OUTPUTS]
        mb = storage_bits(tensor_storage(base_dir, shards, bits, codebook, linears))
    out = specs(bits, codebook, calibration, expert_bias=EXPERT_BIAS in tensor_files,
                tensor_aliases=TENSOR_ALIASES in tensor_files, linears=linears, model_bits=mb)
    for spec in out:
        rule = RULES[spec["rule"]]
        data = rule.derive(base_dir, rule.inputs(listed), spec["params"])
        path = base_dir / spec["name"]
        if path.is_symlink() or not path.is_file() or path.read_bytes() != data:
            atomic.write_bytes(path, data)
        listed = sorted(set(listed) | {spec["name"]})  # a later rule may derive from this one's output
    return out


# -- consumer -------------------------------------------------------------------------------------------------

def _show(value) -> str:
    text = json.dumps(value, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= 60 else text[:57] + "..."


def _step(path: str, key) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
        return f"{path}.{key}" if path else key
    return f"{path}[{json.dumps(key, ensure_ascii=False)}]"


def first_difference(want, got, path: str = "") -> str | None:
    """Where ``got`` first differs from ``want`` (sorted keys, depth first): "FIELD is X, ... derives Y"."""
    at = path or "the document"
    if isinstance(want, dict) and isinstance(got, dict):
        for k in sorted(set(want) | set(got)):
            if k not in got:
                return f"{_step(path, k)} is missing, the rule derives {_show(want[k])}"
            if k not in want:
                return f"{_step(path, k)} is present ({_show(got[k])}), the rule derives no such field"
            d = first_difference(want[k], got[k], _step(path, k))
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return f"{at} has {len(got)} item(s), the rule derives {len(want)}"
        for i, (a, b) in enumerate(zip(want, got)):
            d = first_difference(a, b, _step(path, i))
            if d:
                return d
        return None
    if type(want) is not type(got) or want != got:
        return f"{at} is {_show(got)}, the rule derives {_show(want)}"
    return None


def check_derived(base_dir: str | os.PathLike, entry: dict, where: str, rules: dict | None = None
                  ) -> tuple[str | None, str, int]:
    """Recompute one declared derived file of ``base_dir`` and compare it with the file there. Returns
    (problem or None, sha256, size) of the file as present (its digest is then compared with the manifest's).
    ``entry``: the manifest's ``{name, rule, params, from}``; its inputs are checked against the manifest by the
    caller. ``where``: the file's path as messages name it. A file larger than any derived file is refused by its
    size, unread. ``rules``: the registry the rule is looked up in (default: this module's; fq.provenance.derived
    adds the model card's)."""
    base_dir = Path(base_dir)
    rule = (rules or RULES)[entry["rule"]]
    name = entry["name"]
    try:
        want = rule.derive(base_dir, [f["name"] for f in entry["from"]], entry["params"])
    except FqError as e:
        return f"{where}: cannot be derived by rule {entry['rule']}: {e}", "", -1
    with open_regular(base_dir, name, where) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size > rule.max_bytes:  # before reading it (a planted sparse file)
            return (f"{where}: {size} bytes, not the {len(want)} bytes rule {entry['rule']} derives (refused before "
                    "reading it)"), "", size
        data = fh.read(rule.max_bytes + 1)
    digest = canonical.sha256_hex(data)
    if data == want:
        return None, digest, len(data)
    if hasattr(rule, "explain"):  # a text file: the first line that differs
        return (f"{where}: {rule.explain(want, data)} (rule {entry['rule']}; a derived file must be its rule's output "
                "byte for byte)"), digest, size
    if not rule.json:
        return (f"{where}: not the bytes rule {entry['rule']} derives from the base's shards ({len(data)} bytes, the "
                f"rule's output is {len(want)}; a derived file must be its rule's output byte for byte)"), digest, size
    try:
        got = canonical.loads(data, where)
    except FqError as e:
        return f"{where}: not the output of rule {entry['rule']} (it is not JSON fq reads: {e})", digest, size
    diff = first_difference(canonical.loads(want, "derived"), got)
    if diff is None:
        diff = ("the fields are the rule's, the bytes are not its form (fq.core.canonical, pretty or compact, "
                "final newline)")
    return f"{where}: {diff} (rule {entry['rule']}; a derived file must be its rule's output byte for byte)", digest, size
