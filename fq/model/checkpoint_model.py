"""A checkpoint's tensors as a float32 transformers model: what fq's CPU runtime, ``fq eval``'s reference and
``fq usage`` run. FP8 block-scaled tensors are dequantized (``fq.model.formats.dense_state``) and a ``model_type``
transformers does not know but the family registry maps (Kimi-K2's ``kimi_k2``) is built as the family's own.

    checkpoint_state(directory, sha256=None) -> (config, float32 tensors)
    build_model(config, tensors) -> transformers model (float32, eval), every tensor checked as loaded
    load_checkpoint(directory, sha256=None) -> build_model(*checkpoint_state(directory, sha256))
    tensor_from(dtype, shape, bytes) -> torch tensor (a safetensors entry's bytes)
"""
from __future__ import annotations

import os

from fq.core.canonical import sha256_hex
from fq.errors import FqError
from fq.model.checkpoint import CONFIG, open_file, read_meta
from fq.model.families import transformers_model_type
from fq.model.formats import dense_state
from fq.model.shards import read_header


def tensor_from(dtype: str, shape, data) -> "torch.Tensor":
    import torch

    from fq.model.shards import torch_dtype

    if not len(data):
        return torch.empty(tuple(shape), dtype=torch_dtype(dtype))
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(torch_dtype(dtype)).reshape(tuple(shape))



def model_class(config: dict):
    import transformers

    arch = config.get("architectures")
    if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
        raise FqError(f"config.json: architectures must name exactly one model class, got {arch!r}")
    cls = getattr(transformers, arch[0], None)
    if cls is None or not isinstance(cls, type):
        raise FqError(f"config.json: architecture {arch[0]!r} is not a model class of transformers "
                      f"{transformers.__version__}")
    return cls


def _in_saved_order(config: dict, tensors: dict) -> dict:
    """``tensors`` with a family's fused experts in the order transformers saves them where the checkpoint holds the
    other one (``FusedExperts.saved_order``: Qwen3-VL-MoE as published, (E, in, out)), the order told from their
    shapes as the source reader tells it. transformers' own load transposes such a tensor only where its shape is not
    the module's, which leaves a square gate_up (hidden = 2I) as it is."""
    from fq.model import families
    from fq.model.source import fused_tensor_order

    try:
        family = families.for_config(config, CONFIG)
    except FqError:  # not a registered family (its architecture is refused where it matters): as it is
        return tensors
    spec = family.fused_experts
    if spec is None or spec.saved_order is None:
        return tensors
    text = family.text_view(config, CONFIG)
    hidden, (inter, _) = text.get("hidden_size"), family.intermediate(text, CONFIG)
    shapes = {n: ("", tuple(t.shape)) for n, t in tensors.items()}
    order = fused_tensor_order({n: "" for n in tensors}, family, shapes, hidden, inter, CONFIG)
    if order in (None, spec.saved_order):
        return tensors
    pattern = family.layout.experts_pattern()
    return {n: t.transpose(1, 2).contiguous() if (m := pattern.fullmatch(n)) and m["rest"] in (spec.gate_up, spec.down)
            else t for n, t in tensors.items()}


def _as_transformers_names(config: dict, tensors: dict) -> tuple[dict, dict]:
    """(``tensors`` under the names transformers saves them, {that name: the published one}) where the family
    publishes other names than transformers' reverse conversion gives back (``Family.transformers_names``:
    DeepSeek-V4's release); a tensor its model does not build (DeepSeek-V4's MTP blocks) is left out. Else as they
    are."""
    from fq.model import families

    try:
        family = families.for_config(config, CONFIG)
    except FqError:  # not a registered family (its architecture is refused where it matters): as it is
        family = None
    if family is None or family.transformers_names is None:
        return tensors, {n: n for n in tensors}
    out, given = {}, {}
    for name, t in tensors.items():
        theirs = family.transformers_name(name)
        if theirs is None:
            continue
        if theirs in given:
            raise FqError(f"{family.architectures[0]}: tensors {given[theirs]} and {name} are both transformers' "
                          f"{theirs}; expected one published tensor per name (fq.model.families: transformers_names)")
        out[theirs], given[theirs] = t, name
    return out, given


def build_model(config: dict, tensors: dict):
    """A float32 transformers model holding exactly ``tensors`` (checkpoint names; transformers converts them to
    its own layout on load; fused experts in the order transformers saves them, ``_in_saved_order``; a family's
    published names as transformers saves them, ``_as_transformers_names``). Refuses
    missing, unexpected or mismatched keys, and checks every tensor read back (transformers' reverse conversion)
    equals the one given."""
    import torch
    import transformers
    from transformers.core_model_loading import revert_weight_conversion

    tensors, published = _as_transformers_names(config, _in_saved_order(config, tensors))
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}  # dense weights: no quantizer
    cls = model_class(cfg)
    model_type = transformers_model_type(cfg)
    cfg.pop("model_type", None)
    if not isinstance(model_type, str):
        raise FqError("config.json: no model_type")
    hf_config = transformers.AutoConfig.for_model(model_type, **cfg)
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    try:
        model, info = cls.from_pretrained(None, config=hf_config, state_dict=dict(tensors), dtype=torch.float32,
                                          output_loading_info=True)
    except (RuntimeError, ValueError) as e:  # transformers refuses a size mismatch itself
        first = str(e).strip().splitlines()
        raise FqError(f"{cls.__name__}: the verified tensors do not fill the model ({first[-1] if first else e})") from None
    finally:
        transformers.logging.set_verbosity(verbosity)
        transformers.logging.enable_progress_bar()
    problems = [f"{k}: {sorted(info.get(k) or ())[:5]}" for k in ("missing_keys", "unexpected_keys", "mismatched_keys",
                                                                   "error_msgs") if info.get(k)]
    if problems:
        raise FqError(f"{cls.__name__}: the verified tensors do not fill the model ({'; '.join(problems)})")
    model.eval()
    with torch.no_grad():
        own = model.state_dict()
        back = revert_weight_conversion(model, own)
    for name, t in tensors.items():
        # a tensor no conversion touched, under the module's own name, where the reverse conversion names it otherwise
        # (Kimi-Linear: a dense layer's mlp.*, which transformers 5.24 reverts to block_sparse_moe.*)
        got = back.get(name, own.get(name))
        if got is None or got.shape != t.shape or not torch.equal(got.to(t.dtype), t):
            shown = name if published[name] == name else f"{published[name]} (transformers' {name})"
            raise FqError(f"{cls.__name__}: tensor {shown} as loaded differs from the one handed over "
                          "(weight conversion changed it)")
    return model


def checkpoint_state(directory: str | os.PathLike, sha256: dict[str, str] | None = None) -> tuple[dict, dict]:
    """(config, float32 tensors) of a Hugging Face checkpoint directory (config.json, the shard index or one
    model.safetensors). ``sha256``: shard name -> digest (what ``fq init`` recorded): each shard is read once and
    compared before it is parsed."""
    meta = read_meta(directory)
    d, config = meta.dir, meta.config
    raw: dict = {}
    for name in meta.shards:
        where = f"{d}/{name}"
        with open_file(d, name, where) as fh:
            header = read_header(fh, where)
            fh.seek(0)
            data = fh.read()
        if sha256 is not None and sha256.get(name) != sha256_hex(data):
            raise FqError(f"{where}: sha256 is not the one the campaign recorded for this source shard")
        if data[:header.data_start] != header.raw:
            raise FqError(f"{where}: changed while it was read")
        for e in header.entries:
            raw[e.name] = tensor_from(e.dtype, e.shape, data[e.start:e.end])
    return config, dense_state(raw, str(d))  # an FP8 checkpoint: every matrix times its block scales


def load_checkpoint(directory: str | os.PathLike, sha256: dict[str, str] | None = None):
    config, tensors = checkpoint_state(directory, sha256)
    return build_model(config, tensors)
