"""Routed-expert tensor names and the EXL3 runtime constants a tensor set implies.

A checkpoint names its routed experts with its own prefix; fq keeps that prefix and replaces the
``.weight`` suffix with EXL3 suffixes::

    model.layers.12.mlp.experts.37.down_proj.weight        (source, torch (out, in))
    model.layers.12.mlp.experts.37.down_proj.trellis|suh|svh|mul1   (fq fragment)

``ExpertLayout`` carries the prefix template, the projection names (gate, up, down order) and how a projection's EXL3
tensors are stored where that is not the source matrix itself (``stored_scale_log2``, below):
``STANDARD`` (Qwen/DeepSeek/GLM style), ``MIXTRAL`` (``block_sparse_moe.experts.{E}.w1/w3/w2``) and
``LANGUAGE_MODEL`` (a vision-language checkpoint's language model: ``model.language_model.layers.{L}.mlp.experts.{E}``,
Qwen3.5-MoE as published); each family of ``fq.model.families`` names its layout. Everything that names expert or
layer tensors asks the layout (``layers``, ``layer_prefix``, ``experts_prefix``, ``experts_pattern``, ``key``,
``parse``), never a literal ``model.layers.``.

Stored scales. A family whose EXL3 runtime reads a routed projection as the source matrix times 2**n declares it in
its layout (``stored_scale_log2``: Laguna's routed up_proj, n = -7, because exllamav3 1.6.5 builds its MoE layers with
``interm_div`` 128). The encoder codes the source matrix (or a stage's residual) in the source's units, and the stored
tensor set is that encoding with ``svh`` times 2**n (``stored``): the trellis and ``suh`` are the encoder's, and the
set reconstructs to exactly 2**n times the encoding's matrix (a power of two; ``svh`` is near 1, so svh * 2**-7 stays
an fp16 normal and is exact for |svh| >= 2**-7). Every reader that needs the source's matrix (a stage's parents, fq's
runtime, eval, the TP store) takes ``source`` of a stored set first; exllamav3 reads the stored set as it is. The
layout, with its stored scales, is in every fragment's header and attestation, the encode's quant args and the plan.

``derive_linear`` re-derives K, codebook and geometry from the tensors themselves (dtype, shape,
marker value) so that a consumer never copies a runtime constant from metadata.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

from fq.codec.codebook import CODEBOOKS, MARKERS, marker_value as _marker_int32
from fq.core import kbits
from fq.errors import FqError

SIGN_SUFFIXES = ("trellis", "suh", "svh")
# The scalar int32 marker (two's complement of the codebook multiplier) names the codebook; none = 3INST.
_MARKER_BY_VALUE = {_marker_int32(k): k for k in MARKERS}


@dataclass(frozen=True)
class ExpertLayout:
    """How a checkpoint names routed experts: ``prefix`` with {layer} and {expert}, projections gate/up/down; and
    ``stored_scale_log2``: (projection, n) where that projection's EXL3 tensors store the matrix times 2**n."""

    prefix: str = "model.layers.{layer}.mlp.experts.{expert}"
    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    stored_scale_log2: tuple[tuple[str, int], ...] = ()

    def __post_init__(self):
        p = self.prefix
        if not isinstance(p, str) or p.count("{layer}") != 1 or p.count("{expert}") != 1 \
                or not re.fullmatch(r"[A-Za-z0-9_.{}]+", p) or re.search(r"\{(?!layer\}|expert\})", p):
            raise FqError(f"expert layout: prefix {p!r} must contain {{layer}} and {{expert}} once each "
                          "and otherwise only letters, digits, '_' and '.'")
        projs = self.projections
        if (not isinstance(projs, tuple) or len(projs) != 3 or len(set(projs)) != 3
                or not all(isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9_]+", x) for x in projs)):
            raise FqError(f"expert layout: projections {projs!r} must be three distinct names (gate, up, down)")
        pattern = re.escape(p).replace(r"\{layer\}", r"(?P<layer>0|[1-9][0-9]{0,8})") \
            .replace(r"\{expert\}", r"(?P<expert>0|[1-9][0-9]{0,8})")
        proj = "|".join(re.escape(x) for x in projs)
        object.__setattr__(self, "_re", re.compile(rf"{pattern}\.(?P<proj>{proj})\.(?P<suffix>[A-Za-z0-9_]+)"))
        scales = self.stored_scale_log2
        if (not isinstance(scales, tuple) or not all(isinstance(x, tuple) and len(x) == 2 for x in scales)
                or len({x[0] for x in scales}) != len(scales)
                or not all(x[0] in projs and type(x[1]) is int and 0 < abs(x[1]) <= MAX_SCALE_LOG2 for x in scales)):
            raise FqError(f"expert layout: stored_scale_log2 {scales!r} must name each of its projections ({projs}) "
                          f"once, with a non-zero integer exponent of at most {MAX_SCALE_LOG2} in magnitude")
        # one spelling per layout: in projection order (equal layouts compare equal, and dump the same JSON)
        object.__setattr__(self, "stored_scale_log2", tuple(sorted(scales, key=lambda x: projs.index(x[0]))))

    @property
    def layers(self) -> str:
        """What every decoder layer's tensor names start with, before the layer number: ``model.layers.``, or a
        vision-language checkpoint's ``model.language_model.layers.``."""
        return self.prefix.split("{layer}")[0]

    @property
    def embed(self) -> str:
        """The token embedding beside the decoder layers: ``model.embed_tokens.weight``, or a vision-language
        checkpoint's ``model.language_model.embed_tokens.weight``."""
        return self.layers.removesuffix("layers.") + "embed_tokens.weight"

    def layer_prefix(self, layer: int) -> str:
        """``model.layers.12``: the layer's tensors are named ``{layer_prefix}.{module}...``."""
        return f"{self.layers}{layer}"

    def experts_prefix(self, layer: int) -> str:
        """``model.layers.12.mlp.experts.``: every tensor name that starts with this belongs to the layer's routed
        experts (one matrix per expert, or a family's fused tensors)."""
        return self.prefix.split("{expert}")[0].format(layer=layer)

    def experts_pattern(self) -> "re.Pattern":
        """Matches a name under any layer's routed experts: group ``layer``, and ``rest`` (what follows the experts
        prefix: ``37.down_proj.weight``, or a fused tensor's ``gate_up_proj``)."""
        head, tail = self.prefix.split("{expert}")[0].split("{layer}")
        return re.compile(re.escape(head) + r"(?P<layer>[0-9]+)" + re.escape(tail) + r"(?P<rest>.+)")

    def expert_prefix(self, layer: int, expert: int) -> str:
        return self.prefix.format(layer=layer, expert=expert)

    def key(self, layer: int, expert: int, proj: str, suffix: str) -> str:
        return f"{self.expert_prefix(layer, expert)}.{proj}.{suffix}"

    def parse(self, key: str) -> tuple[int, int, str, str] | None:
        """(layer, expert, projection, suffix) of a routed-expert key, or None for any other tensor."""
        m = self._re.fullmatch(key)
        if not m:
            return None
        return int(m["layer"]), int(m["expert"]), m["proj"], m["suffix"]

    def is_routed_weight(self, key: str) -> bool:
        parsed = self.parse(key)
        return parsed is not None and parsed[3] == "weight"

    def scale_log2(self, proj: str) -> int:
        """n where ``proj``'s EXL3 tensors store its matrix times 2**n; 0: the matrix itself."""
        return dict(self.stored_scale_log2).get(proj, 0)

    def stored(self, proj: str, tensors: dict) -> dict:
        """The tensor set to store for an encoding of ``proj``'s matrix in the source's units."""
        return pow2_svh(tensors, self.scale_log2(proj))

    def source(self, proj: str, tensors: dict) -> dict:
        """A stored tensor set of ``proj`` as it reconstructs the source's matrix (the inverse of ``stored``)."""
        return pow2_svh(tensors, -self.scale_log2(proj))

    def scales_json(self) -> dict:
        """{projection: n} of the stored scales ({} for none): what the layout's JSON and an encode's quant args
        state."""
        return dict(self.stored_scale_log2)

    def to_json(self) -> dict:
        out = {"prefix": self.prefix, "projections": list(self.projections)}
        if self.stored_scale_log2:  # absent for every layout without one: their JSON stays as it was
            out["stored_scale_log2"] = self.scales_json()
        return out

    @classmethod
    def from_json(cls, obj: object, where: str = "layout") -> "ExpertLayout":
        if not isinstance(obj, dict) or not {"prefix", "projections"} <= set(obj) <= _JSON_KEYS \
                or not isinstance(obj["projections"], list) or not isinstance(obj.get("stored_scale_log2", {}), dict):
            raise FqError(f"{where}: expected {{\"prefix\": str, \"projections\": [gate, up, down]"
                          f"[, \"stored_scale_log2\": {{projection: n}}]}}, got {obj!r}")
        return cls(obj["prefix"], tuple(obj["projections"]), tuple(obj.get("stored_scale_log2", {}).items()))


_JSON_KEYS = {"prefix", "projections", "stored_scale_log2"}
MAX_SCALE_LOG2 = 14  # svh (about 1) times 2**n stays within fp16's normal range (smallest 2**-14)


def pow2_svh(tensors: dict, n: int) -> dict:
    """An EXL3 tensor set whose matrix is ``tensors``' times 2**n: ``svh`` times 2**n in float32, rounded to fp16 (exact
    while the result is an fp16 normal), the rest the same objects."""
    if not n:
        return tensors
    return {**tensors, "svh": (tensors["svh"].float() * 2.0 ** n).to(tensors["svh"].dtype)}


STANDARD = ExpertLayout()
MIXTRAL = ExpertLayout("model.layers.{layer}.block_sparse_moe.experts.{expert}", ("w1", "w3", "w2"))
LANGUAGE_MODEL = ExpertLayout("model.language_model.layers.{layer}.mlp.experts.{expert}")


def suffixes(codebook: str) -> tuple[str, ...]:
    """Tensor suffixes of one EXL3 linear, in file order: trellis, suh, svh, then the marker if any."""
    check_codebook(codebook, "codebook")
    return SIGN_SUFFIXES + ((codebook,) if codebook in MARKERS else ())


def expert_keys(layout: ExpertLayout, layer: int, expert: int, codebook: str) -> list[str]:
    """Every key of one expert in a fragment, in the order the writer lays them out."""
    return [layout.key(layer, expert, proj, s) for proj in layout.projections for s in suffixes(codebook)]


def check_codebook(codebook: object, where: str) -> str:
    if codebook not in CODEBOOKS:
        raise FqError(f"{where}: unknown codebook {codebook!r}; expected one of {', '.join(CODEBOOKS)}")
    return codebook  # type: ignore[return-value]


@dataclass(frozen=True)
class Linear:
    """Runtime constants of one EXL3 linear, as its tensors imply them."""

    K: int | float  # a float for a half-integer rate (1.5, 2.5, 3.5: mul1)
    codebook: str
    in_features: int
    out_features: int


def derive_linear(specs: Mapping[str, tuple[str, tuple[int, ...]]], where: str,
                  marker_value: int | None = None) -> Linear:
    """K, codebook and (in, out) from ``{suffix: (safetensors dtype, shape)}`` of one linear.

    ``marker_value``, when the marker's bytes have been read, must be the codebook's constant.
    Raises naming ``where``, the suffix and what was expected.
    """
    missing = [s for s in SIGN_SUFFIXES if s not in specs]
    if missing:
        hint = " (without its Hadamard sign vectors a stage reconstructs nothing)" if \
            set(missing) & {"suh", "svh"} else ""
        raise FqError(f"{where}: missing {', '.join(missing)}{hint}")
    markers = [s for s in specs if s in MARKERS]
    extra = [s for s in specs if s not in SIGN_SUFFIXES and s not in MARKERS]
    if extra or len(markers) > 1:
        raise FqError(f"{where}: unexpected tensors {', '.join(sorted(extra + markers[1:]))}; "
                      f"expected trellis, suh, svh and at most one of {', '.join(MARKERS)}")
    t_dtype, t_shape = specs["trellis"]
    if t_dtype != "I16" or len(t_shape) != 3:
        raise FqError(f"{where}.trellis: expected int16 (in/16, out/16, 16*K), got {t_dtype} {list(t_shape)}")
    rows, cols, words = t_shape
    half = words / 16 in kbits.HALF_KS  # exllamav3's half-integer rates: mul1 only (checked with the marker below)
    if not half and (words % 16 or not 1 <= words // 16 <= 8):
        raise FqError(f"{where}.trellis: last dimension {words} is not 16*K for K in 1..8 or a half-integer K 1.5, "
                      "2.5, 3.5")
    n_in, n_out = rows * 16, cols * 16
    if n_in == 0 or n_out == 0 or n_in % 128 or n_out % 128:
        raise FqError(f"{where}.trellis: implies in={n_in}, out={n_out}; both must be positive multiples of 128")
    for s, n in (("suh", n_in), ("svh", n_out)):
        dtype, shape = specs[s]
        if dtype != "F16" or tuple(shape) != (n,):
            raise FqError(f"{where}.{s}: expected float16 ({n},) to match the trellis, got {dtype} {list(shape)}")
    codebook = "3inst"
    if markers:
        codebook = markers[0]
        dtype, shape = specs[codebook]
        if dtype != "I32" or tuple(shape) != ():
            raise FqError(f"{where}.{codebook}: expected a scalar int32 marker, got {dtype} {list(shape)}")
        if marker_value is not None and _MARKER_BY_VALUE.get(marker_value) != codebook:
            raise FqError(f"{where}.{codebook}: marker value {marker_value:#x} is not the {codebook} constant "
                          f"{MARKERS[codebook]:#x}")
    if half and codebook != "mul1":
        raise FqError(f"{where}.trellis: last dimension {words} is the half-integer K {words / 16}, which is mul1's "
                      f"only; the marker says {codebook}")
    return Linear(words / 16 if half else words // 16, codebook, n_in, n_out)
