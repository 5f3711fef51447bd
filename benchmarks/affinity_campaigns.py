#!/usr/bin/env python3
"""Router-affinity weighted Hessians through the real workflow, at equal bytes (config calibration.weighting; issue 41,
item 4).

    .venv/bin/python benchmarks/affinity_campaigns.py OUT.json --work DIR [--weightings none,affinity-down,affinity]
        [--seeds 0,1,2] [--tokens 50176] [--seq-len 256] [--cores 2]

Per (weighting, seed): a demo campaign run by Snakemake as config/config.yaml sets it up (the demo model, calibrated on
its calibration split at the demo's 16 x 128 tokens, all-experts capture), with one experts-only base per K (k2, k3,
mul1: benchmarks/hessian_variants.py's products), ``encode.seed`` = seed and ``calibration.weighting`` = weighting,
no native points, twins or campaign eval. Every weighting encodes the same matrices at the same K and codebook, so a
seed's bases have the same bytes whatever the weighting (checked: the fragments' sizes). Then ``fq eval`` measures each
published base against the source on two texts, in windows of ``--seq-len``: ``heldout``, the first ``--tokens`` of
the demo's held-out split (the source of the calibration text), and ``outside``, the first ``--tokens`` of fq's own
Markdown docs at commit 166b015 (benchmarks/hessian_variants.py's outside text).

OUT.json: the settings, per (weighting, seed, base, text) the KL and its per-window values, the bases' bytes, and per
(weighting, base, text) against ``none``: the ratio of the mean KLs over seeds, the mean over seeds of the paired
difference with its standard error across seeds, and (one seed) the paired per-window standard error. Campaigns that
finished are reused from ``--work``, so a rerun only assembles OUT.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

RECIPE = {"format": "fq-cartridge/2", "name": "affinity", "description": "the K2 and K3 experts-only bases",
          "nodes": [{"name": "k2", "kind": "base", "K": 2, "codebook": "mul1"},
                    {"name": "k3", "kind": "base", "K": 3, "codebook": "mul1"}],
          "products": [{"name": "k2", "chain": ["k2"]}, {"name": "k3", "chain": ["k3"]}]}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def campaign(work: Path, weighting: str, seed: int, cores: int) -> Path:
    """The finished campaign directory of (weighting, seed): run by Snakemake unless its publication is verified."""
    d = work / f"{weighting}-seed{seed}"
    if (d / "campaign" / "published.verified").is_file():
        return d
    d.mkdir(parents=True, exist_ok=True)
    (d / "recipe.json").write_text(json.dumps(RECIPE))
    cfg = yaml.safe_load((ROOT / "config" / "config.yaml").read_text())
    cfg.update(out="campaign", recipe=str(d / "recipe.json"), compare_native=False, eval=None, block_size=8,
               usage=str(ROOT / "fq" / "data" / "demo" / "usage.json"))
    cfg["encode"]["seed"] = seed
    cfg["calibration"].update(weighting=weighting, compare_weight_only=False)
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    cmd = [sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(d), "--configfile",
           str(d / "config.yaml"), "--cores", str(cores)]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    t = time.perf_counter()
    with open(d / "snakemake.log", "w") as out:
        rc = subprocess.run(cmd, cwd=str(ROOT), env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"{d}: snakemake exited {rc}; see {d / 'snakemake.log'}")
    log(f"{d.name}: campaign {time.perf_counter() - t:.0f} s")
    return d


def outside_text(work: Path) -> Path:
    from benchmarks.hessian_variants import outside_text as text

    p = work / "outside.txt"
    if not p.is_file():
        p.write_text(text()[0], encoding="utf-8")
    return p


def evaluate(d: Path, name: str, text: Path, tokens: int, seq_len: int) -> dict:
    """``fq eval`` of the campaign's published products on ``text`` (cached as eval-NAME.json)."""
    out = d / f"eval-{name}.json"
    if not out.is_file():
        c = d / "campaign"
        cmd = [sys.executable, "-m", "fq", "eval", str(c / "published"), "--key", str(c / "signer.pub"), "--source",
               str(c / "demo-model"), "--text", str(text), "--campaign-json", str(c / "campaign.json"), "--tokens",
               str(tokens), "--seq-len", str(seq_len), "--no-state", "--out", str(out)]
        t = time.perf_counter()
        subprocess.run(cmd, cwd=str(ROOT), check=True, stdout=subprocess.DEVNULL)
        log(f"{d.name}: eval {name} {time.perf_counter() - t:.0f} s")
    return json.loads(out.read_text())["products"]


def base_bytes(d: Path, node: str) -> int:
    return sum(p.stat().st_size for p in (d / "campaign" / "fragments" / node).glob("*.safetensors"))


def mean(v):
    return sum(v) / len(v)


def se(v):
    m = mean(v)
    return (sum((x - m) ** 2 for x in v) / (len(v) - 1) / len(v)) ** 0.5 if len(v) > 1 else None


def compare(rows: dict, weighting: str, base: str, text: str, seeds: list[int]) -> dict:
    """``weighting`` against none on (base, text): ratio of the mean KLs over seeds, the paired difference per seed
    (mean over windows) with its SE across seeds, and each seed's paired per-window SE."""
    a = [rows[(weighting, s)][text][base]["kl_windows"] for s in seeds]
    b = [rows[("none", s)][text][base]["kl_windows"] for s in seeds]
    diffs = [[x - y for x, y in zip(u, v)] for u, v in zip(a, b)]
    per_seed = [mean(d) for d in diffs]
    return {"ratio": mean([mean(u) for u in a]) / mean([mean(v) for v in b]),
            "ratio_per_seed": [mean(u) / mean(v) for u, v in zip(a, b)],
            "diff": mean(per_seed), "diff_se_over_seeds": se(per_seed),
            "diff_se_windows_per_seed": [se(d) for d in diffs], "kl": mean([mean(u) for u in a]),
            "kl_none": mean([mean(v) for v in b])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--work", required=True)
    ap.add_argument("--weightings", default="none,affinity-down,affinity")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--tokens", type=int, default=50176)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--cores", type=int, default=2)
    args = ap.parse_args(argv)
    work = Path(args.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    weightings, seeds = args.weightings.split(","), [int(s) for s in args.seeds.split(",")]
    if "none" not in weightings:
        raise SystemExit("--weightings: none is the comparison; name it")
    texts = {"outside": outside_text(work)}
    rows, sizes = {}, {}
    for seed in seeds:
        for w in weightings:
            d = campaign(work, w, seed, args.cores)
            texts.setdefault("heldout", d / "campaign" / "demo-text" / "heldout.txt")
            rows[(w, seed)] = {t: evaluate(d, t, p, args.tokens, args.seq_len) for t, p in texts.items()}
            sizes[(w, seed)] = {n: base_bytes(d, n) for n in ("k2", "k3")}
    for (w, seed), s in sizes.items():
        if s != sizes[("none", seed)]:
            raise SystemExit(f"{w} seed {seed}: bases of {s} bytes, none's {sizes[('none', seed)]}: not equal bytes")
    doc = {"settings": vars(args), "recipe": RECIPE, "base_bytes": sizes[("none", seeds[0])],
           "runs": [{"weighting": w, "seed": s, "text": t, "base": b, "kl": r["kl"], "kl_se": r["kl_se"],
                     "kl_windows": r["kl_windows"]}
                    for (w, s), per in rows.items() for t, prods in per.items() for b, r in prods.items()],
           "against_none": [{"weighting": w, "base": b, "text": t, **compare(rows, w, b, t, seeds)}
                            for w in weightings if w != "none" for b in ("k2", "k3") for t in texts]}
    Path(args.out).write_text(json.dumps(doc, separators=(",", ":")) + "\n")
    for r in doc["against_none"]:
        seff = r["diff_se_over_seeds"]
        print(f"{r['weighting']:14s} {r['base']} {r['text']:8s} ratio {r['ratio']:.3f} (per seed "
              f"{', '.join(f'{x:.3f}' for x in r['ratio_per_seed'])}) diff {r['diff']:+.2e}"
              + (f" ± {seff:.1e}" if seff else "") + f"  KL {r['kl']:.6f} vs {r['kl_none']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
