"""exllamav3 on a kit checkpoint as transformers saved it (unquantized), against transformers' own forward.

Separates what exllamav3 does with a family at given dims from what fq publishes: the checkpoint is built on the GPU
box by tests/familykit.py (seeded, so it is the source of the campaign of the same keys), loaded unquantized by both
runtimes, and run on one row of random ids at each length. Every MLA block's submodules are hooked, so a non-finite
result names the first module whose output was not finite. One case per process (a CUDA illegal memory access
poisons the context); prints one ``RESULT {json}`` line. ``--layers`` also compares, at the longest length, every
block's output and its attention's and MLP's outputs between the two runtimes (relative L2 difference, max abs
difference), so a disagreement is located at the first module where the two part.

    python3 benchmarks/exl3_source_probe.py NAME ARCH '{"kv_lora_rank": 64}' WORKDIR [--lengths 4 64] [--layers]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("arch")
    p.add_argument("keys", type=json.loads, help="config keys over the kit recipe's")
    p.add_argument("work", type=Path)
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 64])
    p.add_argument("--layers", action="store_true", help="compare every block, attention and MLP output")
    args = p.parse_args(argv)
    import exllamav3 as ex
    import familykit as fk
    from exl3kit import logit_agreement
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
    model = ex.Model.from_config(ex.Config.from_directory(str(src)))
    model.load("cuda:0")
    log: list = []
    hook(model, log)
    out = {"name": args.name, "arch": args.arch, "keys": args.keys}
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
