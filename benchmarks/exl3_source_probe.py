"""exllamav3 on a kit checkpoint as transformers saved it (unquantized), against transformers' own forward.

Separates what exllamav3 does with a family at given dims from what fq publishes: the checkpoint is built on the GPU
box by tests/familykit.py (seeded, so it is the source of the campaign of the same keys), loaded unquantized by both
runtimes, and run on one row of random ids at each length. Every MLA block's submodules are hooked, so a non-finite
result names the first module whose output was not finite. One case per process (a CUDA illegal memory access
poisons the context); prints one ``RESULT {json}`` line.

    python3 benchmarks/exl3_source_probe.py NAME ARCH '{"kv_lora_rank": 64}' WORKDIR [--lengths 4 64]
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
            def forward(*a, _orig=mod.forward, _key=key, **kw):
                y = _orig(*a, **kw)
                t = y[0] if isinstance(y, tuple) else y
                if isinstance(t, torch.Tensor):
                    log.append((_key, bool(torch.isfinite(t).all())))
                return y
            mod.forward = forward


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("name")
    p.add_argument("arch")
    p.add_argument("keys", type=json.loads, help="config keys over the kit recipe's")
    p.add_argument("work", type=Path)
    p.add_argument("--lengths", type=int, nargs="+", default=[4, 64])
    args = p.parse_args(argv)
    import exllamav3 as ex
    import familykit as fk
    from exl3kit import logit_agreement
    from transformers import AutoModelForCausalLM

    src = fk.build(args.arch, args.work / args.name, keys=args.keys, extra_config=fk.PUBLISHED_KEYS.get(args.arch))
    ids = {n: torch.randint(0, fk.VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in args.lengths}
    ref_model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        ref = {n: ref_model(t.cuda()).logits.float()[0] for n, t in ids.items()}
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
    print("RESULT", json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
