"""What a model family declares: how its config names experts and MoE layers, where its routed experts live on
disk, which EXL3 runtime class loads it, and which transformers classes run its layers for calibration.

A family is plain data (``Family``) plus a rule that says which layers are MoE (``MoeRule``). Config values are
read with every spelling the family's checkpoints use (its authors' and transformers 5.x's, which renames some keys
on ``save_pretrained``): several spellings present must agree, none present takes the family's transformers default
or is refused by name.
"""
from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Callable

from fq.core.targets import EXLLAMAV3
from fq.errors import FqError
from fq.model.experts import ExpertLayout

_NO_DEFAULT = object()


def read_int(config: dict, keys: tuple[str, ...], cfg: str, title: str, *, minimum: int = 1,
             default=_NO_DEFAULT) -> int:
    """The integer a family stores under any of ``keys`` (aliases must agree)."""
    found = {k: config[k] for k in keys if k in config and config[k] is not None}
    if not found:
        if default is not _NO_DEFAULT:
            return default
        spelled = " or ".join(repr(k) for k in keys)
        raise FqError(f"{cfg}: field {spelled} missing (expected an integer >= {minimum} for a {title} model)")
    for k, v in found.items():
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise FqError(f"{cfg}: field {k!r}: expected an integer >= {minimum}, got {v!r}")
    if len(set(found.values())) > 1:
        shown = ", ".join(f"{k}={v}" for k, v in found.items())
        raise FqError(f"{cfg}: {shown}: these fields name the same value for a {title} model and must agree")
    return next(iter(found.values()))


def _int_list(config: dict, key: str, cfg: str) -> list[int]:
    v = config.get(key, [])
    if v is None:
        return []
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise FqError(f"{cfg}: field {key!r}: expected a list of layer numbers, got {v!r}")
    return v


# -- which layers are MoE: each rule is what the family's transformers decoder layer tests ----------------------
@dataclass(frozen=True)
class DenseFirst:
    """MoE from layer ``first_k_dense_replace`` on (AFMoE's and LFM2-MoE's ``num_dense_layers``: ``key``; DeepSeek's
    original code also skips layers off ``freq_key``)."""

    default: int
    freq_key: str | None = None
    key: str = "first_k_dense_replace"

    def layers(self, config: dict, n_layers: int, cfg: str, title: str) -> list[int]:
        first = read_int(config, (self.key,), cfg, title, minimum=0, default=self.default)
        freq = read_int(config, (self.freq_key,), cfg, title, default=1) if self.freq_key else 1
        return [l for l in range(n_layers) if l >= first and l % freq == 0]


@dataclass(frozen=True)
class LayerTypes:
    """``mlp_layer_types[l] == "sparse"``; absent, the config class fills it with ``default_dense`` dense layers
    first, or ``first_k_dense_replace`` of them where the class reads that key (``reads_first_k``)."""

    default_dense: int
    reads_first_k: bool = True

    def layers(self, config: dict, n_layers: int, cfg: str, title: str) -> list[int]:
        types = config.get("mlp_layer_types")
        if types is None:
            if not self.reads_first_k:
                return list(range(min(self.default_dense, n_layers), n_layers))
            return DenseFirst(self.default_dense).layers(config, n_layers, cfg, title)
        if not isinstance(types, list) or len(types) != n_layers or not set(types) <= {"dense", "sparse"}:
            raise FqError(f"{cfg}: field 'mlp_layer_types': expected num_hidden_layers={n_layers} entries, each "
                          f"'dense' or 'sparse', got {types!r}")
        return [l for l, t in enumerate(types) if t == "sparse"]


@dataclass(frozen=True)
class SparseStep:
    """Qwen-MoE: not in ``mlp_only_layers`` and ``(l + 1) % decoder_sparse_step == 0``."""

    def layers(self, config: dict, n_layers: int, cfg: str, title: str) -> list[int]:
        step = read_int(config, ("decoder_sparse_step",), cfg, title, default=1)
        only = set(_int_list(config, "mlp_only_layers", cfg))
        return [l for l in range(n_layers) if l not in only and (l + 1) % step == 0]


@dataclass(frozen=True)
class Interval:
    """Ernie-4.5: ``(l + 1) % moe_layer_interval == 0`` and start <= l <= end (end -1: the last layer)."""

    def layers(self, config: dict, n_layers: int, cfg: str, title: str) -> list[int]:
        start = read_int(config, ("moe_layer_start_index",), cfg, title, minimum=0, default=1)
        end = config.get("moe_layer_end_index", -1)
        if not isinstance(end, int) or isinstance(end, bool) or end < -1:
            raise FqError(f"{cfg}: field 'moe_layer_end_index': expected a layer number or -1, got {end!r}")
        end = n_layers - 1 if end == -1 else end
        every = read_int(config, ("moe_layer_interval",), cfg, title, default=1)
        return [l for l in range(n_layers) if (l + 1) % every == 0 and start <= l <= end]


@dataclass(frozen=True)
class AllLayers:
    def layers(self, config: dict, n_layers: int, cfg: str, title: str) -> list[int]:
        return list(range(n_layers))


MoeRule = DenseFirst | LayerTypes | SparseStep | Interval | AllLayers


@dataclass(frozen=True)
class Exl3Needs:
    """What the family's exllamav3 1.6.5 class reads from ``config.json`` differently from transformers: a base
    whose config it would misread is not loadable (``problems``), and keys it reads under another spelling are
    stated in the base's derived config.json (``aliases``, fq.provenance.exl3config)."""

    stated: tuple[str, ...] = ()  # keys whose exllamav3 default differs from transformers' (or that it requires)
    values: tuple[tuple[str, tuple, object], ...] = ()  # (key, values exllamav3 accepts, the value when absent)
    all_moe: bool = False  # exllamav3 makes every layer MoE (decoder_sparse_step / mlp_only_layers unread)
    aliases: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (key exllamav3 reads, spellings fq derives it from)
    # (key exllamav3 reads with no default, the value transformers' config class computes when the checkpoint does
    # not state it, from the config's other keys; None: nothing to state)
    computed: tuple[tuple[str, Callable[[dict], object]], ...] = ()
    always: str | None = None  # a problem every checkpoint of the family has
    check: Callable[[dict, int], list[str]] | None = None  # the family's own (config, num_hidden_layers) -> problems
    # (name the checkpoint stores, name exllamav3 reads), both relative to a decoder layer's prefix
    # (``ExpertLayout.layer_prefix``): a base derives each such tensor under the name exllamav3 reads
    # (tensor_aliases.safetensors, rule fq-exl3-tensor-aliases/1 of fq.provenance.exl3config), the skeleton keeps it
    # as published (transformers and fq's runtime read that one)
    tensor_aliases: tuple[tuple[str, str], ...] = ()

    def derived_keys(self, config: dict) -> dict:
        """The keys the base's config.json states for exllamav3 (read from the source's own spellings)."""
        out = {}
        for key, spellings in self.aliases:
            if key not in config:
                for k in spellings:
                    if config.get(k) is not None:
                        out[key] = config[k]
                        break
        for key, rule in self.computed:
            if config.get(key) is None and (value := rule(config)) is not None:
                out[key] = value
        return out

    def problems(self, config: dict, moe_layers, n_layers: int) -> list[str]:
        have = {**config, **self.derived_keys(config)}
        out = [f"{k} is not stated (exllamav3 requires it or assumes another default)" for k in self.stated
               if have.get(k) is None]
        for key, allowed, absent in self.values:
            v = have.get(key, absent)
            if v not in allowed:
                out.append(f"{key}={v!r} (exllamav3 accepts {', '.join(map(repr, allowed))})")
        if self.all_moe and list(moe_layers) != list(range(n_layers)):
            out.append("not every layer is MoE (exllamav3 makes every layer MoE: decoder_sparse_step and "
                       "mlp_only_layers are unread)")
        if self.check is not None:
            out += self.check(have, n_layers)
        if self.always:
            out.append(self.always)
        return out


@functools.lru_cache(maxsize=1)
def _exl3_config_facts() -> dict:
    from importlib import resources

    return json.loads(resources.files("fq").joinpath("data/exl3_config_asserts.json").read_text())


def exl3_config_asserts() -> dict:
    """{exllamav3 class: [{key, value, optional}, ...]}: what each class's ``assert_cfg`` requires of config.json
    (fq/data/exl3_config_asserts.json, extracted from the exllamav3 wheel by tools/exl3_config_asserts.py)."""
    return _exl3_config_facts()["asserts"]


def exl3_config_required() -> dict:
    """{exllamav3 class: [[key, alternative, ...], ...]}: the keys each class reads with no default (``read_cfg(...,
    no_default)``): exllamav3 refuses a config.json without one ("Missing any of the following keys: [...]")."""
    return _exl3_config_facts()["required"]


def exl3_assert_problems(exl3_class: str, config: dict) -> list[str]:
    """The keys of ``config`` (the language model's view) that exllamav3's class asserts otherwise: it refuses to
    load such a base ("Key ... expected to have value ..."). A key it asserts and may miss (``optional``) is fine
    absent; one it requires is a problem when absent."""
    out = [f"{' or '.join(keys)} is not stated (exllamav3's {exl3_class} reads it with no default)"
           for keys in exl3_config_required().get(exl3_class, ()) if all(config.get(k) is None for k in keys)]
    for a in exl3_config_asserts().get(exl3_class, ()):
        key, want = a["key"], a["value"]
        if config.get(key) is None:
            if not a["optional"]:
                out.append(f"{key} is not stated (exllamav3's {exl3_class} requires {want!r})")
            continue
        ok = config[key] in want if isinstance(want, list) else config[key] == want
        if not ok or type(config[key]) is not type(want) and not isinstance(want, list):
            out.append(f"{key}={config[key]!r} (exllamav3's {exl3_class} asserts {want!r})")
    return out


def yarn_problems(config: dict) -> list[str]:
    """A YaRN rope that exllamav3 would compute otherwise than transformers: where ``original_max_position_embeddings``
    is stated, exllamav3 1.6.5 (``util/rope.py``, ``RoPE._rope_params_yarn``) takes the factor as
    max_position_embeddings / original_max_position_embeddings and ignores ``factor``; transformers
    (``_compute_yarn_parameters``) reads ``factor``. Where the two differ (a small checkpoint that keeps gpt-oss's
    rope_parameters but states a shorter max_position_embeddings; a Qwen3 given YaRN as its model card says, without
    raising max_position_embeddings) every position is rotated with other frequencies and attention factor."""
    rope = next((config[k] for k in ("rope_scaling", "rope_parameters") if isinstance(config.get(k), dict)), None)
    if not rope or rope.get("rope_type", rope.get("type")) != "yarn":
        return []
    orig, factor, longest = rope.get("original_max_position_embeddings"), rope.get("factor"), \
        config.get("max_position_embeddings")
    if not all(isinstance(v, (int, float)) and v > 0 for v in (orig, factor, longest)) or \
            abs(longest / orig - factor) <= 1e-9 * factor:
        return []
    return [f"rope YaRN factor={factor!r}, but max_position_embeddings / original_max_position_embeddings = "
            f"{longest}/{orig} = {longest / orig:g}: exllamav3 {EXLLAMAV3} takes that ratio as the factor where "
            f"original_max_position_embeddings is stated (transformers takes factor), so it would rotate every "
            f"position otherwise than the source model"]


def stated(config: dict, key: str) -> bool:
    """``key`` stated at the top of ``config`` or, where transformers 5.x writes RoPE keys, in its
    ``rope_parameters`` (exllamav3 1.6.5 reads both spellings of ``rope_theta`` and ``partial_rotary_factor``)."""
    rope = config.get("rope_parameters")
    return config.get(key) is not None or isinstance(rope, dict) and rope.get(key) is not None


def vision_config_check(keys: tuple[str, ...], model_types: tuple[str, ...]) -> Callable[[dict, int], list[str]]:
    """An ``Exl3Needs.check`` for a vision-language class of exllamav3 1.6.5 that builds its vision tower's config
    even to run text: ``vision_config`` must state ``keys`` (read without a default) and a ``model_type`` it
    accepts (asserted)."""
    def check(config: dict, n_layers: int) -> list[str]:
        vision = config.get("vision_config")
        if not isinstance(vision, dict):
            return [f"vision_config is not stated (exllamav3 {EXLLAMAV3} reads the vision tower's config)"]
        missing = [k for k in keys if vision.get(k) is None]
        out = [f"vision_config lacks {', '.join(missing)} (exllamav3 {EXLLAMAV3} reads them without a default)"] \
            if missing else []
        if vision.get("model_type") is not None and vision["model_type"] not in model_types:
            out.append(f"vision_config model_type {vision['model_type']!r} (exllamav3 {EXLLAMAV3} accepts "
                       f"{', '.join(model_types)})")
        return out
    return check


def full_attention(hf_cfg, layer: int) -> str:
    return "full_attention"


def sliding_if_window(hf_cfg, layer: int) -> str:
    # Qwen3MoeModel / MixtralModel: one mask for every layer, sliding when the config has a window
    return "full_attention" if getattr(hf_cfg, "sliding_window", None) is None else "sliding_attention"


def per_layer_types(hf_cfg, layer: int) -> str:
    # Qwen3NextModel / GptOssModel / Dots1Model: the mask of config.layer_types[layer]
    return hf_cfg.layer_types[layer]


def rope_per_layer_type(hf_cfg, layer: int) -> dict:
    # Laguna / MiMo-V2-Flash: the rotary module keeps one RoPE per attention type and takes the layer's
    return {"layer_type": hf_cfg.layer_types[layer]}


def linear_or_sliding_if_window(hf_cfg, layer: int) -> str:
    # MiniMaxModel: a lightning-attention layer (config.layer_types) gets no mask, every softmax-attention layer the
    # one mask of the model, sliding when the config has a window
    if hf_cfg.layer_types[layer] == "linear_attention":
        return "linear_attention"
    return sliding_if_window(hf_cfg, layer)


ROUTER_SCORES = ("sigmoid", "softmax")  # Calibration.router_score


@dataclass(frozen=True)
class Calibration:
    """How the calibration chain (``fq.hessian``) runs one of the family's decoder layers with transformers' own
    classes: checked against the full transformers model (tests/test_hessian.py, tests/test_hessian_families.py).
    Functions run on transformers objects; none imports torch at module import."""

    module: str  # transformers modeling module
    layer_class: str
    rotary_class: str | None  # None: the layers take no position embeddings (Kimi-Linear: NoPE MLA, KDA)
    # the causal mask always materialized (a sparse-attention indexer reads it; sdpa alone may skip it)
    materialized_mask: bool = False
    # layers whose attention reuses the previous layer's top-k token selection (DSA "shared" indexer): refused
    shared_indexer: Callable[[object, int], bool] | None = None
    # (checkpoint name prefix, module name prefix), relative to the layer prefix; the first that matches applies
    renames: tuple[tuple[str, str], ...] = ()
    # persistent buffers (layer-relative module names) the layer computes from its config and layer index, as
    # MiniMax's lightning attention does its decay factors: taken from the checkpoint where it holds them, else
    # computed by the owning module's class, (config, layer) -> module, as from_pretrained initializes missing keys
    derived_buffers: tuple[str, ...] = ()
    # (module tensor, the checkpoint tensors it is the dim-0 concatenation of), both layer-relative after
    # ``renames``: transformers' conversion mapping's Concatenate (Kimi-Linear's conv1d of q/k/v_conv1d)
    concats: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # the checkpoint holds the module's own fused experts (gpt-oss) instead of one matrix per expert
    fused_experts: bool = False
    # a checkpoint's fused gate_up_proj / down_proj may be the module's with dims 1 and 2 swapped, (E, in, out) where
    # the module holds (E, out, in) (Qwen3-VL-MoE as published; transformers' conversion_mapping transposes them), or
    # the module's own (as transformers 5.x saves it): told from both tensors' shapes together
    fused_transposed: bool = False
    # (experts module, x [tokens, hidden] float32, e) -> a [tokens, intermediate], what expert e's forward feeds its
    # down projection; None: act(x·gate_eᵀ)·(x·up_eᵀ) from the fused gate_up_proj [E, 2I, hidden]
    act_inputs: Callable | None = None
    intermediate: Callable | None = None  # (experts module) -> intermediate size; None: down_proj [E, hidden, I]
    moe_block: str = "mlp"  # the decoder layer's MoE block (its input is the input Hessian's x)
    router: str = "gate"  # the MoE block's router module, hooked for its top-k
    # how the router turns its logits into each expert's score before the top-k: "sigmoid" or "softmax" (over the
    # experts). The weights the block applies are those scores at the chosen experts, renormalized and scaled per
    # token (fq.hessian.affinity checks it on every batch). None: neither (Phi-3.5-MoE's sparsemixer), and the
    # router-affinity weighting (calibration.weighting) is refused for the family
    router_score: str | None = None
    # (transformers config, layer) -> the layer's attention type as masking_utils names it (its mask function)
    mask_type: Callable[[object, int], str] = full_attention
    attn_implementation: str = "sdpa"  # what from_pretrained picks on the CPU for this model class
    # (transformers config, layer) -> the keyword arguments the rotary module's forward takes for that layer (Laguna:
    # its layer type, each with a RoPE of its own); None: the one rotary call every layer of the model shares
    rotary_kwargs: Callable[[object, int], dict] | None = None
    # (transformers config) -> the factor the model's forward multiplies the token embeddings by before layer 0
    # (AFMoE's muP: sqrt(hidden_size) when mup_enabled); None: the embedding rows as they are
    embed_scale: Callable[[object], float] | None = None
    # (the model's final norm beside its decoder layers, a decoder-layer norm of the same class): the head's input
    final_norm: tuple[str, str] = ("norm", "input_layernorm")

    def __post_init__(self):
        if self.router_score not in ROUTER_SCORES + (None,):
            raise FqError(f"{self.layer_class}: router_score {self.router_score!r}: expected one of "
                          f"{', '.join(ROUTER_SCORES)} or None")


@dataclass(frozen=True)
class FusedExperts:
    """A checkpoint that stores each layer's routed experts as two 3-D tensors under the experts prefix, the expert
    first: ``gate_up`` (gate and up along the output) and ``down``. Each expert's matrices are read from its slice
    (``fq.model.formats``); the encoded experts are named by the family's ``layout``, as exllamav3 reads them."""

    gate_up: str = "gate_up_proj"
    down: str = "down_proj"
    # a dense tensor's matrix dims after the expert's: "in_out" (gpt-oss: transformers' (E, in, out)) or "out_in"
    # (Qwen3.5: (E, 2I, hidden) and (E, hidden, I), torch Linear order)
    order: str = "in_out"
    # gate and up along gate_up's output: "interleaved" (even and odd rows: gpt-oss) or "halves" (the first I rows
    # gate, the last I up: Qwen3.5, transformers' chunk(2))
    split: str = "interleaved"
    biases: bool = False  # ``{name}_bias`` [E, out] beside each (gpt-oss), kept in the skeleton
    mxfp4: bool = False  # published as MXFP4 ``{name}_blocks`` / ``{name}_scales`` (gpt-oss)
    # the family's checkpoints may name every expert's matrices instead (``layout``), as transformers saves Qwen3.5
    per_expert_too: bool = False
    # fq's runtime hands transformers the fused tensors (gpt-oss, whose modeling reads only those); False: the
    # per-expert names, which transformers' conversion mapping fuses on load (Qwen3.5)
    runtime_fused: bool = True
    # the other order transformers 5.x saves the same checkpoint in (Qwen3-VL-MoE: published (E, in, out), saved as its
    # module holds them, (E, out, in)): both are read, which one a checkpoint holds told by its shard headers; fq's
    # runtime hands transformers this one (its Transpose(check_dims) cannot tell the two apart in a square gate_up)
    saved_order: str | None = None

    def __post_init__(self):
        if self.order not in ("in_out", "out_in") or self.split not in ("interleaved", "halves") \
                or self.saved_order not in (None, "in_out", "out_in"):
            raise FqError(f"fused experts: order {self.order!r} / {self.saved_order!r}, split {self.split!r}: expected "
                          "in_out or out_in, interleaved or halves")


@dataclass(frozen=True)
class Family:
    """One model family, as fq reads, encodes, calibrates and publishes it."""

    name: str  # registry key (fq's name; also SourceModel.family)
    title: str  # the releases it covers, for messages and the support table
    architectures: tuple[str, ...]  # config.json architectures[0] values
    model_types: tuple[str, ...]  # config.json model_type values (the first is the one transformers knows)
    layout: ExpertLayout  # per-expert tensor names on disk
    experts_keys: tuple[str, ...]  # spellings of the routed-expert count
    inter_keys: tuple[str, ...]  # spellings of a routed expert's intermediate size
    moe_rule: MoeRule
    # spellings of the router's top-k (experts per token); at least 1 and at most the routed-expert count
    topk_keys: tuple[str, ...] = ("num_experts_per_tok",)
    mtp_key: str | None = None  # next-token-prediction layers past num_hidden_layers, with routed experts
    router: str = "mlp.gate"  # router module under the layer prefix
    exl3: str | None = None  # the exllamav3 1.6.5 architecture class that loads a base; None: no EXL3 runtime does
    exl3_needs: Exl3Needs = field(default_factory=Exl3Needs)
    calibration: Calibration | None = None
    # why fq cannot read this family's checkpoints yet (None: it can); its other declarations still hold
    unread: str | None = None
    on_disk: str | None = None  # how the routed experts are stored, where ``layout`` (fq's per-expert names) is not it
    # the fused 3-D tensors under the experts prefix that hold every expert of a layer (gpt-oss, Qwen3.5 as
    # published); None: one matrix per expert, named by ``layout``
    fused_experts: FusedExperts | None = None
    # the key of config.json that holds the language model's config (a vision-language wrapper's text_config);
    # None: the top level. Every config value of the family is read from ``text_view``
    text_config: str | None = None
    # tensors under the routed-experts prefix, named relative to it, that are no expert's matrix and stay skeleton
    # (Laguna's router score bias ``mlp.experts.e_score_correction_bias``); any other such tensor is refused
    experts_skeleton: tuple[str, ...] = ()
    # what the family's FP8 checkpoints name a quantized linear's scale grid beside ``NAME.weight``:
    # ``NAME.weight_scale_inv`` (DeepSeek-V3's and transformers' spelling), DeepSeek-V4's ``NAME.scale``
    scale_suffix: str = "weight_scale_inv"
    # (regex a tensor name starts with, why a checkpoint that names its tensors so is not read): a layout of the
    # family's that fq does not read, refused by name (DeepSeek-V4 as transformers saves it)
    unread_layouts: tuple[tuple[str, str], ...] = ()
    head: str = "lm_head.weight"  # the output head's weight (DeepSeek-V4's release: ``head.weight``)
    # (config, num_hidden_layers) -> each layer's kind: layers of one kind hold the same tensors (fq.provenance.complete
    # compares them); None: the config's ``layer_types`` where it states one per layer
    layer_kinds: Callable[[dict, int], list[str] | None] | None = None
    # the support table's source formats, where the family's releases have a format of their own
    published_formats: str | None = None
    # published tensor name -> the name transformers 5.24's model of the family saves it under (what its reverse
    # conversion gives back, so fq's runtime hands it that name and checks each tensor read back under it), or None
    # for a tensor that model does not build (DeepSeek-V4's MTP blocks); None: the published names are transformers'
    transformers_names: Callable[[str], str | None] | None = None

    @property
    def transformers_model_type(self) -> str:
        return self.model_types[0]

    def text_view(self, config: dict, where: str) -> dict:
        """The config the family's language model reads: the top level, or a vision-language wrapper's
        ``text_config`` over the top level (its own keys first, the wrapper's for the rest: a dtype only the top
        level states). Every count, size and layer rule of the family is read from this."""
        if self.text_config is None:
            return config
        nested = config.get(self.text_config)
        if not isinstance(nested, dict):
            raise FqError(f"{where}: field {self.text_config!r}: expected the language model's config (an object) in "
                          f"a {self.architectures[0]} config, got {nested!r}")
        return {**{k: v for k, v in config.items() if k != self.text_config}, **nested}

    def exl3_problems(self, config: dict, moe_layers, n_layers: int) -> list[str]:
        """Why exllamav3 1.6.5 would not load (or would misread) a base of this config; empty: it loads."""
        if self.exl3 is None:
            return [f"exllamav3 {EXLLAMAV3} has no class for {self.architectures[0]}"]
        return exl3_assert_problems(self.exl3, {**config, **self.exl3_needs.derived_keys(config)}) + \
            self.exl3_needs.problems(config, moe_layers, n_layers) + yarn_problems(config)

    def moe_layers(self, config: dict, n_layers: int, cfg: str) -> list[int]:
        return self.moe_rule.layers(config, n_layers, cfg, self.title)

    def n_experts(self, config: dict, cfg: str) -> int:
        return read_int(config, self.experts_keys, cfg, self.title)

    def experts_key(self, config: dict) -> str:
        """The key the routed-expert count was read from (for messages)."""
        return next((k for k in self.experts_keys if config.get(k) is not None), self.experts_keys[0])

    def top_k(self, config: dict, cfg: str) -> tuple[int, str] | None:
        """(experts each token is routed to, the key it was read from), or None where the config states none (the
        transformers config class's default applies). Refused unless 1 <= top-k <= the routed-expert count: a router
        cannot pick more experts than a layer has."""
        top = read_int(config, self.topk_keys, cfg, self.title, default=None)
        if top is None:
            return None
        key = next(k for k in self.topk_keys if config.get(k) is not None)
        n = self.n_experts(config, cfg)
        if top > n:
            raise FqError(f"{cfg}: field {key!r}: top-{top} routing, but {self.experts_key(config)}={n}: a token "
                          f"cannot be routed to more experts than a MoE layer has (expected an integer from 1 to {n})")
        return top, key

    def intermediate(self, config: dict, cfg: str) -> tuple[int, str]:
        """(a routed expert's intermediate size, the key it was read from)."""
        v = read_int(config, self.inter_keys, cfg, self.title)
        return v, next(k for k in self.inter_keys if config.get(k) is not None)

    def mtp_layers(self, config: dict, cfg: str) -> int:
        return read_int(config, (self.mtp_key,), cfg, self.title, minimum=0, default=0) if self.mtp_key else 0

    def kinds(self, config: dict, n_layers: int) -> list | None:
        """Each layer's kind (``layer_kinds``, else the config's ``layer_types``), or None when the config says none."""
        if self.layer_kinds is not None:
            return self.layer_kinds(config, n_layers)
        types = config.get("layer_types")
        return types if isinstance(types, list) and len(types) == n_layers else None

    def unread_layout(self, names, where: str) -> None:
        """Refuses a checkpoint whose tensor ``names`` are in a layout of the family's that fq does not read."""
        for pattern, why in self.unread_layouts:
            name = next((n for n in sorted(names) if re.match(pattern, n)), None)
            if name is not None:
                raise FqError(f"{where}: tensor {name!r}: {self.architectures[0]} ({self.title}) checkpoints named "
                              f"so are not read: {why}")

    def transformers_name(self, name: str) -> str | None:
        """``name`` (as the family publishes it) as transformers' model of the family saves it; None where that
        model does not build it."""
        return name if self.transformers_names is None else self.transformers_names(name)

    def transformers_layers(self) -> str:
        """The layout's layers prefix as transformers' modules name it (the names it saves are its modules'):
        DeepSeek-V4's release ``layers.`` is ``model.layers.`` there."""
        return self.transformers_name(self.layout.layer_prefix(0) + ".").removesuffix("0.")

    def router_name(self, layer: int) -> str:
        return f"{self.layout.layer_prefix(layer)}.{self.router}.weight"

    def experts_prefix(self, layer: int) -> str:
        """Every tensor name that starts with this belongs to the layer's routed experts."""
        return self.layout.experts_prefix(layer)
