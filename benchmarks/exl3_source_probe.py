"""exllamav3 on a kit checkpoint as transformers saved it (unquantized), against transformers' own forward.

Separates what exllamav3 does with a family at given dims from what fq publishes: the checkpoint is built on the GPU
box by tests/kits/familykit.py (seeded, so it is the source of the campaign of the same keys), loaded unquantized by
both runtimes, and run on one row of random ids at each length. Every MLA block's submodules are hooked, so a non-finite
result names the first module whose output was not finite. One case per process (a CUDA illegal memory access
poisons the context); prints one ``RESULT {json}`` line. ``--layers`` also compares, at the longest length, every
block's output and its attention's and MLP's outputs between the two runtimes (relative L2 difference, max abs
difference), so a disagreement is located at the first module where the two part.

gpt-oss as transformers saves it (16-bit fused ``mlp.experts.gate_up_proj`` with gate and up interleaved, and the
experts' biases) is given to exllamav3 per expert (``per_expert_copy``): exllamav3 1.6.5 reads that fused 16-bit
layout through the loader it has for Qwen3-VL-MoE (``modules/linear.py``), which takes gate and up as the two halves
and drops the biases (KL about 0.06 on the CPU with both faults simulated); per expert it reads them as transformers
does. fq's bases store each expert apart, so they never meet that loader; ``--as-saved`` probes it anyway.

    python3 benchmarks/exl3_source_probe.py NAME ARCH '{"kv_lora_rank": 64}' WORKDIR [--lengths 4 64] [--layers]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: fq, tests.kits

SUBMODULES = ("q_a_proj", "q_a_layernorm", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "o_proj",
              "idx_wq_b", "idx_wk", "idx_k_norm", "idx_weights")


def hook(model, log: list) -> None:
    """Record (module key, finite) after every block, its attention and MLP, and the attention's projections."""
    from exllamav3.modules.transformer import TransformerBlock

    for m in model.modules:
        subs = [(m.key, m)]
        if isinstance(m, TransformerBlock):
            subs += [(f"{m.key}.attn", m.attn), (f"{m.key}.mlp", m.mlp)]
            subs += [(f"{m.key}.attn.{n}", getattr(m.attn, n)) for n in SUBMODULES if getattr(m.attn, n, None)]
        for key, mod in subs:
            on_output(mod, lambda t, _key=key: log.append((_key, bool(torch.isfinite(t).all()))))


def on_output(mod, fn) -> None:
    """Wrap an exllamav3 module's forward so that ``fn`` sees its output tensor (the first of a tuple)."""
    def forward(*a, _orig=mod.forward, **kw):
        y = _orig(*a, **kw)
        t = y[0] if isinstance(y, tuple) else y
        if isinstance(t, torch.Tensor):
            fn(t)
        return y
    mod.forward = forward


def capture_exl3(model, store: dict) -> None:
    """Keep every block's output and its attention's and MLP's (keys as transformers names its modules)."""
    from exllamav3.modules.transformer import TransformerBlock

    for m in model.modules:
        if not isinstance(m, TransformerBlock):
            continue
        for key, mod in ((m.key, m), (f"{m.key}.self_attn", m.attn), (f"{m.key}.mlp", m.mlp)):
            if mod is not None:
                on_output(mod, lambda t, _key=key: store.__setitem__(_key, flat(t)))


def flat(t: torch.Tensor) -> torch.Tensor:
    """A captured output as float32 rows of its last dimension, detached from the runtime's buffers."""
    return t.detach().float().reshape(-1, t.shape[-1]).clone()


def capture_hf(model, store: dict) -> list:
    """The same points in transformers (forward hooks on each decoder layer, its self_attn and mlp)."""
    handles = []
    for name, mod in model.named_modules():
        parts = name.split(".")
        if (len(parts) >= 3 and parts[-2] == "layers" and parts[-1].isdigit()) or \
                (len(parts) >= 4 and parts[-3] == "layers" and parts[-1] in ("self_attn", "mlp")):
            key = name[name.index("layers") - len("model."):] if "model.layers" in name else name
            def hook(_m, _a, y, _key=key):
                store[_key] = flat(y[0] if isinstance(y, tuple) else y)
            handles.append(mod.register_forward_hook(hook))
    return handles


def compare(ref: dict, got: dict) -> list[dict]:
    rows = []
    for key in ref:
        if key in got and got[key].shape == ref[key].shape:
            a, b = ref[key].cuda(), got[key].cuda()
            rows.append({"module": key, "rel_l2": float((a - b).norm() / a.norm().clamp_min(1e-30)),
                         "max_abs": float((a - b).abs().max())})
    return rows


def per_expert_copy(src: Path, dst: Path) -> Path:
    """``src`` with every fused 16-bit expert tensor of gpt-oss (``mlp.experts.gate_up_proj`` (E, in, 2·I), gate and
    up the even and odd output columns, ``down_proj`` (E, I, hidden), and their ``_bias``) written per expert as
    ``mlp.experts.{e}.{gate,up,down}_proj.{weight,bias}`` (torch (out, in)); the other tensors and files as they are."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text()) if index_path.is_file() else None
    for shard in sorted(dst.glob("*.safetensors")):
        tensors, out = load_file(shard), {}
        for name, t in tensors.items():
            stem, _, kind = name.rpartition(".experts.")
            if not stem or kind not in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"):
                out[name] = t
                continue
            bias = kind.endswith("_bias")
            for e in range(t.shape[0]):
                parts = {"down_proj": t[e]} if kind.startswith("down") else \
                    {"gate_proj": t[e][..., 0::2], "up_proj": t[e][..., 1::2]}
                for proj, w in parts.items():
                    out[f"{stem}.experts.{e}.{proj}.{'bias' if bias else 'weight'}"] = \
                        w.contiguous() if bias else w.t().contiguous()
        save_file(out, str(shard), metadata={"format": "pt"})
        if index is not None:
            wm = index["weight_map"]
            for name in tensors.keys() - out.keys():
                del wm[name]
            wm.update({name: shard.name for name in out.keys() - tensors.keys()})
    if index is not None:
        index_path.write_text(json.dumps(index, indent=2))
    return dst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("arch")
    p.add_argument("keys", type=json.loads, help="config keys over the kit recipe's")
    p.add_argument("work", type=Path)
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 64])
    p.add_argument("--layers", action="store_true", help="compare every block, attention and MLP output")
    p.add_argument("--as-saved", action="store_true", help="gpt-oss: give exllamav3 the fused 16-bit experts as "
                   "transformers saved them, not per expert")
    args = p.parse_args(argv)
    import exllamav3 as ex
    from tests.kits import familykit as fk
    from tests.kits.exl3kit import logit_agreement
    from transformers import AutoModelForCausalLM

    src = fk.build(args.arch, args.work / args.name, keys=args.keys, extra_config=fk.PUBLISHED_KEYS.get(args.arch))
    ids = {n: torch.randint(0, fk.VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in args.lengths}
    ref_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    hf_store: dict = {}
    with torch.no_grad():
        ref = {n: ref_model(t.cuda()).logits.float()[0] for n, t in ids.items()}
        if args.layers:
            handles = capture_hf(ref_model, hf_store)
            ref_model(ids[max(ids)].cuda())
            for h in handles:
                h.remove()
    del ref_model
    if args.arch == "GptOssForCausalLM" and not args.as_saved:
        src = per_expert_copy(src, src.with_name(src.name + "-per-expert"))
    model = ex.Model.from_config(ex.Config.from_directory(str(src)))
    model.load("cuda:0")
    log: list = []
    hook(model, log)
    out = {"name": args.name, "arch": args.arch, "keys": args.keys, "as_saved": args.as_saved}
    for n, t in ids.items():
        log.clear()
        got = model.forward(t.cuda(), {"attn_mode": "flash_attn_nc"}).float()[0]
        out[f"T{n}"] = {"finite": bool(torch.isfinite(got).all()), **logit_agreement(ref[n], got),
                        "first_nonfinite": next((k for k, ok in log if not ok), None)}
    if args.layers:
        ex_store: dict = {}
        capture_exl3(model, ex_store)
        model.forward(ids[max(ids)].cuda(), {"attn_mode": "flash_attn_nc"})
        out["layers"] = compare(hf_store, ex_store)
        out["layers_unmatched"] = sorted(set(hf_store) ^ set(ex_store))
        for r in out["layers"]:
            print(f"  {r['module']:32s} rel {r['rel_l2']:.2e}  max {r['max_abs']:.3e}", flush=True)
    print("RESULT", json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
