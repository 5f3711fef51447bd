"""Whole-model bases against exllamav3's own converter at the same total bits, both run by exllamav3 on the GPU.

For a published campaign (``CAMPAIGN``: published/, signer.pub, the source checkpoint as source/ or demo-model/, and
optionally the campaign's calibration tokens as calibration-tokens.safetensors; the held-out text is the demo's, so the
source must use the demo tokenizer: the demo model, or benchmarks/second_family_campaign.py's Qwen3-MoE): every bare base of the publication is verified under the
pinned key and staged from the verified bytes (``fq.runtime.load.verify_product``, ``fq.runtime.exl3.stage_base``),
then loaded by exllamav3. exllamav3's converter (``python -m exllamav3.conversion.convert_model``) quantizes the same
source once per fq whole-model base and per ``--reference``:

- ``recipe``: fq's own allocation given to the converter as a per-tensor recipe (``-rcp``: experts, attention, shared
  experts, dense MLP and head at the base's bits), calibrated on the campaign's own tokens (``-cd``) when present:
  equal bytes, so the difference is the quantizer's alone;
- ``default``: ``-b`` the base's total bits, the converter's own allocation and its bundled calibration corpus;
- ``hq``: the same with ``-hq`` (its floors can overshoot ``-b``: the size ratio says by how much).

Every model runs the same held-out windows; KL(source || model) is measured per position against the source in
transformers (float32), with the standard error of the mean, and per fq base the paired per-position difference to
each reference at its bits (mean and standard error). Sizes are the bytes of each directory's ``*.safetensors``.

    python3 benchmarks/exl3_whole_model.py CAMPAIGN OUT [--reference recipe default hq] [--tokens 2048] [--seq 256]

Writes ``OUT/whole_model.json`` (after every conversion, so a run cut short keeps what it measured) and prints a
markdown table.
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


def source_dir(campaign: Path) -> Path:
    return campaign / "source" if (campaign / "source").is_dir() else campaign / "demo-model"


def windows(campaign: Path, tokens: int, seq: int) -> torch.Tensor:
    from fq.model.demo_model import text
    from fq.runtime.evaluate import tokenize
    from fq.runtime.quality import token_windows

    ids, _ = tokenize(source_dir(campaign), text("heldout"))
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


CLASS_PATTERNS = {  # exllamav3's tensor keys per fq skeleton class; later entries override earlier ones
    "dense": "model.layers.*.mlp.*_proj",
    "shared": "model.layers.*.mlp.shared_experts.*",
    "experts": "model.layers.*.mlp.experts.*",
    "attention": "model.layers.*.self_attn.*",
}


def recipe_yaml(qc: dict, path: Path) -> Path:
    """fq's allocation (a whole-model base's quantization_config) as an exllamav3 per-tensor recipe."""
    import yaml

    bits = dict(qc["linear_bits"], experts=qc["expert_bits"])
    # only the classes the base names: the converter refuses a pattern that matches no tensor (Qwen3-MoE has no
    # shared experts); a class the base keeps in bf16 is then left to the converter's budget
    tensors = {CLASS_PATTERNS[c]: int(bits[c]) for c in CLASS_PATTERNS if c in bits}
    path.write_text(yaml.safe_dump({"target_bpw": qc["bits"], "head_bits": int(qc["linear_bits"].get("head", 16)),
                                    "tensors": tensors}, sort_keys=False))
    return path


def exl3_cal_data(campaign: Path, scratch: Path) -> list[str]:
    """The campaign's calibration tokens (fq's token file) as the converter's -cd file, with its rows and columns."""
    f = campaign / "calibration-tokens.safetensors"
    if not f.is_file():
        return []
    from safetensors.torch import load_file, save_file

    ids = load_file(str(f))["tokens"]
    save_file({"input_ids": ids.to(torch.int64).contiguous()}, str(scratch / "cal.safetensors"))
    return ["-cd", str(scratch / "cal.safetensors"), "-cr", str(ids.shape[0]), "-cc", str(ids.shape[1])]


def converter_source(src: Path, scratch: Path) -> Path:
    """The source as the converter reads it: the same weight files (linked), and config.json with the keys exllamav3
    reads under another spelling than transformers 5.x saves (the family's ``Exl3Needs.derived_keys``, which fq's
    bases derive too: Qwen3-MoE's ``num_experts``, saved as ``num_local_experts``). No key to add: ``src`` itself."""
    from fq.model import families

    cfg = json.loads((src / "config.json").read_text())
    extra = families.for_config(cfg, str(src / "config.json")).exl3_needs.derived_keys(cfg)
    if not extra:
        return src
    d = scratch / "source"
    d.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (d / f.name).is_symlink():  # linked by an earlier call (--scratch)
            (d / f.name).symlink_to(f.resolve())
    (d / "config.json").write_text(json.dumps({**cfg, **extra}, indent=2))
    return d


def convert(src: Path, out: Path, work: Path, args: list[str], log: Path) -> Path:
    cmd = [sys.executable, "-m", "exllamav3.conversion.convert_model", "-i", str(src), "-o", str(out), "-w", str(work),
           *args]
    with open(log, "a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        subprocess.run(cmd, check=True, stdout=f, stderr=subprocess.STDOUT)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("campaign", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--reference", nargs="+", choices=["recipe", "default", "hq"], default=["recipe", "default", "hq"])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args(argv)
    import exllamav3 as ex
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.exl3 import stage_base
    from fq.runtime.load import verify_product

    args.out.mkdir(parents=True, exist_ok=True)
    root, src = args.campaign / "published", source_dir(args.campaign)
    key = keys.load_public(args.campaign / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    ids = windows(args.campaign, args.tokens, args.seq)
    ref = source_logprobs(src, ids)
    rows, kls, qcs = [], {}, {}
    for name in sorted(n for n, e in products.items() if len(e["chain"]) == 1):
        vc = verify_product(root / products[name]["file"], key)
        with tempfile.TemporaryDirectory() as tmp:
            stage_base(vc, Path(tmp))
            kls[f"fq {name}"] = kl_per_position(ref, exl3_logprobs(ex, Path(tmp), ids))
        qc = qcs[name] = json.loads((root / "base" / name / "config.json").read_text())["quantization_config"]
        rows.append({"model": f"fq {name}", "bits": qc["bits"], "expert_bits": qc.get("expert_bits", qc["bits"]),
                     "bytes": tensor_bytes(root / "base" / name), "whole_model": "linear_bits" in qc})
        rows[-1]["kl"], rows[-1]["kl_se"] = mean_se(kls[rows[-1]["model"]])
    doc = {"positions": int(ids.numel()), "seq": args.seq, "rows": rows}
    scratch = Path(tempfile.mkdtemp(prefix="exl3-ref-"))  # converted models stay off OUT
    cal = exl3_cal_data(args.campaign, scratch)
    conv_src = converter_source(src, scratch)
    log = args.out / "convert.log"
    done_default: dict[float, str] = {}
    for ref_kind in args.reference:
        for name in sorted(n for n, qc in qcs.items() if "linear_bits" in qc):
            qc = qcs[name]
            if ref_kind == "recipe":
                label = f"exllamav3 -rcp {name}"
                cargs = ["-rcp", str(recipe_yaml(qc, scratch / f"{name}.yaml")), "-b", f"{qc['bits']:g}", *cal]
            else:
                label = f"exllamav3 -b {qc['bits']:g}" + (" -hq" if ref_kind == "hq" else "")
                cargs = ["-b", f"{qc['bits']:g}"] + (["-hq"] if ref_kind == "hq" else [])
            if label not in kls:
                d = convert(conv_src, scratch / label.replace(" ", "_"), scratch / (label.replace(" ", "_") + "-work"),
                            cargs, log)
                kls[label] = kl_per_position(ref, exl3_logprobs(ex, d, ids))
                k, se = mean_se(kls[label])
                rows.append({"model": label, "reference": ref_kind, "bits": qc["bits"], "bytes": tensor_bytes(d),
                             "whole_model": True, "kl": k, "kl_se": se})
            other = next(r for r in rows if r["model"] == label)
            diff = kls[f"fq {name}"] - kls[label]
            mine = next(r for r in rows if r["model"] == f"fq {name}")
            mine.setdefault("vs_exllamav3", {})[ref_kind] = {
                "model": label, "kl_diff": mean_se(diff)[0], "kl_diff_se": mean_se(diff)[1],
                "bytes_ratio": mine["bytes"] / other["bytes"]}
            (args.out / "whole_model.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    (args.out / "whole_model.json").write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    print("| model | bits (whole model) | tensor bytes | KL vs source ± SE | vs exllamav3: paired ΔKL ± SE (size ratio) |")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        vs = "; ".join(f"{k}: {v['kl_diff']:+.5f} ± {v['kl_diff_se']:.5f} ({v['bytes_ratio']:.4f})"
                       for k, v in r.get("vs_exllamav3", {}).items())
        print(f"| {r['model']} | {r['bits']} | {r['bytes']:,} | {r['kl']:.5f} ± {r['kl_se']:.5f} | {vs} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
