"""Train the benchmark MoE of realistic shape (issue 41, item 5): a GLM-4.5-style Glm4MoeForCausalLM on the demo corpus.

The demo model (3 layers, 8 experts, top-2) and the 3-layer Qwen3-MoE of benchmarks/second_family_campaign.py are too
small for bit allocation to decide anything: with 2 MoE layers of 8 experts there is little to allocate between. This
script trains, seeded, transformers' own ``Glm4MoeForCausalLM`` (``Glm4MoeConfig``: the demo's family, GLM-4.5/4.6/4.7)
at the proportions of the published GLM-4.5-Air / GLM-4.5 / DeepSeek-V3 checkpoints, scaled down to train in minutes:

    python benchmarks/train_bench_moe.py OUT [--device cuda|cpu] [--steps N] [--tiny]

writes OUT/model (config.json, generation_config.json, tokenizer.json, tokenizer_config.json, sharded
``model-0000N-of-0000M.safetensors`` and their index; bf16, the routers and their ``e_score_correction_bias`` float32 as
transformers keeps them: saved in float32, reloaded in bfloat16 and saved again, as ``fq.model.demo_train`` exports),
OUT/text/{train,calibration,heldout}.txt (the demo's committed splits, ``fq.model.demo_model.text``) and
OUT/training.json (every hyperparameter and the seed, the loss curve, held-out perplexity before and after, expert
usage on the calibration split per layer, wall times, device, versions). The weights are not committed: the model is
built on the machine that measures it.

Shape (``FULL``), against GLM-4.5-Air (hidden 4096, 46 layers, 128 experts x 1408, top-8, dense MLP 10944, 96 query /
8 KV heads of 128, 1 shared expert, first layer dense) and DeepSeek-V3 (7168, 61, 256 x 2048, top-8):

    hidden 512; 10 layers: layer 0 dense (MLP 1408 = 11 x 128: 2.75 x hidden, Air's 10944 / 4096 = 2.67),
    layers 1-9 MoE: 64 routed experts x 128 (128 / 512 = 0.25 of hidden; Air 0.34, DeepSeek-V3 0.29: 128 is the
    smallest width EXL3's grouped expert path takes), top-8 (as every GLM and DeepSeek checkpoint: routed width
    8 x 128 = 2 x hidden; Air 2.75, DeepSeek-V3 2.3), 1 shared expert of 128, a sigmoid router with
    e_score_correction_bias, norm_topk_prob and routed_scaling_factor 2.5 (GLM-4.5's and DeepSeek-V3's);
    n_group = topk_group = 1 (GLM-4.5's values; exllamav3's GLM class fixes them at 1, fq.model.families.glm);
    attention 8 query heads x 64, 2 KV heads (GQA 4:1; k/v projections 128 wide), partial rotary 0.5 (GLM's);
    vocabulary 512 (the demo tokenizer), untied head; no MTP layer, no attention bias, no QK norm (as the demo, so
    exllamav3's loader takes the same path).

Every linear dim is a multiple of 128 (EXL3's tiles and exllamav3's grouped path; fq needs 16). Parameters: 124.56 M,
of which 113.2 M routed experts (91%; GLM-4.5-Air 94%), 6.6 M attention, 2.2 M dense MLP, 1.8 M shared experts, 0.5 M
embedding and head; 25.5 M active per token (20.4% of the total, routed experts 8 of 64; Air 11%, DeepSeek-V3 5.5%).
The bf16 checkpoint holds 249.7 MB of tensors.

Training (``FULL_TRAIN``): AdamW (0.9, 0.95), weight decay 0.1 on matrices, peak learning rate 1.5e-3 after 30 warmup
steps, cosine decay to 1.5e-4, clip 1.0, on random windows of the demo's train split (896,587 tokens) drawn by a
seeded CPU generator, so the batches are the same on any device; the routers' selection bias is balanced after each
step as the demo's is (``fq.model.demo_train.SelectionBalance``: DeepSeek-V3's auxiliary-loss-free rule), at 5e-4 a
step, between the demo's 2e-4 (uneven use kept) and DeepSeek-V3's 1e-3 (near uniform on the demo). The corpus, not the
GPU, limits the run: 500 steps of 16 x 512 tokens are 4.1 M tokens, 4.6 epochs (Muennighoff et al. 2023: up to about 4
epochs of repeated data are nearly as good as new data; a model 40 times the demo's size on 0.9 M tokens overfits past
that), and the validation loss on the calibration split's first 64 x 256 tokens is logged every 50 steps, so a run that
overfits shows it (``--steps`` changes the length; the schedule follows). FLOPs: 6 x 25.5 M active parameters plus
attention scores (3 x 4 x 512 x 256 mean context x 10 layers = 16 M) per token, about 170 MFLOP, x 4.1 M tokens = 0.7
PFLOP: a second of an H200 at its dense bf16 peak. The run is bound by launches and host syncs instead: a training
step of this model is about 57,000 aten calls (counted on the CPU), 3,700 of them per-expert matrix products
(transformers' ``grouped_mm`` experts on float32 master weights, under bf16 autocast, take torch's per-group fallback,
with a host sync per call); at 3-5 us a call that is 0.2-0.3 s a step, about 2-3 minutes for the 500 steps (an
estimate: not yet run on the H200). On CUDA: bf16 autocast and TF32, the routers computed in float32 (autocast off
inside them, as DeepSeek-V3 keeps its gating in FP32), fused AdamW; the CUDA run is seeded but not bitwise
reproducible. On the CPU: float32 and torch's deterministic kernels (with 2 threads the gradient into the routed
experts' input otherwise varies in its last bits from run to run), so a run is byte for byte reproducible at a given
thread count. Held-out perplexity is computed in float32 (TF32 off) on the exported bf16 checkpoint, in windows of 256
tokens as the demo's (``fq.model.demo_train.EVAL_SEQ``); ``heldout_before`` is the initialised model's.

``--tiny`` runs the same code on a tiny shape (``TINY``: 2 layers, 8 experts, hidden 128, 20 steps; the first 200,000
characters of the train split, 2,048 tokens of held-out and calibration text) on the CPU in seconds, writing the same
files: tests/test_train_bench_moe.py runs it twice and compares the bytes.
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fq.core import atomic, canonical  # noqa: E402
from fq.errors import FqError  # noqa: E402
from fq.model import demo_model, demo_train  # noqa: E402

SEED = demo_model.SEED
FORMAT = "fq-bench-moe-training/1"

# Glm4MoeConfig arguments (docstring: why these)
FULL = {
    "vocab_size": demo_model.VOCAB,
    "hidden_size": 512,
    "intermediate_size": 1408,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 10,
    "first_k_dense_replace": 1,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "num_nextn_predict_layers": 0,
    "attention_bias": False,
    "use_qk_norm": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
# the same code path in seconds on a CPU: a dense layer and one MoE layer of 8 experts, GQA 4:2
TINY = {**FULL, "hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "n_routed_experts": 8, "num_experts_per_tok": 4}

FULL_TRAIN = {
    "steps": 500, "batch": 16, "seq_len": 512,
    "lr": 1.5e-3, "min_lr": 1.5e-4, "warmup": 30, "weight_decay": 0.1, "betas": [0.9, 0.95], "eps": 1e-8, "clip": 1.0,
    "bias_rate": 5e-4,  # between the demo's 2e-4 (uneven use kept) and DeepSeek-V3's 1e-3 (near uniform on the demo)
    "log_every": 10, "val_every": 50, "val_windows": 64,  # validation: the calibration split's first 64 x 256 tokens
    "eval_tokens": None,  # held-out perplexity and usage over the whole split
    "train_chars": None,  # the whole train split
    "shard_bytes": 48 * 2**20,
}
TINY_TRAIN = {**FULL_TRAIN, "steps": 20, "batch": 4, "seq_len": 64, "lr": 2e-3, "min_lr": 2e-4, "warmup": 4,
              "log_every": 5, "val_every": 10, "val_windows": 2, "eval_tokens": 2048, "train_chars": 200_000,
              "shard_bytes": 512 * 2**10}

EVAL_SEQ = demo_train.EVAL_SEQ
EVAL_BATCH = 16
OUTPUTS = ("model", "text", "training.json")


# -- metadata: what fq reads, without weights ----------------------------------------------------------
def glm_config(shape: dict):
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**shape)


def parameter_counts(shape: dict) -> dict:
    """Total and per-token active parameters of ``shape`` by class (built on the meta device: no memory)."""
    import torch
    from transformers import Glm4MoeForCausalLM

    cfg = glm_config(shape)
    with torch.device("meta"):
        model = Glm4MoeForCausalLM(cfg)
    by = {"embedding": 0, "head": 0, "attention": 0, "dense_mlp": 0, "shared_experts": 0, "routed_experts": 0,
          "routers": 0, "norms": 0}
    for name, p in model.named_parameters():
        n = p.numel()
        if name.startswith("model.embed_tokens"):
            by["embedding"] += n
        elif name.startswith("lm_head"):
            by["head"] += n
        elif ".self_attn." in name:
            by["attention"] += n
        elif ".mlp.experts." in name:
            by["routed_experts"] += n
        elif ".mlp.shared_experts." in name:
            by["shared_experts"] += n
        elif ".mlp.gate." in name:
            by["routers"] += n
        elif ".mlp." in name:
            by["dense_mlp"] += n
        else:
            by["norms"] += n
    total = sum(by.values())
    active = total - by["routed_experts"] + by["routed_experts"] * cfg.num_experts_per_tok // cfg.n_routed_experts
    return {"total": total, "active": active, "by_class": by}


def tensor_specs(shape: dict) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor the exported checkpoint holds, in transformers' order: the
    meta-device model's parameters and buffers, the fused routed experts as the per-expert ``gate_proj`` / ``up_proj``
    / ``down_proj`` matrices transformers saves; bf16, the routers and their bias F32."""
    import torch
    from transformers import Glm4MoeForCausalLM

    with torch.device("meta"):
        model = Glm4MoeForCausalLM(glm_config(shape))
    out = []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if name.endswith("rotary_emb.inv_freq") or name.endswith("original_inv_freq"):
            continue  # not saved
        if name.endswith(".mlp.experts.gate_up_proj"):
            prefix = name[: -len("gate_up_proj")]
            E, I2, H = t.shape
            for e in range(E):
                out += [(f"{prefix}{e}.gate_proj.weight", "BF16", (I2 // 2, H)),
                        (f"{prefix}{e}.up_proj.weight", "BF16", (I2 // 2, H))]
        elif name.endswith(".mlp.experts.down_proj"):
            prefix = name[: -len("down_proj")]
            E, H, I = t.shape
            out += [(f"{prefix}{e}.down_proj.weight", "BF16", (H, I)) for e in range(E)]
        else:
            router = ".mlp.gate." in name
            out.append((name, "F32" if router else "BF16", tuple(t.shape)))
    return out


def metadata(shape: dict, shard_bytes: int = FULL_TRAIN["shard_bytes"]) -> tuple[dict, dict, dict[str, int]]:
    """(config.json, model.safetensors.index.json, shard sizes) of the checkpoint ``shape`` exports, without weights:
    what fq plans and prices from (``fq.model.source.parse_source``). Tensors are packed into shards in order, as
    transformers' writer does; the sizes hold the payloads (headers not counted)."""
    from transformers import Glm4MoeForCausalLM

    cfg = glm_config(shape)
    cfg.architectures = [Glm4MoeForCausalLM.__name__]
    cfg.dtype = "bfloat16"
    config = canonical.loads(cfg.to_json_string(use_diff=True).encode(), "<config>")  # as save_pretrained writes it
    specs = tensor_specs(shape)
    shards: list[list[tuple[str, int]]] = [[]]
    for name, dtype, dims in specs:
        size = math.prod(dims) * (4 if dtype == "F32" else 2)
        if shards[-1] and sum(s for _, s in shards[-1]) + size > shard_bytes:
            shards.append([])
        shards[-1].append((name, size))
    n = len(shards)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    index = {"metadata": {"total_size": sum(s for sh in shards for _, s in sh)},
             "weight_map": {t: names[i] for i, sh in enumerate(shards) for t, _ in sh}}
    return config, index, {names[i]: sum(s for _, s in sh) for i, sh in enumerate(shards)}


# -- training ------------------------------------------------------------------------------------------
def _tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_str(demo_model.data()["tokenizer.json"].decode("utf-8"))


def _windows(ids, seq_len: int):
    """Non-overlapping windows of ``seq_len`` tokens, grouped by length (the last may be shorter)."""
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) >= 2]


def mean_nll(model, ids, device, *, seq_len: int = EVAL_SEQ, batch: int = EVAL_BATCH, autocast: bool = False,
             balance=None) -> dict:
    """Mean next-token NLL of ``model`` over ``ids`` (1-D int64, CPU) in non-overlapping windows of ``seq_len``,
    each window its own context, as ``fq.model.demo_train.perplexity`` computes it (sums in float64). With
    ``balance`` (a SelectionBalance), its counts are the routers' selections over these tokens."""
    import torch

    windows = _windows(ids, seq_len)
    nll, count = 0.0, 0
    was_training = model.training
    model.eval()
    if balance is not None:
        balance.reset()
    try:
        with torch.no_grad(), torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
            for n in sorted({len(w) for w in windows}, reverse=True):
                same = [w for w in windows if len(w) == n]
                for i in range(0, len(same), batch):
                    x = torch.stack(same[i:i + batch]).to(device)
                    logits = model(input_ids=x).logits[:, :-1].to(torch.float64)
                    nll += float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                                   x[:, 1:].reshape(-1), reduction="sum"))
                    count += x.shape[0] * (n - 1)
    finally:
        model.train(was_training)
    return {"tokens": int(len(ids)), "predicted": count, "seq_len": seq_len, "nll": nll / count,
            "perplexity": math.exp(nll / count)}


def _fp32_routers(balance, device_type: str) -> None:
    """Run each router outside autocast (its own float32 cast then holds: logits, sigmoid and top-k in float32)."""
    import torch

    for r in balance.routers.values():
        def forward(hidden_states, _orig=r.forward):
            with torch.autocast(device_type=device_type, enabled=False):
                return _orig(hidden_states)
        r.forward = forward


def _fp32_nll(model, ids, device) -> dict:
    """mean_nll in float32 (TF32 off)."""
    import torch

    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return mean_nll(model, ids, device)
    finally:
        torch.set_float32_matmul_precision(prec)


def train(shape: dict, hp: dict, train_ids, val_ids, device, *, autocast: bool, heldout_ids, log=print):
    """A freshly initialised Glm4MoeForCausalLM of ``shape`` trained with ``hp`` on random windows of ``train_ids``;
    returns (model, record, the initialised model's held-out NLL on ``heldout_ids``). ``val_ids``: validation tokens
    (not trained on), logged every ``hp['val_every']`` steps."""
    import torch
    from transformers import Glm4MoeForCausalLM

    torch.manual_seed(SEED)
    model = Glm4MoeForCausalLM(glm_config(shape)).to(device)
    before = _fp32_nll(model, heldout_ids, device)
    log(f"held-out perplexity before training {before['perplexity']:.1f} (uniform {demo_model.VOCAB})")
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": hp["weight_decay"]},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=hp["lr"], betas=tuple(hp["betas"]), eps=hp["eps"],
                            **({"fused": True} if device.type == "cuda" else {}))
    balance = demo_train.SelectionBalance(model, hp["bias_rate"])
    if autocast:
        _fp32_routers(balance, device.type)
    val = val_ids[: hp["val_windows"] * EVAL_SEQ]
    gen = torch.Generator().manual_seed(SEED + 1)
    n, seq, steps = len(train_ids), hp["seq_len"], hp["steps"]
    losses: list[float] = []
    curve: list[dict] = []
    total_loads = {L: torch.zeros_like(c) for L, c in balance.loads.items()}

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    t0 = time.monotonic()
    val_s = 0.0
    try:
        for step in range(steps):
            starts = torch.randint(0, n - seq - 1, (hp["batch"],), generator=gen)
            x = torch.stack([train_ids[s:s + seq] for s in starts.tolist()]).to(device, non_blocking=True)
            lr = demo_train.lr_at(step, steps=steps, lr=hp["lr"], min_lr=hp["min_lr"], warmup=hp["warmup"])
            for g in opt.param_groups:
                g["lr"] = lr
            balance.reset()
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp["clip"])
            opt.step()
            balance.update()  # auxiliary-loss-free balancing (DeepSeek-V3), the demo's rule
            for L, c in balance.loads.items():
                total_loads[L] += c
            losses.append(loss.item())
            last = step + 1 == steps
            if (step + 1) % hp["log_every"] == 0 or last:
                k = hp["log_every"] if not last or steps % hp["log_every"] == 0 else steps % hp["log_every"]
                point = {"step": step + 1, "lr": lr, "train_loss": round(sum(losses[-k:]) / k, 4),
                         "grad_norm": round(float(grad_norm), 4)}
                if (step + 1) % hp["val_every"] == 0 or last:
                    tv = time.monotonic()
                    point["val_loss"] = round(mean_nll(model, val, device, autocast=autocast)["nll"], 4)
                    val_s += time.monotonic() - tv
                curve.append(point)
                elapsed = time.monotonic() - t0
                log(f"step {step + 1}/{steps}  loss {point['train_loss']:.4f}"
                    + (f"  val {point['val_loss']:.4f}" if "val_loss" in point else "")
                    + f"  lr {lr:.2e}  {elapsed:.0f} s  ({elapsed / (step + 1):.3f} s/step)")
    finally:
        balance.remove()
    sync()
    wall = time.monotonic() - t0
    k = min(20, len(losses))
    tokens = steps * hp["batch"] * seq
    record = {
        **hp, "tokens_seen": tokens, "epochs": round(tokens / n, 3), "train_tokens": n,
        "optimizer": f"AdamW{tuple(hp['betas'])}" + (" fused" if device.type == "cuda" else ""),
        "schedule": "linear warmup, cosine decay to min_lr (fq.model.demo_train.lr_at)",
        "balancing": "e_score_correction_bias += bias_rate * sign(mean load - load) per step (fq.model.demo_train.SelectionBalance)",
        "precision": "bf16 autocast, TF32, routers float32" if autocast else "float32",
        "experts_implementation": model.config._experts_implementation,
        "train_wall_s": round(wall, 1), "validation_wall_s": round(val_s, 1),
        "s_per_step": round((wall - val_s) / steps, 4),
        "loss_first20": round(sum(losses[:k]) / k, 4), "loss_last20": round(sum(losses[-k:]) / k, 4),
        "curve": curve,
        "train_selections": {str(L): c.tolist() for L, c in sorted(total_loads.items())},
    }
    log(f"trained {steps} steps in {wall:.1f} s ({record['epochs']} epochs); "
        f"loss {record['loss_first20']} -> {record['loss_last20']}")
    return model, record, before


# -- export and evaluation -----------------------------------------------------------------------------
def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def export(model, model_dir: Path, work: Path, shard_bytes: int) -> None:
    """The checkpoint as transformers writes it: saved in float32, reloaded in bfloat16 (routers and their bias stay
    float32) and saved again in shards of at most ``shard_bytes``; the demo's tokenizer files beside it."""
    import torch
    from transformers import AutoModelForCausalLM

    f32 = work / "f32"
    model.to("cpu").save_pretrained(f32)
    m = AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16)
    m.save_pretrained(model_dir, max_shard_size=shard_bytes)
    shutil.rmtree(f32)
    mode = 0o666 & ~_umask()
    for shard in model_dir.glob("model-*.safetensors"):
        shard.chmod(mode)  # transformers writes the shards 0600; the side files get the umask's mode
    data = demo_model.data()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        atomic.write_bytes(model_dir / name, data[name])


def usage_summary(counts: dict[int, list[int]]) -> dict:
    """Per MoE layer: the selection counts and how even they are (min and max over the mean, coefficient of
    variation, entropy over log(experts))."""
    out = {}
    for L, c in sorted(counts.items()):
        mean = sum(c) / len(c)
        sd = math.sqrt(sum((x - mean) ** 2 for x in c) / len(c))
        p = [x / sum(c) for x in c if x]
        out[str(L)] = {"counts": list(c), "min_over_mean": round(min(c) / mean, 4), "max_over_mean": round(max(c) / mean, 4),
                       "cv": round(sd / mean, 4),
                       "entropy_ratio": round(-sum(q * math.log(q) for q in p) / math.log(len(c)), 4),
                       "unused": sum(1 for x in c if x == 0)}
    return out


def evaluate(model_dir: Path, held_ids, cal_ids, device, log=print) -> dict:
    """Held-out perplexity of the written checkpoint (bf16 weights computed in float32, TF32 off) over ``held_ids``,
    and its routers' selections over ``cal_ids`` (the calibration split's tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    balance = demo_train.SelectionBalance(model, 0.0)
    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        held = mean_nll(model, held_ids, device)
        cal = mean_nll(model, cal_ids, device, balance=balance)
        counts = {L: c.tolist() for L, c in sorted(balance.loads.items())}
    finally:
        balance.remove()
        torch.set_float32_matmul_precision(prec)
    log(f"held-out perplexity {held['perplexity']:.3f} over {held['predicted']} tokens (uniform {demo_model.VOCAB}); "
        f"calibration {cal['perplexity']:.3f}")
    return {"heldout": {**held, "uniform_perplexity": demo_model.VOCAB}, "calibration": cal,
            "usage": {"text": "calibration", "tokens": cal["tokens"], "seq_len": EVAL_SEQ,
                      "top_k": model.config.num_experts_per_tok, "layers": usage_summary(counts)}}


def device_info(device) -> dict:
    import torch

    info = {"device": str(device), **demo_train.machine(), "threads": torch.get_num_threads()}
    if device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(device)
        info["cuda"] = torch.version.cuda
    else:
        info["device_name"] = info["cpu"]
    return info


def run(out: str | Path, *, tiny: bool = False, device: str | None = None, steps: int | None = None,
        precision: str = "auto", threads: int | None = None, log=print) -> dict:
    import tokenizers
    import torch
    import transformers

    t_start = time.monotonic()
    out = Path(out)
    shape, hp = (TINY, dict(TINY_TRAIN)) if tiny else (FULL, dict(FULL_TRAIN))
    if steps is not None:
        hp["steps"] = steps
    if hp["steps"] < 1:
        raise FqError(f"--steps {hp['steps']}: expected at least 1")
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() and not tiny else "cpu"))
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise FqError("--device cuda: torch sees no CUDA device")
    autocast = {"auto": dev.type == "cuda", "bf16": True, "fp32": False}[precision]
    if threads is not None:
        torch.set_num_threads(threads)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    else:
        # with more than one thread the gradient into the routed experts' input (transformers' grouped_mm experts)
        # differs from run to run in the last bits; the deterministic kernels make the CPU run exact
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False  # exactness needs no NaN-filled buffers
    taken = [name for name in OUTPUTS if (out / name).exists()]
    if taken:
        raise FqError(f"{out}: already holds {', '.join(taken)}; use a new or empty directory")
    out.mkdir(parents=True, exist_ok=True)
    work = out / ".work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()

    texts = {s: demo_model.text(s) for s in demo_model.TEXT_SPLITS}
    tok = _tokenizer()
    ids = {s: torch.tensor(tok.encode(texts[s][:hp["train_chars"]] if s == "train" else texts[s]).ids, dtype=torch.int64)
           for s in demo_model.TEXT_SPLITS}
    train_ids, cal_ids, held_ids = ids["train"], ids["calibration"], ids["heldout"][:hp["eval_tokens"]]
    counts = parameter_counts(shape)
    log(f"{'tiny' if tiny else 'full'} shape: {counts['total']:,} parameters, {counts['active']:,} active; "
        f"{hp['steps']} steps of {hp['batch']} x {hp['seq_len']} tokens on {dev} "
        f"({'bf16 autocast' if autocast else 'float32'}); train split {len(train_ids):,} tokens")

    model, record, before = train(shape, hp, train_ids, cal_ids, dev, autocast=autocast, heldout_ids=held_ids, log=log)
    t_export = time.monotonic()
    model_dir = work / "model"
    export(model, model_dir, work, hp["shard_bytes"])
    del model
    export_s = time.monotonic() - t_export
    t_eval = time.monotonic()
    ev = evaluate(model_dir, held_ids, cal_ids[:hp["eval_tokens"]], dev, log=log)
    eval_s = time.monotonic() - t_eval
    demo_model.write_text(work / "text")
    doc = {
        "format": FORMAT,
        "script": "benchmarks/train_bench_moe.py" + (" --tiny" if tiny else ""),
        "seed": SEED,
        "architecture": "Glm4MoeForCausalLM",
        "config": shape,
        "parameters": counts,
        "corpus": {s: {"chars": len(texts[s]), "tokens": len(ids[s]), "sha256": canonical.sha256_hex(texts[s].encode("utf-8"))}
                   for s in demo_model.TEXT_SPLITS},
        "tokenizer": {"source": "fq/data/demo/tokenizer.json", "vocab": demo_model.VOCAB,
                      "sha256": canonical.sha256_hex(demo_model.data()["tokenizer.json"])},
        "training": record,
        "heldout_before": {**before, "uniform_perplexity": demo_model.VOCAB},
        "heldout": ev["heldout"],
        "calibration": ev["calibration"],
        "usage": ev["usage"],
        "wall_s": {"train": record["train_wall_s"], "export": round(export_s, 1), "evaluate": round(eval_s, 1),
                   "total": round(time.monotonic() - t_start, 1)},
        "machine": device_info(dev),
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }
    (work / "training.json").write_text(canonical.pretty(doc))
    for name in OUTPUTS:
        os.replace(work / name, out / name)
    shutil.rmtree(work)
    log(f"wrote {out / 'model'}, {out / 'text'}, {out / 'training.json'} ({doc['wall_s']['total']:.0f} s)")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write model/, text/ and training.json into (new or empty)")
    ap.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda when there is one (the tiny shape: cpu)")
    ap.add_argument("--steps", type=int, help=f"optimizer steps (default {FULL_TRAIN['steps']}; tiny {TINY_TRAIN['steps']})")
    ap.add_argument("--tiny", action="store_true", help="the tiny shape and schedule (CI: seconds on a CPU)")
    ap.add_argument("--precision", choices=("auto", "bf16", "fp32"), default="auto",
                    help="auto: bf16 autocast on CUDA, float32 on the CPU")
    ap.add_argument("--threads", type=int, help="torch CPU threads (default: torch's)")
    args = ap.parse_args(argv)
    try:
        run(args.out, tiny=args.tiny, device=args.device, steps=args.steps, precision=args.precision,
            threads=args.threads, log=lambda m: print(m, file=sys.stderr, flush=True))
    except FqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
