"""The embedded demo model: a small, seeded MoE checkpoint in Hugging Face layout.

DeepSeek-V3 naming (what GLM-5 uses): 3 layers, layer 0 dense, layers 1-2 MoE with 8 routed experts
(gate/up 128x256, down 256x128) plus a shared expert and a router. bf16 weights with the statistics
that make quantization non-trivial: heavy tails (a Student-t-like cube of Gaussians), log-normal
channel scales on both sides, and a few outlier input channels. Four shards chosen to exercise the
planner: one skeleton-only shard (embeddings, the dense layer, final norm), and a shard whose experts
span layers 1 and 2, which the demo's window partition (1 | 2) puts in different windows.
Everything is a pure function of the seed, so the bytes (and their sha256) are reproducible.
"""
from __future__ import annotations

import argparse
import functools
import io
from pathlib import Path

import torch
from safetensors.torch import save

from fq import atomic, canonical

HIDDEN = 256
MOE_INTERMEDIATE = 128
DENSE_INTERMEDIATE = 512
N_EXPERTS = 8
N_LAYERS = 3
FIRST_DENSE = 1
VOCAB = 512
SEED = 20261129

CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": HIDDEN,
    "intermediate_size": DENSE_INTERMEDIATE,
    "moe_intermediate_size": MOE_INTERMEDIATE,
    "n_routed_experts": N_EXPERTS,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": FIRST_DENSE,
    "moe_layer_freq": 1,
    "num_hidden_layers": N_LAYERS,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": VOCAB,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
    "fq_demo": "synthetic weights; seed %d" % SEED,
}


def _weight(gen: torch.Generator, out_f: int, in_f: int, std: float = 0.02) -> torch.Tensor:
    w = torch.randn(out_f, in_f, generator=gen)
    w = w * w.abs().pow(0.6)  # heavier tails than Gaussian
    rows = torch.exp(0.35 * torch.randn(out_f, 1, generator=gen))
    cols = torch.exp(0.35 * torch.randn(1, in_f, generator=gen))
    w = w * rows * cols
    hot = torch.randint(0, in_f, (max(1, in_f // 64),), generator=gen)
    w[:, hot] *= 4.0  # a few outlier input channels, as activations-facing weights have
    return (w / w.std() * std).to(torch.bfloat16)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(SEED)
    t: dict[str, torch.Tensor] = {}
    t["model.embed_tokens.weight"] = _weight(gen, VOCAB, HIDDEN)
    for L in range(N_LAYERS):
        p = f"model.layers.{L}"
        t[f"{p}.input_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        t[f"{p}.post_attention_layernorm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
        for proj in ("q", "k", "v", "o"):
            t[f"{p}.self_attn.{proj}_proj.weight"] = _weight(gen, HIDDEN, HIDDEN)
        if L < FIRST_DENSE:
            t[f"{p}.mlp.gate_proj.weight"] = _weight(gen, DENSE_INTERMEDIATE, HIDDEN)
            t[f"{p}.mlp.up_proj.weight"] = _weight(gen, DENSE_INTERMEDIATE, HIDDEN)
            t[f"{p}.mlp.down_proj.weight"] = _weight(gen, HIDDEN, DENSE_INTERMEDIATE)
            continue
        t[f"{p}.mlp.gate.weight"] = _weight(gen, N_EXPERTS, HIDDEN)
        for proj, shape in (("gate", (MOE_INTERMEDIATE, HIDDEN)), ("up", (MOE_INTERMEDIATE, HIDDEN)),
                            ("down", (HIDDEN, MOE_INTERMEDIATE))):
            t[f"{p}.mlp.shared_experts.{proj}_proj.weight"] = _weight(gen, *shape)
        for e in range(N_EXPERTS):
            for proj, shape in (("gate", (MOE_INTERMEDIATE, HIDDEN)), ("up", (MOE_INTERMEDIATE, HIDDEN)),
                                ("down", (HIDDEN, MOE_INTERMEDIATE))):
                t[f"{p}.mlp.experts.{e}.{proj}_proj.weight"] = _weight(gen, *shape)
    t["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    t["lm_head.weight"] = _weight(gen, VOCAB, HIDDEN)
    return t


def _shard_of(name: str) -> int:
    """1: skeleton only (embeddings, dense layer 0, final norm); 2: layer 1 but its experts 6-7;
    3: layer 1 experts 6-7 + layer 2 experts 0-3 (straddles the 1 | 2 window boundary);
    4: the rest of layer 2 and lm_head."""
    if not name.startswith("model.layers.") or name.startswith("model.layers.0."):
        return 4 if name == "lm_head.weight" else 1
    layer = int(name.split(".")[2])
    expert = int(name.split(".")[5]) if ".mlp.experts." in name else None
    if layer == 1:
        return 3 if expert is not None and expert >= 6 else 2
    return 3 if expert is not None and expert < 4 else 4


SHARDS = 4


def shard_name(i: int) -> str:
    return f"model-{i:05d}-of-{SHARDS:05d}.safetensors"


@functools.lru_cache(maxsize=1)
def files() -> dict[str, bytes]:
    """Every file of the checkpoint, name -> bytes (deterministic)."""
    tensors = _tensors()
    by_shard: dict[int, dict[str, torch.Tensor]] = {i: {} for i in range(1, SHARDS + 1)}
    for name, t in tensors.items():
        by_shard[_shard_of(name)][name] = t
    out = {shard_name(i): save(ts, metadata={"format": "pt"}) for i, ts in by_shard.items()}
    weight_map = {name: shard_name(_shard_of(name)) for name in sorted(tensors)}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    out["model.safetensors.index.json"] = canonical.pretty({"metadata": {"total_size": total}, "weight_map": weight_map}).encode()
    out["config.json"] = canonical.pretty(CONFIG).encode()
    return out


def usage() -> dict:
    """fq-expert-usage/1 statistics for the hot-expert stage: Zipf-like router counts, seeded."""
    gen = torch.Generator().manual_seed(SEED + 1)
    layers = {}
    for L in range(FIRST_DENSE, N_LAYERS):
        perm = torch.randperm(N_EXPERTS, generator=gen).tolist()
        counts = [0] * N_EXPERTS
        for rank, e in enumerate(perm):
            counts[e] = int(10000 / (rank + 1))
        layers[str(L)] = counts
    return {"format": "fq-expert-usage/1", "description": "synthetic router counts of the fq demo model", "layers": layers}


def metadata() -> tuple[dict, dict, dict[str, int]]:
    """(config, index, shard sizes) without writing anything: what a campaign plans from."""
    f = files()
    sizes = {name: len(data) for name, data in f.items() if name.endswith(".safetensors")}
    return (canonical.loads(f["config.json"]), canonical.loads(f["model.safetensors.index.json"]), sizes)


def write(out_dir: str | Path) -> Path:
    """Write the checkpoint (and expert_usage.json beside it) atomically; returns the directory."""
    out_dir = Path(out_dir)
    for name, data in files().items():
        atomic.write_bytes(out_dir / name, data)
    atomic.write_bytes(out_dir / "expert_usage.json", canonical.pretty(usage()).encode())
    return out_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write the checkpoint into")
    args = ap.parse_args(argv)
    d = write(args.out)
    print(f"demo model written to {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
