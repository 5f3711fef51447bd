"""Forward throughput of chain products in exllamav3 (fq.runtime.exl3) against the base alone, on one GPU.

    python benchmarks/exl3_chain_speed.py CAMPAIGN_DIR [--json OUT]

CAMPAIGN_DIR holds published/, signer.pub and demo-model/ (as for tests/test_exl3_runtime.py). For each product
of the publication, and for each bare base twice (exllamav3's own fast paths; then every MoE layer forced onto the
per-expert path that chains use, a chain of one), it times:
- prefill: one forward of a fixed batch of held-out windows (4 x 128 tokens, no cache), tokens/s;
- single token: forwards of one token (no cache), the decode-shaped call, tokens/s.
Medians of repeated timed runs after warm-up, torch.cuda.synchronize around each.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WINDOWS, SEQ, REPEATS, SINGLE = 4, 128, 20, 64


def _time(fn, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(p, ids) -> dict:
    import torch

    batch = ids[:WINDOWS]

    def prefill():
        try:
            return p.forward(batch)
        except Exception:  # noqa: BLE001  a runtime without batched no-cache prefill: one window at a time
            return [p.forward(w[None]) for w in batch]

    def single():
        for t in range(SINGLE):
            p.forward(batch[:1, t:t + 1])

    with torch.no_grad():
        t_prefill = _time(prefill, REPEATS)
        t_single = _time(single, max(3, REPEATS // 4))
    return {"prefill_tokens_per_s": round(batch.numel() / t_prefill, 1), "prefill_ms": round(t_prefill * 1e3, 3),
            "single_token_per_s": round(SINGLE / t_single, 1), "single_token_ms": round(t_single * 1e3 / SINGLE, 4)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("campaign", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    import torch

    from fq.model.demo_model import text
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.evaluate import tokenize
    from fq.runtime.exl3 import load_exl3_product
    from fq.runtime.quality import token_windows

    root = args.campaign / "published"
    key = keys.load_public(args.campaign / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    ids_list, _ = tokenize(args.campaign / "demo-model", text("heldout"))
    ids = torch.stack([torch.as_tensor(w, dtype=torch.long)
                       for w in token_windows(ids_list, SEQ, WINDOWS * SEQ)]).to("cuda:0")
    rows = {}
    runs = [(name, False) for name in sorted(products)]
    runs += [(name, True) for name in sorted(products) if len(products[name]["chain"]) == 1]
    for name, forced in runs:
        label = f"{name} (per-expert path)" if forced else name
        with load_exl3_product(root / products[name]["file"], key, state=None, per_expert_everywhere=forced) as p:
            rows[label] = dict(measure(p, ids), chain=products[name]["chain"], bpw=products[name].get("bpw"),
                               chained_layers=sorted(p.chained))
        print(label, rows[label], flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "windows": WINDOWS, "seq": SEQ,
           "single_token_forwards": SINGLE, "repeats": REPEATS, "results": rows}
    text_out = json.dumps(out, indent=1, sort_keys=True) + "\n"
    if args.json:
        args.json.write_text(text_out)
    print(text_out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
