"""Is exllamav3's greedy generation of a product repeatable? (issue 26: k2.w4.r1 diverged from its exact
reconstruction at batch 1 in some H200 runs and not in others, on the same prompts.)

    python benchmarks/exl3_generate_repeat.py CAMPAIGN [--products k2.w4.r1 k2.r1] [--repeats 4] [--json OUT]

Loads each product once (verified, KV cache of 4096 tokens) and generates the test's 8 prompts x 32 tokens at batch 1
REPEATS times, each repeat through a fresh Generator (no prefix pages shared between repeats). Reports, per product,
how many prompts gave different tokens between repeats and the largest logit difference between repeats over the
steps before any token differed: 0.0 means bit-identical runs. The JSON keeps the first repeat's tokens, so that
runs in separate processes can be compared (benchmarks/exl3_chain_device.sh's repeat step runs three).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    import torch

    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.exl3 import load_exl3_product
    from tests.test_exl3_runtime import NEW_TOKENS, _prompts

    ap = argparse.ArgumentParser()
    ap.add_argument("campaign", type=Path)
    ap.add_argument("--products", nargs="*", default=["k2.w4.r1", "k2.r1"])
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    root = a.campaign / "published"
    key = keys.load_public(a.campaign / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    prompts = _prompts(a.campaign)
    results = {}
    for name in a.products:
        runs = []
        with load_exl3_product(root / products[name]["file"], key, state=None, cache_tokens=4096) as p:
            for _ in range(a.repeats):
                p._generator = None  # a fresh Generator: nothing cached from the previous repeat
                runs.append([p.generate([q], NEW_TOKENS, logits=True)[0] for q in prompts])
        differ, max_diff = 0, 0.0
        for i in range(len(prompts)):
            toks = [r[i]["tokens"] for r in runs]
            differ += any(t != toks[0] for t in toks)
            same = next((j for j in range(NEW_TOKENS) if any(t[j] != toks[0][j] for t in toks)), NEW_TOKENS)
            for r in runs[1:]:
                d = (r[i]["logits"][:same + 1] - runs[0][i]["logits"][:same + 1]).abs().max().item()
                max_diff = max(max_diff, d)
        results[name] = {"prompts": len(prompts), "repeats": a.repeats, "prompts_with_differing_tokens": differ,
                         "max_logit_diff_between_repeats": max_diff,
                         "tokens": [r["tokens"] for r in runs[0]]}  # to compare processes with each other
        print(name, {k: v for k, v in results[name].items() if k != "tokens"}, flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
