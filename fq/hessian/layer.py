"""One decoder layer of a source checkpoint as a transformers module, from that layer's tensors only.

- ``Arch``: a family of ``fq.model.families`` as the chain runs it: the family's ``Calibration`` declaration
  (transformers' modeling module, decoder-layer and rotary classes, checkpoint-to-module renames, how the experts
  module computes the down projection's input, the MoE block and router modules, each layer's attention mask and the
  attention implementation ``from_pretrained`` picks on the CPU) with its config keys, MoE-layer rule and layer
  prefix. Only families whose chain has been checked against the full transformers model declare one
  (``tests/test_hessian.py``: GLM-4.x, GLM-5; ``tests/test_hessian_families.py``: the others); ``architecture``
  refuses the rest by name, when the config is read. Attention, rotary embedding, router and experts are
  transformers' modules, never re-implemented here.
- ``read_tensors``: named tensors streamed from the checkpoint's shards (the index's weight map): each shard that
  holds one of them is read once, in one pass that hashes the whole file (``fq.core.safepath.sha256_stream``) and keeps
  only the wanted byte ranges, so what is parsed is what was hashed; with ``sha256`` (shard -> digest, what
  ``fq init`` recorded) a shard whose digest differs is refused. A staged shard with a range index beside it (the
  staging job's ``SHARD.ranges.json``, ``fq.model.shard_index``, derived from the recorded digest) is not hashed
  whole: only the wanted tensors' ranges are read, each checked against the index, and the header byte for byte.
  Returns float32 tensors (bf16/fp16 upcast, exact) and the (recorded) digest of every shard read.
- ``build_layer``: the layer module built on the meta device and filled with exactly the layer's tensors
  (``load_state_dict(strict=True, assign=True)``: no random init, no copy); the buffers a family declares derived
  (``Calibration.derived_buffers``: MiniMax's lightning-attention decay factors) are the checkpoint's, or where it
  lacks them what transformers' own module computes from the config, as ``from_pretrained`` fills missing keys.
  transformers 5.x keeps routed experts
  as fused 3-D parameters where most checkpoints have one matrix per expert; the fusion is transformers' own
  conversion (``conversion_mapping``: "qwen2_moe", which glm4_moe, deepseek_v3, qwen3_moe, ... use:
  ``gate_up_proj[e] = cat(gate_e, up_e)``, ``down_proj[e] = down_e``; "mixtral", which minimax_m2 and minimax use too:
  ``block_sparse_moe.`` renamed ``mlp.``, then the same fusion of ``w1`` (gate), ``w3`` (up), ``w2`` (down)), done
  here for one layer; gpt-oss checkpoints already hold the module's fused tensors, Qwen3-VL-MoE's as published hold
  them with dims 1 and 2 swapped (``Calibration.fused_transposed``: transformers' "qwen3_vl_moe" Transpose(1, 2)).
  The tests check the result equals the full model's layer, tensor for tensor.
- ``hf_config``: the transformers config from ``config.json`` as ``fq.runtime.load.build_model`` makes it, with
  the attention and experts implementations that ``from_pretrained`` picks on the CPU (sdpa, or eager where the
  model has no sdpa attention: gpt-oss; grouped_mm).

    architecture(config) -> Arch
    hf_config(config, attn_implementation=None, experts_implementation="grouped_mm")
    read_checkpoint(source_dir) -> Checkpoint                   # config.json + weight map, no payload
    read_tensors(checkpoint, names, sha256=None) -> (tensors, shard digests)
    layer_tensors(checkpoint, layer, sha256=None) -> (tensors, shard digests)
    build_layer(hf_cfg, arch, layer, tensors) -> torch.nn.Module (float32, eval)
    rotary(hf_cfg, arch) -> the model's rotary-embedding module (None: its layers take no position embeddings)
    position_embeddings(rot, hf_cfg, arch, layer, hidden, position_ids) -> what the model hands that layer
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from fq.errors import FqError

if TYPE_CHECKING:  # the registry imports the codec's constants (numpy): loaded when a chain is built, not here
    from fq.model.families import Calibration, Family

CONFIG = "config.json"


def _glu_act_inputs(experts, x: "torch.Tensor", e: int) -> "torch.Tensor":
    """Expert e's down-projection input for tokens x, as transformers' expert forward computes it from the fused
    ``gate_up_proj`` [E, 2I, hidden]: ``act(x·gate_eᵀ)·(x·up_eᵀ)``."""
    import torch

    gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _glu_intermediate(experts) -> int:
    return int(experts.down_proj.shape[2])  # down_proj [E, hidden, I]


@dataclass(frozen=True)
class ExpertsModule:
    """A family's routed experts: how the checkpoint lays them out, and what transformers' experts module feeds its
    down projection (the input whose Hessian is captured)."""

    # the checkpoint holds one matrix per expert, "{moe_block}.experts.{e}.{name}.weight" (after ``Arch.renames``)
    # for the gate, up and down projections, fused here into gate_up_proj = cat(gate, up) and down_proj; None: it
    # holds the module's own fused tensors
    per_expert: tuple[str, str, str] | None
    act_inputs: Callable  # (experts module, x [tokens, hidden] float32, e) -> a [tokens, intermediate]
    intermediate: Callable  # (experts module) -> intermediate size


def _router_topk(out):
    # transformers' routers return (router_logits, top-k weights, top-k indices)
    return out[-1]


@dataclass(frozen=True)
class Arch:
    """A registered family (``fq.model.families``) as the chain runs it: its ``Calibration`` declaration, its
    config keys and MoE-layer rule, its layer prefix."""

    family: Family
    cal: Calibration
    router_topk: Callable[[object], object] = _router_topk

    name = property(lambda self: self.family.architectures[0])
    module = property(lambda self: self.cal.module)
    layer_class = property(lambda self: self.cal.layer_class)
    rotary_class = property(lambda self: self.cal.rotary_class)
    materialized_mask = property(lambda self: self.cal.materialized_mask)
    shared_indexer = property(lambda self: self.cal.shared_indexer)
    renames = property(lambda self: self.cal.renames)
    derived_buffers = property(lambda self: self.cal.derived_buffers)
    moe_block = property(lambda self: self.cal.moe_block)
    router = property(lambda self: self.cal.router)
    mask_type = property(lambda self: self.cal.mask_type)
    attn_implementation = property(lambda self: self.cal.attn_implementation)
    rotary_kwargs = property(lambda self: self.cal.rotary_kwargs)
    embed_scale = property(lambda self: self.cal.embed_scale)
    model_types = property(lambda self: self.family.model_types)

    @property
    def prefix(self) -> str:
        return self.family.layout.layers + "{layer}."

    @property
    def embed(self) -> str:
        return self.family.layout.embed

    def text(self, config: dict, where: str = CONFIG) -> dict:
        """The language model's config (a vision-language wrapper's ``text_config``): what the chain's layer counts,
        MoE-layer rule and sizes are read from."""
        return self.family.text_view(config, where)

    def n_layers(self, config: dict, where: str = CONFIG) -> int:
        n = self.text(config, where).get("num_hidden_layers")
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise FqError(f"{where}: num_hidden_layers: expected a positive integer, got {n!r}")
        return n

    @property
    def experts(self) -> ExpertsModule:
        c = self.cal
        per = None if c.fused_experts else tuple(self.family.layout.projections)
        return ExpertsModule(per, c.act_inputs or _glu_act_inputs, c.intermediate or _glu_intermediate)

    def is_moe(self, config: dict, layer: int) -> bool:
        """Whether the family's decoder layer ``layer`` has routed experts (its config's own keys and defaults)."""
        return layer in self.family.moe_layers(self.text(config), self.n_layers(config), CONFIG)

    def classes(self):
        try:
            mod = importlib.import_module(self.module)
            return getattr(mod, self.layer_class), self.rotary_class and getattr(mod, self.rotary_class)
        except (ImportError, AttributeError) as e:
            import transformers
            raise FqError(f"{self.name}: transformers {transformers.__version__} lacks {self.module}."
                          f"{self.layer_class}/{self.rotary_class} ({e})") from None

    def module_name(self, name: str) -> str:
        """A layer-relative checkpoint tensor name under the module's own name."""
        for src, dst in self.renames:
            if name.startswith(src):
                return dst + name[len(src):]
        return name

    def checkpoint_name(self, name: str) -> str:
        """A layer-relative module tensor name as the checkpoint spells it (``module_name`` reversed)."""
        for src, dst in self.renames:
            if name.startswith(dst):
                return src + name[len(dst):]
        return name


def architecture(config: dict, where: str = CONFIG) -> Arch:
    """The chain of ``config``'s family; refused by name for an architecture fq does not read, a ``model_type``
    that is not the architecture's, or a family without a calibration chain."""
    from fq.model import families

    family = families.for_config(config, where)
    return Arch(family, families.check_calibration(family, where))


def hf_config(config: dict, attn_implementation: str | None = None, experts_implementation: str = "grouped_mm"):
    """The transformers config of ``config.json`` (``quantization_config`` dropped: the weights are dense).
    ``attn_implementation`` None: what ``from_pretrained`` picks on the CPU for the registered architecture (sdpa,
    eager for gpt-oss). A ``model_type`` the architecture's declaration maps (Kimi-K2's ``kimi_k2``) is replaced by
    transformers' own."""
    import transformers

    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise FqError(f"{CONFIG}: no model_type")
    from fq.model import families

    model_type = families.transformers_model_type(config)  # Kimi-K2's kimi_k2 is deepseek_v3
    family = families.for_config(config, CONFIG)
    if attn_implementation is None:
        attn_implementation = family.calibration.attn_implementation if family.calibration else "sdpa"
    c = transformers.AutoConfig.for_model(model_type, **cfg)
    if family.text_config is not None:  # a vision-language wrapper: its decoder layers take the language model's
        c = c.get_text_config()
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
    """config.json and the weight map (the index, or one model.safetensors' header) of a checkpoint directory, read by
    fq's one reader of a source directory (``fq.model.checkpoint.read_meta``)."""
    from fq.model.checkpoint import read_meta

    meta = read_meta(source_dir)
    return Checkpoint(meta.dir, meta.config, meta.config_sha256, meta.weight_map)


def _range_index(directory: Path, shard: str, sha256: Mapping[str, str] | None) -> tuple[str, dict] | None:
    """(path, doc) of the shard's range index (``fq.model.shard_index``) when the shard is to be verified and the
    staging job left one beside it; refused unless derived from the digest the campaign recorded."""
    from fq.model import shard_index

    if sha256 is None or shard not in sha256:
        return None
    path = shard_index.index_path(Path(directory) / shard)
    if not path.is_file():
        return None
    return str(path), shard_index.load(path, shard, sha256[shard])


def _read_hashed(fh, header, entries, where: str) -> tuple[dict[str, bytearray], str]:
    """The bytes of ``entries`` and the sha256 of the whole file, in one streaming pass: what is parsed is what was
    hashed."""
    from fq.core.safepath import sha256_stream

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
    return bufs, digest


def _collect(out: dict, entries, bufs: dict) -> None:
    """Each entry's bytes as a tensor of its dtype and shape (no copy)."""
    import torch

    from fq.model.shards import torch_dtype

    for e in entries:
        dtype = torch_dtype(e.dtype)
        out[e.name] = (torch.frombuffer(bufs.pop(e.name), dtype=torch.uint8).view(dtype).reshape(e.shape)
                       if e.length else torch.empty(e.shape, dtype=dtype))


def read_tensors(ckpt: Checkpoint, names, sha256: Mapping[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    """(name -> float32 tensor, shard -> sha256 of every shard read) of ``names``. A shard with a range index
    beside it (written by the staging job; used only with ``sha256``, and only when derived from the recorded
    digest) gives only the wanted tensors' bytes, each range checked against the index, and its recorded digest;
    any other shard is read in one streaming pass that hashes it whole.
    An FP8 weight comes back dequantized when its ``weight_scale_inv`` is among ``names`` (``layer_tensors``)."""
    from fq.model import formats, shard_index
    from fq.model.checkpoint import open_file
    from fq.model.shards import read_header

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
        index = _range_index(ckpt.dir, shard, sha256)
        with open_file(ckpt.dir, shard, where) as fh:
            header = read_header(fh, where)
            entries = sorted((header.entry(n) for n in by_shard[shard]), key=lambda e: e.start)
            if index is None:
                bufs, digest = _read_hashed(fh, header, entries, where)
            else:  # only the wanted ranges, each checked against the staging pass's digests
                bufs, digest = shard_index.read_verified(fh, header, index[1], entries, where, index[0]), \
                    index[1]["shard_sha256"]
        if sha256 is not None and sha256.get(shard) != digest:
            raise FqError(f"{where}: sha256 {digest}, expected {sha256.get(shard)} (the digest the campaign recorded "
                          "for this source shard)")
        digests[shard] = digest
        _collect(out, entries, bufs)
    # an FP8 checkpoint: each weight times its block scales (the scales dropped), as the encoder reads it
    fmt = formats.source_format(ckpt.config, f"{ckpt.dir}/{CONFIG}")
    return formats.dense_state(out, str(ckpt.dir), fmt.block or (128, 128)), digests


def layer_tensors(ckpt: Checkpoint, layer: int, sha256: Mapping[str, str] | None = None) -> tuple[dict, dict[str, str]]:
    arch = architecture(ckpt.config, f"{ckpt.dir}/{CONFIG}")
    names = ckpt.layer_names(arch, layer)
    if not names:
        raise FqError(f"{ckpt.dir}: no tensors of layer {layer} ({arch.prefix.format(layer=layer)}*) in the weight map")
    return read_tensors(ckpt, names, sha256)


def _module_state(module, arch: Arch, layer: int, tensors: Mapping[str, "object"]) -> dict:
    """The layer's checkpoint tensors under the module's own names (``arch.renames``), routed experts fused where the
    checkpoint has one matrix per expert and the module a 3-D parameter."""
    import torch

    prefix = arch.prefix.format(layer=layer)
    strays = sorted(n for n in tensors if not n.startswith(prefix))
    if strays:
        raise FqError(f"layer {layer}: tensors {strays[:3]} are not layer {layer}'s ({prefix}*)")
    state: dict = {}
    for n, t in tensors.items():
        k = arch.module_name(n[len(prefix):])
        if k in state:
            raise FqError(f"layer {layer}: two checkpoint tensors map to the module's {k!r}")
        state[k] = t
    for dst, srcs in arch.cal.concats:
        if all(s in state for s in srcs):
            state[dst] = torch.cat([state.pop(s) for s in srcs], dim=0)
    want = module.state_dict(keep_vars=True)
    experts = getattr(getattr(module, arch.moe_block, None), "experts", None)
    base = f"{arch.moe_block}.experts."
    fused = [k for k in (f"{base}gate_up_proj", f"{base}down_proj") if k in state and k in want]
    # (E, in, out) on disk where the module holds (E, out, in): transformers' Transpose(1, 2), decided from both
    # tensors (a square gate_up, hidden = 2·I, does not tell; down then does)
    if arch.cal.fused_transposed and fused and all(state[k].dim() == 3 for k in fused) and all(
            tuple(state[k].transpose(1, 2).shape) == tuple(want[k].shape) for k in fused) and any(
            tuple(state[k].shape) != tuple(want[k].shape) for k in fused):
        for k in fused:
            state[k] = state[k].transpose(1, 2)
    names = arch.experts.per_expert
    # a checkpoint that already holds the module's fused tensors (Qwen3.5 as published) is loaded as it is
    if experts is not None and names is not None and f"{base}gate_up_proj" in want \
            and f"{base}gate_up_proj" not in state:
        n_exp, two_i, hidden = want[f"{base}gate_up_proj"].shape
        per = {}
        for proj in names:
            per[proj] = []
            for e in range(n_exp):
                key = f"{base}{e}.{proj}.weight"
                if key not in state:
                    raise FqError(f"layer {layer}: no tensor {prefix}{arch.checkpoint_name(key)} (expert {e} of "
                                  f"{n_exp})")
                per[proj].append(state.pop(key))
        extra = sorted(prefix + arch.checkpoint_name(k) for k in state if k.startswith(base))
        if extra:
            raise FqError(f"layer {layer}: routed-expert tensors the module has no place for: {extra[:3]}")
        gate, up, down = names
        state[f"{base}gate_up_proj"] = torch.cat([torch.stack(per[gate]), torch.stack(per[up])], dim=1)
        state[f"{base}down_proj"] = torch.stack(per[down])
    return state


def _derived_buffers(hf_cfg, module, layer: int, names: list[str]) -> dict:
    """Buffers the layer computes from its config (``Arch.derived_buffers``) that the checkpoint does not hold, as
    transformers' own module computes them: its owning submodule's class built on the CPU from (config, layer), with
    the global RNG left as it was (its parameters' random init is discarded)."""
    import torch

    out, owners = {}, {}
    for name in names:
        path, _, buf = name.rpartition(".")
        if path not in owners:
            cls = type(module.get_submodule(path))
            with torch.random.fork_rng(devices=[]), torch.device("cpu"):
                owners[path] = cls(hf_cfg, layer)
        out[name] = owners[path].get_buffer(buf).detach()
    return out


def build_layer(hf_cfg, arch: Arch, layer: int, tensors: Mapping[str, "object"]):
    """transformers' decoder layer ``layer`` holding exactly ``tensors`` (float32, eval mode, on the CPU)."""
    import torch

    layer_cls, _ = arch.classes()
    with torch.device("meta"):
        module = layer_cls(hf_cfg, layer)
    state = _module_state(module, arch, layer, tensors)
    want = module.state_dict()
    state.update(_derived_buffers(hf_cfg, module, layer, [k for k in arch.derived_buffers
                                                          if k in want and k not in state]))
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
    """The model's rotary-embedding module (position embeddings every layer of the model shares, or, where the
    family's rotary takes the layer's type, those of each type: ``position_embeddings``); None for a model whose
    layers take none (Kimi-Linear)."""
    _, rot_cls = arch.classes()
    return None if rot_cls is None else rot_cls(config=hf_cfg).eval()


def position_embeddings(rot, hf_cfg, arch: Arch, layer: int, hidden, position_ids):
    """What the model's forward hands decoder layer ``layer``: ``rot(hidden, position_ids)``, with the layer's own
    arguments where the family declares them (``Calibration.rotary_kwargs``)."""
    return rot(hidden, position_ids, **(arch.rotary_kwargs(hf_cfg, layer) if arch.rotary_kwargs else {}))
