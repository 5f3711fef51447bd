"""Whole-model bases against exllamav3's own converter at the same total bits, both run by exllamav3 on the GPU.

For a published campaign (``CAMPAIGN``: published/, signer.pub, demo-model/): every bare base of the publication is
verified under the pinned key and staged from the verified bytes (``fq.runtime.load.verify_product``,
``fq.runtime.exl3.stage_base``), then loaded by exllamav3; exllamav3's converter (``python -m
exllamav3.conversion.convert_model``, default allocation, head 6 bits, optionally ``-hq``) quantizes the same source
at each ``--bits`` and at each fq whole-model base's own total bits (its ``quantization_config.bits``). Every model
runs the same held-out windows; KL(source || model) is measured per position against the source in transformers
(float32), with the standard error of the mean, and per fq base the paired per-position difference to the converter
at its bits (mean and standard error). Sizes are the bytes of each directory's ``*.safetensors``.

    python3 benchmarks/exl3_whole_model.py CAMPAIGN OUT [--bits 2 3 4] [--hq] [--tokens 2048] [--seq 256]

Writes ``OUT/whole_model.json`` and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch


def windows(campaign: Path, tokens: int, seq: int) -> torch.Tensor:
    from fq.model.demo_model import text
    from fq.runtime.evaluate import tokenize
    from fq.runtime.quality import token_windows

    ids, _ = tokenize(campaign / "demo-model", text("heldout"))
    return torch.stack([torch.as_tensor(w, dtype=torch.long) for w in token_windows(ids, seq, tokens)])


def source_logprobs(src: Path, ids: torch.Tensor) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).cuda().eval()
    with torch.no_grad():
        out = torch.cat([model(w[None].cuda()).logits.float() for w in ids])
    del model
    return out.log_softmax(-1)


def exl3_logprobs(ex, directory: Path, ids: torch.Tensor) -> torch.Tensor:
    model = ex.Model.from_config(ex.Config.from_directory(str(directory)))
    model.load("cuda:0")
    try:
        with torch.no_grad():
            out = torch.cat([model.forward(w[None], {"attn_mode": "flash_attn_nc"}).float().cuda() for w in ids])
    finally:
        model.unload()
    return out.log_softmax(-1)


def kl_per_position(ref: torch.Tensor, got: torch.Tensor) -> torch.Tensor:
    return (ref.exp() * (ref - got)).sum(-1).flatten().double()


def mean_se(x: torch.Tensor) -> tuple[float, float]:
    return float(x.mean()), float(x.std(unbiased=True) / math.sqrt(x.numel()))


def tensor_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def convert(src: Path, out: Path, work: Path, bits: float, hq: bool) -> Path:
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(out), "-w", str(work),
           "-b", f"{bits:g}"] + (["-hq"] if hq else [])
    subprocess.run(cmd, check=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("campaign", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--bits", type=float, nargs="*", default=[2.0, 3.0, 4.0])
    p.add_argument("--hq", action="store_true")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    import exllamav3 as ex
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.exl3 import stage_base
    from fq.runtime.load import verify_product

    args.out.mkdir(parents=True, exist_ok=True)
    root, src = args.campaign / "published", args.campaign / "demo-model"
    key = keys.load_public(args.campaign / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    ids = windows(args.campaign, args.tokens, args.seq)
    ref = source_logprobs(src, ids)
    rows, kls = [], {}
    for name in sorted(n for n, e in products.items() if len(e["chain"]) == 1):
        vc = verify_product(root / products[name]["file"], key)
        with tempfile.TemporaryDirectory() as tmp:
            stage_base(vc, Path(tmp))
            kls[f"fq {name}"] = kl_per_position(ref, exl3_logprobs(ex, Path(tmp), ids))
        qc = json.loads((root / "base" / name / "config.json").read_text())["quantization_config"]
        rows.append({"model": f"fq {name}", "bits": qc["bits"], "expert_bits": qc.get("expert_bits", qc["bits"]),
                     "bytes": tensor_bytes(root / "base" / name), "whole_model": "linear_bits" in qc})
    targets = sorted(set(args.bits) | {r["bits"] for r in rows if r["whole_model"]})
    for bits in targets:
        scratch = Path(tempfile.mkdtemp(prefix=f"exl3-b{bits:g}-"))  # converted models stay off OUT
        d = convert(src, scratch / "model", scratch / "work", bits, args.hq)
        kls[f"exllamav3 -b {bits:g}"] = kl_per_position(ref, exl3_logprobs(ex, d, ids))
        rows.append({"model": f"exllamav3 -b {bits:g}{' -hq' if args.hq else ''}", "bits": bits, "bytes": tensor_bytes(d),
                     "whole_model": True})
    for r in rows:
        r["kl"], r["kl_se"] = mean_se(kls[r["model"].removesuffix(" -hq")])
        if r["model"].startswith("fq ") and r["whole_model"]:
            other = f"exllamav3 -b {r['bits']:g}"
            diff = kls[r["model"]] - kls[other]
            r["vs_exllamav3"] = {"model": other, "kl_diff": mean_se(diff)[0], "kl_diff_se": mean_se(diff)[1],
                                 "bytes_ratio": r["bytes"] / next(x["bytes"] for x in rows if x["model"].startswith(other))}
    doc = {"positions": int(ids.numel()), "seq": args.seq, "hq": args.hq, "rows": rows}
    (args.out / "whole_model.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print("| model | bits (whole model) | tensor bytes | KL vs source ± SE | paired ΔKL vs exllamav3 ± SE | size ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        v = r.get("vs_exllamav3")
        vs = f"{v['kl_diff']:+.5f} ± {v['kl_diff_se']:.5f}" if v else ""
        ratio = f"{v['bytes_ratio']:.4f}" if v else ""
        print(f"| {r['model']} | {r['bits']} | {r['bytes']:,} | {r['kl']:.5f} ± {r['kl_se']:.5f} | {vs} | {ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
