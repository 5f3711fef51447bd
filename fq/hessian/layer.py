"""One decoder layer of a source checkpoint as a transformers module, from that layer's tensors only.

- ``Arch`` / ``ARCHITECTURES``: per ``config.json`` architecture, transformers' decoder-layer and rotary-embedding
  classes, the checkpoint's layer prefix and which layers are MoE. Only architectures whose chain has been checked
  against the full transformers model are registered (``tests/test_hessian.py``): ``Glm4MoeForCausalLM`` and GLM-5's
  ``GlmMoeDsaForCausalLM``.
  Attention, rotary embedding, router and experts are transformers' modules, never re-implemented here.
- ``read_tensors``: named tensors streamed from the checkpoint's shards (the index's weight map): each shard that
  holds one of them is read once, in one pass that hashes the whole file (``fq.core.safepath.sha256_stream``) and keeps
  only the wanted byte ranges, so what is parsed is what was hashed; with ``sha256`` (shard -> digest, what
  ``fq init`` recorded) a shard whose digest differs is refused. Returns float32 tensors (bf16/fp16 upcast,
  exact) and the digest of every shard read.
- ``build_layer``: the layer module built on the meta device and filled with exactly the layer's tensors
  (``load_state_dict(strict=True, assign=True)``: no random init, no copy). transformers 5.x keeps routed experts
  as fused 3-D parameters where the checkpoint has one matrix per expert; the fusion is transformers' own
  conversion (``conversion_mapping``, "qwen2_moe", which glm4_moe uses: ``gate_up_proj[e] = cat(gate_e, up_e)``,
  ``down_proj[e] = down_e``), done here for one layer; ``tests/test_hessian.py`` checks the result equals the
  full model's layer, tensor for tensor.
- ``hf_config``: the transformers config from ``config.json`` as ``fq.runtime.load.build_model`` makes it, with
  the attention and experts implementations that ``from_pretrained`` picks on the CPU (sdpa, grouped_mm).

    architecture(config) -> Arch
    hf_config(config, attn_implementation="sdpa", experts_implementation="grouped_mm")
    read_checkpoint(source_dir) -> Checkpoint                   # config.json + weight map, no payload
    read_tensors(checkpoint, names, sha256=None) -> (tensors, shard digests)
    layer_tensors(checkpoint, layer, sha256=None) -> (tensors, shard digests)
    build_layer(hf_cfg, arch, layer, tensors) -> torch.nn.Module (float32, eval)
    rotary(hf_cfg, arch) -> the model's rotary-embedding module
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

from fq.core import canonical
from fq.errors import FqError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


@dataclass(frozen=True)
class Arch:
    name: str
    module: str  # transformers modeling module
    layer_class: str
    rotary_class: str
    is_moe: Callable[[dict, int], bool]
    embed: str = "model.embed_tokens.weight"
    prefix: str = "model.layers.{layer}."
    experts_count_key: str = "n_routed_experts"
    intermediate_key: str = "moe_intermediate_size"
    # the causal mask always materialized (a sparse-attention indexer reads it; sdpa alone may skip it)
    materialized_mask: bool = False
    # layers whose attention reuses the previous layer's top-k token selection (DSA "shared" indexer): the chain,
    # one layer per job, does not carry that selection, so they are refused
    shared_indexer: Callable[[object, int], bool] | None = None

    def classes(self):
        try:
            mod = importlib.import_module(self.module)
            return getattr(mod, self.layer_class), getattr(mod, self.rotary_class)
        except (ImportError, AttributeError) as e:
            import transformers
            raise FqError(f"{self.name}: transformers {transformers.__version__} lacks {self.module}."
                          f"{self.layer_class}/{self.rotary_class} ({e})") from None


def _glm4_moe_is_moe(config: dict, layer: int) -> bool:
    # Glm4MoeDecoderLayer: an MoE block from first_k_dense_replace on (no moe_layer_freq in this class)
    return layer >= int(config.get("first_k_dense_replace", 1))


def _glm_moe_dsa_is_moe(config: dict, layer: int) -> bool:
    # GlmMoeDsaDecoderLayer: mlp_layer_types when given, else dense below first_k_dense_replace (its config's rule)
    types = config.get("mlp_layer_types")
    if isinstance(types, list) and layer < len(types):
        return types[layer] == "sparse"
    return layer >= int(config.get("first_k_dense_replace", 3))


def _dsa_shared(hf_cfg, layer: int) -> bool:
    types = getattr(hf_cfg, "indexer_types", None) or []
    return layer < len(types) and types[layer] != "full"


ARCHITECTURES: dict[str, Arch] = {
    "Glm4MoeForCausalLM": Arch("Glm4MoeForCausalLM", "transformers.models.glm4_moe.modeling_glm4_moe",
                               "Glm4MoeDecoderLayer", "Glm4MoeRotaryEmbedding", _glm4_moe_is_moe),
    # GLM-5: MLA attention with a DSA indexer (it returns its top-k token selection beside the hidden states)
    "GlmMoeDsaForCausalLM": Arch("GlmMoeDsaForCausalLM", "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa",
                                 "GlmMoeDsaDecoderLayer", "GlmMoeDsaRotaryEmbedding", _glm_moe_dsa_is_moe,
                                 materialized_mask=True, shared_indexer=_dsa_shared),
}


def architecture(config: dict, where: str = CONFIG) -> Arch:
    arch = config.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
        raise FqError(f"{where}: architectures must name exactly one model class, got {arch!r}")
    if arch[0] not in ARCHITECTURES:
        raise FqError(f"{where}: architecture {arch[0]!r}: Hessian capture supports {', '.join(sorted(ARCHITECTURES))} "
                      "(a layer chain checked against the full transformers model)")
    return ARCHITECTURES[arch[0]]


def hf_config(config: dict, attn_implementation: str = "sdpa", experts_implementation: str = "grouped_mm"):
    """The transformers config of ``config.json`` (``quantization_config`` dropped: the weights are dense)."""
    import transformers

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise FqError(f"{CONFIG}: no model_type")
    c = transformers.AutoConfig.for_model(model_type, **cfg)
    c._attn_implementation = attn_implementation
    c._experts_implementation = experts_implementation
    return c


@dataclass(frozen=True)
class Checkpoint:
    dir: Path
    config: dict
    config_sha256: str
    weight_map: Mapping[str, str]  # tensor -> shard file

    def layer_names(self, arch: Arch, layer: int) -> list[str]:
        p = arch.prefix.format(layer=layer)
        return sorted(n for n in self.weight_map if n.startswith(p))


def read_checkpoint(source_dir: str | os.PathLike) -> Checkpoint:
    """config.json and the weight map (the index, or one model.safetensors' header) of a checkpoint directory."""
    from fq.core.safepath import open_regular, read_regular
    from fq.model.shards import read_header

    d = Path(source_dir)
    raw = read_regular(d, CONFIG, f"{d}/{CONFIG}")
    config = canonical.loads(raw, f"{d}/{CONFIG}")
    if not isinstance(config, dict):
        raise FqError(f"{d}/{CONFIG}: not a JSON object")
    if (d / INDEX).is_file():
        index = canonical.loads(read_regular(d, INDEX, f"{d}/{INDEX}"), f"{d}/{INDEX}")
        wm = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
            raise FqError(f"{d}/{INDEX}: weight_map must map tensor names to shard files")
    else:
        with open_regular(d, SINGLE, f"{d}/{SINGLE}") as fh:
            wm = {e.name: SINGLE for e in read_header(fh, f"{d}/{SINGLE}").entries}
    return Checkpoint(d, config, canonical.sha256_hex(raw), dict(wm))


def read_tensors(ckpt: Checkpoint, names, sha256: Mapping[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """(name -> float32 tensor, shard -> sha256 of every shard read) of ``names``; one streaming pass per shard."""
    import torch

    from fq.core.safepath import open_regular, sha256_stream
    from fq.model.shards import read_header, torch_dtype

    names = sorted(set(names))
    missing = [n for n in names if n not in ckpt.weight_map]
    if missing:
        raise FqError(f"{ckpt.dir}: tensors {missing[:3]} are not in the checkpoint's weight map")
    by_shard: dict[str, list[str]] = {}
    for n in names:
        by_shard.setdefault(ckpt.weight_map[n], []).append(n)
    out: dict = {}
    digests: dict[str, str] = {}
    for shard in sorted(by_shard):
        where = f"{ckpt.dir}/{shard}"
        with open_regular(ckpt.dir, shard, where) as fh:
            header = read_header(fh, where)
            entries = sorted((header.entry(n) for n in by_shard[shard]), key=lambda e: e.start)
            bufs = {e.name: bytearray(e.length) for e in entries}
            raw_head = bytearray(header.data_start)

            def tap(buf):
                def fn(at, piece):
                    buf[at: at + len(piece)] = piece
                return fn

            taps = [(0, header.data_start, tap(raw_head))] + [(e.start, e.length, tap(bufs[e.name])) for e in entries]
            digest, size, _ = sha256_stream(fh, taps=taps)
        if bytes(raw_head) != header.raw or size != header.file_size:
            raise FqError(f"{where}: changed while it was read")
        if sha256 is not None and sha256.get(shard) != digest:
            raise FqError(f"{where}: sha256 {digest}, expected {sha256.get(shard)} (the digest the campaign recorded "
                          "for this source shard)")
        digests[shard] = digest
        for e in entries:
            dtype = torch_dtype(e.dtype)
            t = (torch.frombuffer(bufs.pop(e.name), dtype=torch.uint8).view(dtype).reshape(e.shape) if e.length
                 else torch.empty(e.shape, dtype=dtype))
            out[e.name] = t.float() if t.is_floating_point() else t
    return out, digests


def layer_tensors(ckpt: Checkpoint, layer: int, sha256: Mapping[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    arch = architecture(ckpt.config, f"{ckpt.dir}/{CONFIG}")
    names = ckpt.layer_names(arch, layer)
    if not names:
        raise FqError(f"{ckpt.dir}: no tensors of layer {layer} ({arch.prefix.format(layer=layer)}*) in the weight map")
    return read_tensors(ckpt, names, sha256)


def _module_state(module, arch: Arch, layer: int, tensors: Mapping[str, "object"]) -> dict:
    """The layer's checkpoint tensors under the module's own names, routed experts fused where the module is."""
    import torch

    prefix = arch.prefix.format(layer=layer)
    strays = sorted(n for n in tensors if not n.startswith(prefix))
    if strays:
        raise FqError(f"layer {layer}: tensors {strays[:3]} are not layer {layer}'s ({prefix}*)")
    state = {n[len(prefix):]: t for n, t in tensors.items()}
    want = module.state_dict(keep_vars=True)
    experts = getattr(getattr(module, "mlp", None), "experts", None)
    if experts is not None and "mlp.experts.gate_up_proj" in want:
        n_exp, two_i, hidden = want["mlp.experts.gate_up_proj"].shape
        per = {}
        for proj in ("gate_proj", "up_proj", "down_proj"):
            per[proj] = []
            for e in range(n_exp):
                key = f"mlp.experts.{e}.{proj}.weight"
                if key not in state:
                    raise FqError(f"layer {layer}: no tensor {prefix}{key} (expert {e} of {n_exp})")
                per[proj].append(state.pop(key))
        extra = sorted(k for k in state if k.startswith("mlp.experts."))
        if extra:
            raise FqError(f"layer {layer}: routed-expert tensors the module has no place for: {extra[:3]}")
        state["mlp.experts.gate_up_proj"] = torch.cat([torch.stack(per["gate_proj"]), torch.stack(per["up_proj"])], dim=1)
        state["mlp.experts.down_proj"] = torch.stack(per["down_proj"])
    return state


def build_layer(hf_cfg, arch: Arch, layer: int, tensors: Mapping[str, "object"]):
    """transformers' decoder layer ``layer`` holding exactly ``tensors`` (float32, eval mode, on the CPU)."""
    import torch

    layer_cls, _ = arch.classes()
    with torch.device("meta"):
        module = layer_cls(hf_cfg, layer)
    state = _module_state(module, arch, layer, tensors)
    want = module.state_dict()
    missing = sorted(set(want) - set(state))
    unexpected = sorted(set(state) - set(want))
    mismatched = sorted(k for k in set(want) & set(state) if tuple(want[k].shape) != tuple(state[k].shape))
    if missing or unexpected or mismatched:
        detail = "; ".join(f"{what}: {names[:4]}" for what, names in (("missing", missing), ("unexpected", unexpected),
                                                                       ("shape differs", mismatched)) if names)
        raise FqError(f"{arch.layer_class} {layer}: the checkpoint's layer tensors do not fill the module ({detail})")
    module.load_state_dict({k: v.float().contiguous() if v.is_floating_point() else v for k, v in state.items()},
                           strict=True, assign=True)
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise FqError(f"{arch.layer_class} {layer}: {left[:3]} not filled from the checkpoint")
    return module.eval()


def rotary(hf_cfg, arch: Arch):
    """The model's rotary-embedding module (position embeddings every layer of the model shares)."""
    _, rot_cls = arch.classes()
    return rot_cls(config=hf_cfg).eval()
