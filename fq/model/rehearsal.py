"""A source checkpoint at GLM-5's real dimensions and published FP8 layout, with random trained-like weights (issue 43).

``benchmarks/rehearsal_source.py`` is the command; the logic is here. What it writes (``write_source``): a
``GlmMoeDsaForCausalLM`` checkpoint directory -- ``config.json``, ``generation_config.json``, sharded safetensors
with ``model.safetensors.index.json``, a tokenizer, a calibration text, and ``rehearsal.json`` (sizes per shard, per
layer and per class, the price's scaling to 256 experts). Its layers: ``dense`` dense-MLP layers, then ``moe`` MoE
layers, each MoE layer cut to ``experts`` routed experts (the config says so).

Where each number comes from (``GLM5``):
- transformers 5.24's ``GlmMoeDsaConfig`` (``@auto_docstring(checkpoint="zai-org/GLM-5")``: its defaults are the
  published config's): hidden_size 6144, intermediate_size 12288 (the dense MLP), moe_intermediate_size 2048,
  n_routed_experts 256, num_experts_per_tok 8, n_shared_experts 1, num_attention_heads 64 (= num_key_value_heads),
  q_lora_rank 2048, kv_lora_rank 512, qk_nope_head_dim 192, qk_rope_head_dim 64, v_head_dim 256, index_n_heads 32,
  index_head_dim 128, index_topk 2048, vocab_size 154880, first_k_dense_replace 3, 78 layers, rms_norm_eps 1e-5,
  routed_scaling_factor 2.5, n_group = topk_group = 1, max_position_embeddings 202752;
- the same numbers in ``fq.model.source_synth.glm5_like`` (the GLM-5 index fq prices), docs/benchmarks.md ("GLM-5 at
  all of its published head dims: q_lora 2048, nope 192, v 256, index 128 x 32 heads") and
  ``fq.model.families.glm`` (exllamav3 1.6.5's asserts: scoring_func sigmoid, topk_method noaux_tc, rope_interleave
  and indexer_rope_interleave true; stated in config.json as the published config states them);
- the tensor names: transformers' ``modeling_glm_moe_dsa`` modules as checkpoints name them (per-expert
  ``mlp.experts.{E}.{gate,up,down}_proj.weight``, the DSA indexer's ``self_attn.indexer.{wq_b,wk,k_norm,
  weights_proj}``; ``tests/kits/familykit.py``'s GLM-5 saves the same names);
- the FP8 layout: DeepSeek-V3's ``quantization_config`` (``quant_method fp8``, ``fmt e4m3``, ``weight_block_size
  [128, 128]``, dynamic activations) with a float32 ``weight_scale_inv`` beside every FP8 weight: every decoder-layer
  linear (routed and shared experts, the MLA projections, the dense MLP, the indexer's ``wq_b`` and ``wk``) in FP8;
  the indexer's ``weights_proj`` stays bf16 (GLM-5-FP8 lists it in ``modules_to_not_convert`` as ``indexers_proj``:
  ROCm/ATOM#451, sgl-project/sglang-jax#1111); embeddings, lm_head, norms and the router weight bf16, the router's
  ``e_score_correction_bias`` float32, as DeepSeek-V3's FP8 release stores them (this repository records no GLM-5
  shard header, so those two dtypes are DeepSeek-V3's);
- shards of at most 5 GB (Hugging Face's default ``max_shard_size``; GLM-5's index in ``source_synth`` has ~5.4 GB
  shards), filled in module order (embeddings, layer 0, 1, ..., norm, lm_head) as ``save_pretrained`` fills them, a
  linear's scale in its weight's shard; inside a shard the data in safetensors' own order (by dtype, float32 first,
  then bf16, then fp8; by name within a dtype), so an expert's weight and its scale are not one byte range.

Not GLM-5's: the tokenizer (the demo model's byte-level BPE of 512 ids; the config keeps vocab 154880 and its
bos/eos/pad ids are the tokenizer's), the calibration text (the demo's training split, about 0.9 M tokens: enough
for exllamav3's 250 x 2048), rope_theta (transformers' default), no next-token-prediction layer, and the weights.

Weights: ``fq.model.synth_weights`` (low-rank with a decaying spectrum plus noise, a few hard-read input columns,
RMSNorm profiles with outlier channels), seeded per (seed, tensor name): the same seed gives the same bytes.

Price at 256 experts: every routed-expert job, fragment and Hessian scales by 256 / experts (blocks of 32 experts:
8 blocks per layer instead of ``experts / 32``); the calibration capture's per-expert down Hessians too, its
attention and shared-expert part not; the skeleton (attention, shared expert, router rows aside) and the linear
jobs do not change. ``rehearsal.json`` states the expert and non-expert bytes per MoE layer and that projection.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fq.core import canonical
from fq.core.atomic import write_bytes, write_text
from fq.errors import FqError
from fq.model.rehearsal_write import write_shards
from fq.model.shards import DTYPES
from fq.model.source import INDEX_NAME

SUMMARY = "rehearsal.json"
CALIBRATION_TEXT = "calibration.txt"
BLOCK = (128, 128)
SHARD_BYTES = 5 * 10**9


@dataclass(frozen=True)
class Dims:
    """GLM-5's widths (defaults: the published config's, module doc) and the rehearsal's cuts."""

    hidden: int = 6144
    moe_inter: int = 2048
    dense_inter: int = 12288
    heads: int = 64
    q_lora: int = 2048
    kv_lora: int = 512
    qk_nope: int = 192
    qk_rope: int = 64
    v_head: int = 256
    index_heads: int = 32
    index_head_dim: int = 128
    vocab: int = 154880
    experts: int = 32  # routed experts kept per MoE layer (GLM-5: 256)
    top_k: int = 8
    shared: int = 1
    dense_layers: int = 1  # GLM-5: 3
    moe_layers: int = 2  # GLM-5: 75

    @property
    def layers(self) -> int:
        return self.dense_layers + self.moe_layers


GLM5 = Dims()
PUBLISHED = {"experts": 256, "dense_layers": 3, "moe_layers": 75}


def tiny(**over) -> Dims:
    """The CPU twin: GLM-5's head dims, latent (kv_lora 512), rope width and index head dim; a narrow residual stream,
    few heads and experts, and the tokenizer's vocab (a 154880-row head at K6 is minutes of CPU)."""
    return replace(GLM5, **{**dict(hidden=256, moe_inter=128, dense_inter=512, heads=2, q_lora=256, index_heads=4,
                                   vocab=512, experts=8, top_k=2), **over})


def scaled(scale: int, **over) -> Dims:
    """GLM-5 with the residual stream, intermediates, heads, q rank and indexer heads divided by ``scale``."""
    if not isinstance(scale, int) or scale < 1:
        raise FqError(f"--width-scale: expected a positive integer, got {scale!r}")
    d = GLM5
    return replace(d, **{**dict(hidden=d.hidden // scale, moe_inter=d.moe_inter // scale,
                                dense_inter=d.dense_inter // scale, heads=max(1, d.heads // scale),
                                q_lora=d.q_lora // scale, index_heads=max(1, d.index_heads // scale)), **over})


def check(d: Dims) -> Dims:
    """Refuse widths the published layout cannot have: EXL3 codes 128-multiples, FP8 scales 128x128 blocks."""
    for field in ("hidden", "moe_inter", "dense_inter", "q_lora", "kv_lora"):
        v = getattr(d, field)
        if not isinstance(v, int) or v < 128 or v % 128:
            raise FqError(f"rehearsal dims: {field}={v!r}: expected a positive multiple of 128 (EXL3 tiles and the "
                          "FP8 128x128 scale blocks)")
    for field in ("heads", "index_heads", "vocab", "experts", "top_k", "shared", "dense_layers", "moe_layers",
                  "qk_nope", "qk_rope", "v_head", "index_head_dim"):
        v = getattr(d, field)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if field == "dense_layers" else 1):
            raise FqError(f"rehearsal dims: {field}={v!r}: expected a positive integer")
    if d.top_k > d.experts:
        raise FqError(f"rehearsal dims: top_k={d.top_k} exceeds experts={d.experts} (a router picks top_k of them)")
    return d


# -- config --------------------------------------------------------------------------------------------------------
def config(d: Dims) -> dict:
    """config.json: GlmMoeDsaConfig's keys at ``d``, the published keys transformers does not define, FP8."""
    return {
        "architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "dtype": "bfloat16",
        "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.dense_inter,
        "moe_intermediate_size": d.moe_inter, "num_hidden_layers": d.layers, "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads, "n_shared_experts": d.shared, "n_routed_experts": d.experts,
        "num_experts_per_tok": d.top_k, "routed_scaling_factor": 2.5, "n_group": 1, "topk_group": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "qk_nope_head_dim": d.qk_nope,
        "qk_rope_head_dim": d.qk_rope, "qk_head_dim": d.qk_nope + d.qk_rope, "head_dim": d.qk_rope,
        "v_head_dim": d.v_head, "index_n_heads": d.index_heads, "index_head_dim": d.index_head_dim,
        "index_topk": 2048, "rope_interleave": True, "indexer_rope_interleave": True,
        "first_k_dense_replace": d.dense_layers, "moe_layer_freq": 1, "num_nextn_predict_layers": 0,
        "mlp_layer_types": ["dense"] * d.dense_layers + ["sparse"] * d.moe_layers,
        "hidden_act": "silu", "rms_norm_eps": 1e-5, "attention_bias": False, "attention_dropout": 0.0,
        "max_position_embeddings": 202752, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
        "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": None, "eos_token_id": 0, "pad_token_id": 0,  # the demo tokenizer's <|endoftext|>
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": list(BLOCK)},
    }


GENERATION_CONFIG = {"_from_model_config": True, "eos_token_id": 0, "pad_token_id": 0}


# -- tensors -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """One published tensor (an FP8 linear is one Spec; it stores ``name`` and ``name``_scale_inv)."""

    name: str
    shape: tuple[int, ...]
    kind: str  # fp8 | linear16 | embed | norm | ln_bias | bias32
    layer: int | None  # None: embeddings, final norm, head
    cls: str  # experts | shared | attention | indexer | dense | router | norm | embed | head

    def stored(self) -> list[tuple[str, str, tuple[int, ...]]]:
        """(name, safetensors dtype, shape) of what is written for this tensor."""
        if self.kind == "fp8":
            grid = tuple(-(-n // b) for n, b in zip(self.shape, BLOCK))
            return [(self.name, "F8_E4M3", self.shape), (self.name + "_scale_inv", "F32", grid)]
        return [(self.name, "F32" if self.kind == "bias32" else "BF16", self.shape)]

    def nbytes(self) -> int:
        return sum(math.prod(s) * DTYPES[dt][0] for _, dt, s in self.stored())


def layer_specs(d: Dims, layer: int) -> list[Spec]:
    """Layer ``layer``'s tensors in module order (self_attn, mlp, then the layer norms)."""
    p, L = f"model.layers.{layer}", layer

    def s(name, shape, kind, cls):
        return Spec(f"{p}.{name}", tuple(shape), kind, L, cls)

    out = [s("self_attn.q_a_proj.weight", (d.q_lora, d.hidden), "fp8", "attention"),
           s("self_attn.q_a_layernorm.weight", (d.q_lora,), "norm", "norm"),
           s("self_attn.q_b_proj.weight", (d.heads * (d.qk_nope + d.qk_rope), d.q_lora), "fp8", "attention"),
           s("self_attn.kv_a_proj_with_mqa.weight", (d.kv_lora + d.qk_rope, d.hidden), "fp8", "attention"),
           s("self_attn.kv_a_layernorm.weight", (d.kv_lora,), "norm", "norm"),
           s("self_attn.kv_b_proj.weight", (d.heads * (d.qk_nope + d.v_head), d.kv_lora), "fp8", "attention"),
           s("self_attn.o_proj.weight", (d.hidden, d.heads * d.v_head), "fp8", "attention"),
           s("self_attn.indexer.wq_b.weight", (d.index_heads * d.index_head_dim, d.q_lora), "fp8", "indexer"),
           s("self_attn.indexer.wk.weight", (d.index_head_dim, d.hidden), "fp8", "indexer"),
           s("self_attn.indexer.k_norm.weight", (d.index_head_dim,), "norm", "indexer"),
           s("self_attn.indexer.k_norm.bias", (d.index_head_dim,), "ln_bias", "indexer"),
           s("self_attn.indexer.weights_proj.weight", (d.index_heads, d.hidden), "linear16", "indexer")]
    if layer < d.dense_layers:
        out += [s(f"mlp.{x}_proj.weight", (d.dense_inter, d.hidden), "fp8", "dense") for x in ("gate", "up")]
        out.append(s("mlp.down_proj.weight", (d.hidden, d.dense_inter), "fp8", "dense"))
    else:
        inter = d.moe_inter
        for e in range(d.experts):
            out += [s(f"mlp.experts.{e}.{x}_proj.weight", (inter, d.hidden), "fp8", "experts") for x in ("gate", "up")]
            out.append(s(f"mlp.experts.{e}.down_proj.weight", (d.hidden, inter), "fp8", "experts"))
        out += [s("mlp.gate.weight", (d.experts, d.hidden), "linear16", "router"),
                s("mlp.gate.e_score_correction_bias", (d.experts,), "bias32", "router")]
        sh = inter * d.shared
        out += [s(f"mlp.shared_experts.{x}_proj.weight", (sh, d.hidden), "fp8", "shared") for x in ("gate", "up")]
        out.append(s("mlp.shared_experts.down_proj.weight", (d.hidden, sh), "fp8", "shared"))
    out += [s("input_layernorm.weight", (d.hidden,), "norm", "norm"),
            s("post_attention_layernorm.weight", (d.hidden,), "norm", "norm")]
    return out


def specs(d: Dims) -> list[Spec]:
    """Every tensor in module order (the order ``save_pretrained`` fills shards in)."""
    out = [Spec("model.embed_tokens.weight", (d.vocab, d.hidden), "embed", None, "embed")]
    for layer in range(d.layers):
        out += layer_specs(d, layer)
    out += [Spec("model.norm.weight", (d.hidden,), "norm", None, "norm"),
            Spec("lm_head.weight", (d.vocab, d.hidden), "linear16", None, "head")]
    return out


def shard_plan(all_specs: list[Spec], shard_bytes: int) -> list[list[Spec]]:
    """Specs packed into shards in order: a shard takes the next tensor unless that would pass ``shard_bytes``."""
    if not isinstance(shard_bytes, int) or shard_bytes < 1:
        raise FqError(f"--shard-bytes: expected a positive integer, got {shard_bytes!r}")
    shards: list[list[Spec]] = [[]]
    size = 0
    for sp in all_specs:
        n = sp.nbytes()
        if shards[-1] and size + n > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(sp)
        size += n
    return shards


def shard_names(n: int) -> list[str]:
    return [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


# -- sizes ---------------------------------------------------------------------------------------------------------
def summary(d: Dims, plan: list[list[Spec]], seed: int) -> dict:
    """rehearsal.json: the dims, per shard / layer / class bytes, and the projection to GLM-5's 256 experts."""
    names = shard_names(len(plan))
    per_layer: dict[str, dict[str, int]] = {}
    per_class: dict[str, int] = {}
    for sp in (sp for shard in plan for sp in shard):
        key = "other" if sp.layer is None else f"layer {sp.layer}"
        row = per_layer.setdefault(key, {})
        row[sp.cls] = row.get(sp.cls, 0) + sp.nbytes()
        per_class[sp.cls] = per_class.get(sp.cls, 0) + sp.nbytes()
    for row in per_layer.values():
        row["total"] = sum(row.values())
    moe = [per_layer[f"layer {L}"] for L in range(d.dense_layers, d.layers)]
    expert_bytes = moe[0]["experts"] if moe else 0
    non_expert_moe = (moe[0]["total"] - expert_bytes) if moe else 0
    dense_layer = per_layer["layer 0"]["total"] if d.dense_layers else 0
    full = expert_bytes * PUBLISHED["experts"] // d.experts
    total = sum(sp.nbytes() for shard in plan for sp in shard)
    return {
        "format": "fq-rehearsal-source/1", "seed": seed, "dims": asdict(d),
        "tensors": sum(len(sp.stored()) for shard in plan for sp in shard), "bytes": total,
        "shards": {n: {"bytes": sum(sp.nbytes() for sp in shard), "tensors": sum(len(sp.stored()) for sp in shard),
                       "layers": sorted({sp.layer for sp in shard if sp.layer is not None})}
                   for n, shard in zip(names, plan)},
        "layers": per_layer, "classes": per_class,
        "moe_layer": {"experts": d.experts, "expert_bytes": expert_bytes, "per_expert_bytes": expert_bytes // max(1, d.experts),
                      "other_bytes": non_expert_moe},
        "projection_256": {
            "note": "routed-expert bytes, jobs and Hessians scale by 256/experts; the rest of a layer does not",
            "scale": PUBLISHED["experts"] / d.experts, "moe_layer_bytes": full + non_expert_moe,
            "glm5_bytes": (full + non_expert_moe) * PUBLISHED["moe_layers"] + dense_layer * PUBLISHED["dense_layers"]
            + per_layer["other"]["total"]},
    }


# -- writing -------------------------------------------------------------------------------------------------------
def write_source(out_dir: str | Path, d: Dims, *, seed: int = 0, shard_bytes: int = SHARD_BYTES,
                 progress: bool = True) -> dict:
    """Write the checkpoint into ``out_dir`` (module doc), shard by shard; returns the summary. Shards already there
    with the planned header and size are kept (a resumed call writes the rest); rehearsal.json is written last."""
    check(d)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(specs(d), shard_bytes)
    names = shard_names(len(plan))
    info = summary(d, plan, seed)
    write_shards(out, list(zip(names, plan)), seed, progress=progress)
    _write_index_and_config(out, d, plan, info)
    write_text(out / "generation_config.json", canonical.pretty(GENERATION_CONFIG))
    info["calibration_text"] = _side_files(out)
    write_text(out / SUMMARY, canonical.pretty(info))
    return info


def write_metadata(out_dir: str | Path, d: Dims, *, shard_bytes: int = SHARD_BYTES) -> dict:
    """What ``fq plan`` and ``fq price`` read of the checkpoint ``write_source`` would write, without its shards:
    config.json, the index and ``sizes.json`` (shard -> bytes, for ``--sizes``). Returns the summary."""
    check(d)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plan = shard_plan(specs(d), shard_bytes)
    info = summary(d, plan, 0)
    _write_index_and_config(out, d, plan, info)
    from fq.model.rehearsal_write import data_order, header_and_offsets

    sizes = {name: header_and_offsets(data_order(group))[2] for name, group in zip(shard_names(len(plan)), plan)}
    write_text(out / "sizes.json", canonical.pretty(sizes))  # the files' sizes: their headers and data
    return info


def _write_index_and_config(out: Path, d: Dims, plan: list[list[Spec]], info: dict) -> None:
    names = shard_names(len(plan))
    weight_map = {name: shard for shard, group in zip(names, plan) for sp in group for name, _, _ in sp.stored()}
    write_text(out / INDEX_NAME, canonical.pretty({"metadata": {"total_size": info["bytes"]},
                                                   "weight_map": dict(sorted(weight_map.items()))}))
    write_text(out / "config.json", canonical.pretty(config(d)))


def _side_files(out: Path) -> dict:
    """The demo model's tokenizer files and its training split as the calibration text; returns {file, sha256}."""
    from fq.model import demo_model

    data = demo_model.data()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        write_bytes(out / name, data[name])
    text = demo_model.text("train").encode("utf-8")
    write_bytes(out / CALIBRATION_TEXT, text)
    return {"file": CALIBRATION_TEXT, "sha256": canonical.sha256_hex(text), "source": "fq demo model, train split"}
