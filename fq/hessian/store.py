"""The Hessian artifact: one safetensors file per MoE layer, ``hessian-layer{L:03d}.safetensors``.

Tensors, in this order (fq.model.shards layout: compact header, 8-byte aligned data, no gaps):

    input        F32 [n(n+1)/2]   Σ xᵀx over the calibration tokens, x the MoE block input (n = hidden_size)
    input.count  I64 []           tokens summed into ``input`` (rows × cols)
    down.{e}     F32 [m(m+1)/2]   Σ aᵀa, a = act(gate_e(x))·up_e(x), for e = 0 .. n_experts-1 (m = intermediate)
    down.count   I64 [n_experts]  tokens summed into each ``down.{e}``: all tokens (all-experts), or the tokens the
                                  router sent to e (routed-only; may be 0)

A router-affinity weighted file (metadata ``weighting``: ``affinity-down`` | ``affinity``, fq.hessian.affinity;
all-experts capture) holds Σ c·aᵀa in ``down.{e}``, c the router's score of e for each token, and adds:

    down.mass    F64 [n_experts]  Σ c per expert: what ``down.{e}`` is divided by
    input.{e}    F32 [n(n+1)/2]   (affinity) Σ c·xᵀx for expert e's gate and up, e = 0 .. n_experts-1
    input.mass   F64 [n_experts]  (affinity) Σ c per expert: what ``input.{e}`` is divided by

An unweighted file has neither the field nor these tensors: its bytes are those of a file written before the option.

A symmetric n×n matrix is stored as its packed upper triangle: row-major over i ≤ j (row 0: H[0,0..n-1], row 1:
H[1,1..n-1], ...; the order of ``torch.triu_indices(n, n)``), n(n+1)/2 floats. Sums are accumulated in float64
(``fq.hessian.capture``) and rounded to float32 once, here. ``read_hessians`` gives them back as full symmetric
float64 matrices divided by their count: H = XᵀX / count, what exllamav3's ``quantize_exl3`` starts from
(before its damping).

Metadata (``__metadata__``, every value a string, keys sorted, no timestamps: the same sums give the same bytes):
``format`` (fq-hessian/1), ``architecture``, ``layer``, ``hidden_size``, ``intermediate_size``, ``n_experts``,
``tokens``, ``rows``, ``cols``, ``calibration`` (the tokens' digest, fq.hessian.calibration.token_digest),
``capture`` (``all-experts`` | ``routed-only``), ``weighting`` (weighted files only), ``config_sha256`` (the source's config.json), ``source_shards``
(canonical JSON {shard: sha256} of the shards the layer's tensors were read from), ``hidden_in`` (sha256 of the
hidden-state file the layer consumed, "" when captured in memory), ``row_batch``, ``torch``, ``transformers``
(versions: the numbers are reproducible per machine and build, fq.hessian.capture).

The file's sha256 is the artifact's digest: an encode names it, and ``read_hessians(path, expect_sha256)`` refuses
any other file, so a campaign never mixes Hessians.

Sizes: n(n+1)/2·4 + E·m(m+1)/2·4 bytes of data per layer (plus a header under 2 kB and 8·(E+1) bytes of counts).
For GLM-5 (hidden 6144, expert intermediate 2048, 256 routed experts per MoE layer):
6144·6145/2 = 18,877,440 floats = 75,509,760 bytes for ``input``; 2048·2049/2 = 2,098,176 floats = 8,392,704 bytes
per ``down.{e}``, 2,148,532,224 bytes for the 256 experts; 2,224,041,984 bytes (2.22 GB, 2.07 GiB) per MoE layer,
about 167 GB for its 75 MoE layers. The demo model (hidden 256, intermediate 128, 8 experts): 131,584 + 8·33,024
= 395,776 bytes of data per layer. Weighted: 8 bytes more per expert (``down.mass``); with ``affinity`` also
E·n(n+1)/2·4 + 8·E (GLM-5: 19,330,498,560 bytes more per layer, 21.55 GB in all per layer).

    file_name(layer) -> "hessian-layer{L:03d}.safetensors"
    layer_bytes(hidden, intermediate, n_experts, weighting="none") -> int   # data bytes of one layer's file
    pack(H) -> 1-D; unpack(packed, n) -> symmetric n×n
    write_hessians(path, sums, meta) -> sha256 of the file       # atomic (temp, fsync, rename)
    read_hessians(path, expect_sha256=None) -> LayerHessians     # .input(), .input_for(e), .down(e), .weighting
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fq.core import canonical
from fq.errors import FqError

if TYPE_CHECKING:
    import torch

FORMAT = "fq-hessian/1"
MODES = ("all-experts", "routed-only")
WEIGHTED = ("affinity-down", "affinity")  # metadata field weighting (fq.hessian.affinity.WEIGHTED)
# what a fragment's attestation says it was encoded against (quant_args.objective)
OBJECTIVE_LDLQ = "LDLQ in the H metric of calibration activations (fq.codec.ldlq)"
OBJECTIVE_WEIGHT = "weight-only MSE, no Hessian"
META_KEYS = ("architecture", "calibration", "capture", "cols", "config_sha256", "format", "hidden_in", "hidden_size",
             "intermediate_size", "layer", "n_experts", "row_batch", "rows", "source_shards", "tokens", "torch",
             "transformers")
OPTIONAL_KEYS = ("weighting",)  # present only in a weighted file
INT_KEYS = ("layer", "hidden_size", "intermediate_size", "n_experts", "tokens", "rows", "cols", "row_batch")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def file_name(layer: int) -> str:
    return f"hessian-layer{layer:03d}.safetensors"


def packed_len(n: int) -> int:
    return n * (n + 1) // 2


def layer_bytes(hidden: int, intermediate: int, n_experts: int, weighting: str = "none") -> int:
    """Data bytes of one layer's Hessian file (packed fp32 triangles, and a weighted file's masses; header and counts
    not included)."""
    n = 4 * (packed_len(hidden) + n_experts * packed_len(intermediate))
    if weighting in WEIGHTED:
        n += 8 * n_experts
    if weighting == "affinity":
        n += 4 * n_experts * packed_len(hidden) + 8 * n_experts
    return n


@functools.lru_cache(maxsize=4)
def _upper(n: int, device: str = "cpu") -> "torch.Tensor":
    import torch

    return torch.ones(n, n, dtype=torch.bool, device=device).triu()


def pack(h: "torch.Tensor") -> "torch.Tensor":
    """The upper triangle of a square matrix, row-major (i ≤ j), as float32."""
    if h.dim() != 2 or h.shape[0] != h.shape[1]:
        raise FqError(f"pack: expected a square matrix, got shape {list(h.shape)}")
    return h[_upper(int(h.shape[0]), str(h.device))].float()


def unpack(packed: "torch.Tensor", n: int) -> "torch.Tensor":
    """The full symmetric float64 n×n matrix of a packed upper triangle."""
    import torch

    if packed.dim() != 1 or packed.numel() != packed_len(n):
        raise FqError(f"unpack: {packed.numel()} values, a packed {n}x{n} triangle has {packed_len(n)}")
    full = torch.zeros(n, n, dtype=torch.float64, device=packed.device)
    full[_upper(n, str(packed.device))] = packed.double()
    return full + full.triu(1).T


def write_hessians(path: str | os.PathLike, sums, meta: dict) -> str:
    """Write a layer's sums (``fq.hessian.capture.LayerSums``) with ``meta`` (the keys of META_KEYS other than format,
    sizes and counts, which come from ``sums``); atomic; returns the file's sha256."""
    import torch

    from fq.model.shards import RawTensor, write_shard

    n, m, E = sums.hidden_size, sums.intermediate_size, sums.n_experts
    full = {**meta, "format": FORMAT, "layer": sums.layer, "hidden_size": n, "intermediate_size": m, "n_experts": E,
            "tokens": sums.tokens, "capture": sums.mode}
    weighting = getattr(sums, "weighting", "none")
    if weighting != "none":
        full["weighting"] = weighting
    missing = sorted(set(META_KEYS) - set(full))
    extra = sorted(set(full) - set(META_KEYS) - set(OPTIONAL_KEYS))
    if missing or extra:
        raise FqError(f"{path}: Hessian metadata: missing {missing}, unknown {extra}")
    if isinstance(full["source_shards"], dict):
        full["source_shards"] = canonical.dumps(full["source_shards"]).decode("utf-8")
    strings = {k: str(full[k]) for k in sorted(full)}
    _check_meta(strings, str(path))
    tensors = [RawTensor.of("input", pack(sums.input)),
               RawTensor.of("input.count", torch.tensor(sums.input_count, dtype=torch.int64))]
    tensors += [RawTensor.of(f"down.{e}", pack(sums.down[e])) for e in range(E)]
    tensors.append(RawTensor.of("down.count", torch.tensor(list(sums.down_counts), dtype=torch.int64)))
    if weighting != "none":
        tensors.append(RawTensor.of("down.mass", sums.down_mass.double().contiguous()))
    if weighting == "affinity":
        tensors += [RawTensor.of(f"input.{e}", pack(sums.inputs[e])) for e in range(E)]
        tensors.append(RawTensor.of("input.mass", sums.input_mass.double().contiguous()))
    write_shard(path, tensors, strings)
    from fq.core.safepath import sha256_file

    return sha256_file(path)


def _check_meta(meta: dict, where: str) -> dict:
    """Parsed metadata, or FqError naming the field."""
    missing = sorted(set(META_KEYS) - set(meta))
    extra = sorted(set(meta) - set(META_KEYS) - set(OPTIONAL_KEYS))
    if missing or extra:
        raise FqError(f"{where}: metadata fields missing {missing}, unknown {extra} ({FORMAT})")
    if meta["format"] != FORMAT:
        raise FqError(f"{where}: metadata field format is {meta['format']!r}, expected {FORMAT!r}")
    out = dict(meta)
    for k in INT_KEYS:
        v = meta[k]
        if not re.fullmatch(r"0|[1-9][0-9]{0,15}", v):
            raise FqError(f"{where}: metadata field {k} is {v!r}, expected a non-negative integer")
        out[k] = int(v)
    for k in ("hidden_size", "intermediate_size", "n_experts", "tokens", "rows", "cols", "row_batch"):
        if out[k] < 1:
            raise FqError(f"{where}: metadata field {k} is {out[k]}, expected at least 1")
    if out["tokens"] != out["rows"] * out["cols"]:
        raise FqError(f"{where}: metadata field tokens is {out['tokens']}, expected rows x cols = "
                      f"{out['rows'] * out['cols']}")
    if meta["capture"] not in MODES:
        raise FqError(f"{where}: metadata field capture is {meta['capture']!r}, expected one of {', '.join(MODES)}")
    if "weighting" in meta and meta["weighting"] not in WEIGHTED:
        raise FqError(f"{where}: metadata field weighting is {meta['weighting']!r}, expected one of "
                      f"{', '.join(WEIGHTED)} (an unweighted file has no such field)")
    if "weighting" in meta and meta["capture"] != "all-experts":
        raise FqError(f"{where}: metadata field weighting is {meta['weighting']!r} with capture "
                      f"{meta['capture']!r}: a weighted file is an all-experts capture")
    out["weighting"] = meta.get("weighting", "none")
    for k in ("calibration", "config_sha256"):
        if not _HEX64.fullmatch(meta[k]):
            raise FqError(f"{where}: metadata field {k} is {meta[k]!r}, expected a sha256 (64 hex digits)")
    if meta["hidden_in"] and not _HEX64.fullmatch(meta["hidden_in"]):
        raise FqError(f"{where}: metadata field hidden_in is {meta['hidden_in']!r}, expected a sha256 or empty")
    shards = canonical.loads(meta["source_shards"], f"{where}: metadata field source_shards")
    if not isinstance(shards, dict) or not shards or not all(
            isinstance(k, str) and isinstance(v, str) and _HEX64.fullmatch(v) for k, v in shards.items()):
        raise FqError(f"{where}: metadata field source_shards must be a non-empty JSON object shard -> sha256")
    out["source_shards"] = shards
    return out


@dataclass(eq=False)
class LayerHessians:
    """A verified Hessian file. ``input()`` / ``down(e)``: full symmetric float64 matrices divided by their count."""

    path: str
    sha256: str
    meta: dict  # parsed metadata (integers as int, source_shards as dict)
    input_count: int
    down_counts: tuple[int, ...]
    _packed: dict = field(repr=False)
    down_mass: tuple[float, ...] | None = None  # weighted: Σ c per expert
    input_mass: tuple[float, ...] | None = None  # affinity: Σ c per expert of input.{e}

    @property
    def layer(self) -> int:
        return self.meta["layer"]

    @property
    def n_experts(self) -> int:
        return self.meta["n_experts"]

    @property
    def mode(self) -> str:
        return self.meta["capture"]

    @property
    def weighting(self) -> str:
        """none, affinity-down or affinity (fq.hessian.affinity)."""
        return self.meta["weighting"]

    def input_sum(self) -> "torch.Tensor":
        return unpack(self._packed["input"], self.meta["hidden_size"])

    def input(self) -> "torch.Tensor":
        return self.input_sum() / self.input_count

    def input_for(self, expert: int) -> "torch.Tensor":
        """The H of expert ``expert``'s gate and up projections: its own weighted input Hessian in an ``affinity``
        file, the layer's one ``input()`` otherwise."""
        self._check_expert(expert)
        if self.input_mass is None:
            return self.input()
        return self._by_mass(unpack(self._packed[f"input.{expert}"], self.meta["hidden_size"]),
                             self.input_mass[expert], f"input.{expert}")

    def _check_expert(self, expert) -> None:
        if not isinstance(expert, int) or not 0 <= expert < self.n_experts:
            raise FqError(f"{self.path}: expert {expert!r}: the file has experts 0..{self.n_experts - 1}")

    def _by_mass(self, h: "torch.Tensor", mass: float, name: str) -> "torch.Tensor":
        if not mass > 0:
            raise FqError(f"{self.path}: {name}: its router-affinity mass is {mass!r} (no token scored the expert "
                          "above zero): no Hessian")
        return h / mass

    def down_sum(self, expert: int) -> "torch.Tensor":
        self._check_expert(expert)
        return unpack(self._packed[f"down.{expert}"], self.meta["intermediate_size"])

    def down(self, expert: int) -> "torch.Tensor":
        h = self.down_sum(expert)
        if self.down_mass is not None:
            return self._by_mass(h, self.down_mass[expert], f"down.{expert}")
        c = self.down_counts[expert]
        if c == 0:
            raise FqError(f"{self.path}: down.{expert}: no calibration token was routed to expert {expert} "
                          f"({self.mode} capture): no Hessian for its down projection")
        return h / c


def read_bound(path: str | os.PathLike, expect_sha256: str | None, what: str):
    """(header, data, sha256) of a Hessian file (``what``: "Hessian", "linear Hessian"), refused when it is not the
    one an encode is bound to."""
    from fq.model.shards import read_whole

    header, data = read_whole(path, f"the {what} file")
    digest = canonical.sha256_hex(data)
    if expect_sha256 is not None and digest != expect_sha256:
        raise FqError(f"{path}: sha256 {digest}, expected {expect_sha256} (field hessian_sha256: not the {what} file "
                      "the encode is bound to)")
    return header, data, digest


def check_finite(tensors: dict, where: str) -> None:
    import torch

    for name, v in tensors.items():
        if not bool(torch.isfinite(v).all()):
            raise FqError(f"{where}: tensor {name!r} has non-finite values")


def read_hessians(path: str | os.PathLike, expect_sha256: str | None = None) -> LayerHessians:
    """Read and check a Hessian file (digest, metadata, tensor set, dtypes, shapes, counts, finite values)."""
    from fq.model.shards import tensors_in_range

    where = str(path)
    header, data, digest = read_bound(path, expect_sha256, "Hessian")
    meta = _check_meta(header.metadata, where)
    n, m, E = meta["hidden_size"], meta["intermediate_size"], meta["n_experts"]
    want = {"input": ("F32", (packed_len(n),)), "input.count": ("I64", ())}
    want.update({f"down.{e}": ("F32", (packed_len(m),)) for e in range(E)})
    want["down.count"] = ("I64", (E,))
    if meta["weighting"] != "none":
        want["down.mass"] = ("F64", (E,))
    if meta["weighting"] == "affinity":
        want.update({f"input.{e}": ("F32", (packed_len(n),)) for e in range(E)})
        want["input.mass"] = ("F64", (E,))
    have = {e.name: e for e in header.entries}
    missing = [k for k in want if k not in have]
    if missing:
        raise FqError(f"{where}: tensor {missing[0]!r} missing ({len(missing)} missing; a layer of {E} experts has "
                      f"input, input.count, down.0..down.{E - 1}, down.count; weighted, down.mass; affinity, "
                      f"input.0..input.{E - 1}, input.mass)")
    extra = sorted(set(have) - set(want))
    if extra:
        weighted = "" if meta["weighting"] == "none" else f", weighting {meta['weighting']}"
        raise FqError(f"{where}: unexpected tensor {extra[0]!r} (n_experts is {E}{weighted})")
    for name, (dtype, shape) in want.items():
        e = have[name]
        if e.dtype != dtype or e.shape != shape:
            raise FqError(f"{where}: tensor {name!r} is {e.dtype} {list(e.shape)}, expected {dtype} {list(shape)} "
                          f"(hidden_size {n}, intermediate_size {m}, n_experts {E})")
    t = tensors_in_range(header, list(want), 0, data)
    del data
    input_count = int(t.pop("input.count"))
    down_counts = tuple(int(c) for c in t.pop("down.count"))
    masses = {k: tuple(float(v) for v in t.pop(k)) for k in ("down.mass", "input.mass") if k in t}
    for k, ms in masses.items():
        if not all(0 <= v < float("inf") for v in ms):  # also refuses NaN
            raise FqError(f"{where}: tensor {k!r} is {list(ms)}, expected finite non-negative sums of router scores")
    if input_count != meta["tokens"]:
        raise FqError(f"{where}: tensor 'input.count' is {input_count}, expected tokens = {meta['tokens']}")
    for e, c in enumerate(down_counts):
        if meta["capture"] == "all-experts" and c != meta["tokens"]:
            raise FqError(f"{where}: down.count[{e}] is {c}, expected {meta['tokens']} (all-experts capture: every "
                          "token reaches every expert)")
        if not 0 <= c <= meta["tokens"]:
            raise FqError(f"{where}: down.count[{e}] is {c}, expected 0..{meta['tokens']}")
    check_finite(t, where)
    return LayerHessians(where, digest, meta, input_count, down_counts, t, masses.get("down.mass"),
                         masses.get("input.mass"))
