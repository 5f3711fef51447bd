"""Published campaigns of every family exllamav3 1.6.5 loads, for tests/test_exl3_families.py on the GPU box.

For each family of the registry whose tiny checkpoint (tests/kits/familykit.py: built and saved by transformers) a base
of exllamav3 would load, one Snakemake campaign on the CPU (``familykit.campaign_config``: one K3 mul1 base, one
window), weight-only; plus the published layouts
(Kimi-K2: DeepSeek-V3's architecture in FP8 with 128x128 block scales, calibrated; Qwen3-MoE, GLM-4.5 and MiniMax-M2
in FP8; Qwen3.5-MoE's vision-language checkpoint with its experts fused per layer, as Qwen publishes it; DeepSeek-V4
as DeepSeek publishes it, ``deepseek_v4-release``: its own names, FP4 experts, FP8 linears with ue8m0 scales); and gpt-oss
at dims that are not multiples of 128 (``familykit.PADDED_KEYS``: hidden 160, intermediate 96, the real models' 2880 in
miniature), whose experts EXL3 stores zero-padded to 256 and 128 (fq.codec.shape), bf16 weight-only
(``gpt_oss-padded``) and in its published MXFP4 layout, calibrated (``gpt_oss-padded-mxfp4``: LDLQ, H zero-padded).
Each lands in OUT/NAME/ as what a consumer downloads: published/, signer.pub, and family.json (architecture, source
format, calibrated). Sources, staging and fragments are left out (the folder travels to the GPU box).

    .venv/bin/python benchmarks/family_campaigns.py OUT [--only NAME ...] [--keep-work]
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout: fq, tests.kits

from tests.kits import familykit as fk  # noqa: E402



def sources() -> dict[str, tuple[str, str, bool]]:
    """name -> (architecture, source format, calibrated): the campaigns this script runs."""
    from fq.model import families

    out = {}
    for arch in sorted(fk.ARCHS):
        family = families.for_config({"architectures": [arch]}, arch)
        if family.unread or family.exl3 is None or family.exl3_needs.always:
            continue  # no exllamav3 class, or one that misreads every checkpoint of the family (docs/families.md)
        if family.unread_layouts:  # DeepSeek-V4: the kit's save is a layout fq refuses; its campaign is the
            continue  # release's (deepseek_v4-release, below)
        out[family.name] = (arch, "bf16", False)
    out.update({"kimi_k2-fp8": ("DeepseekV3ForCausalLM", "kimi-fp8", True),
                "qwen3_moe-fp8": ("Qwen3MoeForCausalLM", "fp8", False),
                "glm4_moe-fp8": ("Glm4MoeForCausalLM", "fp8", False),
                "minimax_m2-fp8": ("MiniMaxM2ForCausalLM", "fp8", False),
                "qwen3_5_moe_vl-fused": ("Qwen3_5MoeForConditionalGeneration", "fused", False),
                "qwen3_vl_moe-published": ("Qwen3VLMoeForConditionalGeneration", "published", False),
                "gpt_oss-padded": ("GptOssForCausalLM", "bf16-padded", False),
                "gpt_oss-padded-mxfp4": ("GptOssForCausalLM", "mxfp4-padded", True),
                "deepseek_v4-release": ("DeepseekV4ForCausalLM", "release", False)})
    return out


def checkpoint(arch: str, fmt: str, work: Path) -> Path:
    keys = fk.PADDED_KEYS[arch] if fmt.endswith("-padded") else None  # dims not multiples of 128 (gpt-oss's 2880)
    src = fk.build(arch, work / "bf16", extra_config=fk.PUBLISHED_KEYS.get(arch), keys=keys)
    fmt = fmt.removesuffix("-padded")
    if fmt == "bf16":
        return src
    if fmt == "mxfp4":
        return fk.to_mxfp4_gptoss(src, work / "mxfp4")
    if fmt == "fused":
        return fk.to_fused_qwen3_5(src, work / "fused")
    if fmt == "release":  # DeepSeek-V4 as DeepSeek publishes it: its own names, FP4 experts, FP8 linears + ue8m0
        return fk.to_deepseek_v4_release(src, work / "release")
    if fmt == "published":  # Qwen3-VL-MoE's fused experts as Qwen publishes them, (E, in, out)
        return fk.to_published_qwen3_vl(src, work / "published")
    fp8 = fk.to_fp8(src, work / "fp8")
    return fk.as_kimi_k2(fp8, work / "kimi") if fmt == "kimi-fp8" else fp8


def run(name: str, arch: str, fmt: str, calibrated: bool, out: Path, keep: bool) -> dict:
    from tests.test_workflow import smk
    from fq.model.source import load_source

    work = out / "_work" / name
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    src = checkpoint(arch, fmt, work / "src")
    problems = load_source(src).exl3_problems
    if problems:
        raise SystemExit(f"{name}: exllamav3 would not load it: {problems}")
    d = work / "run"
    fk.campaign_config(d, src, calibrated=calibrated)
    t = time.perf_counter()
    smk(d, "campaign/campaign_summary.json", "campaign/published.verified")
    wall = time.perf_counter() - t
    dest = out / name
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(d / "campaign" / "published", dest / "published")
    shutil.copyfile(d / "campaign" / "signer.pub", dest / "signer.pub")
    meta = {"architecture": arch, "source": fmt, "calibrated": calibrated, "campaign_s": round(wall, 1)}
    s = load_source(src)
    if s.padded:  # what exllamav3 reads: each routed expert's EXL3 tensors at its stored (zero-padded) (out, in)
        meta["expert_shapes"] = {p: list(s.expert_shape(p)) for p in ("gate", "up", "down")}
        meta["stored_shapes"] = {p: list(s.stored_shape(p)) for p in ("gate", "up", "down")}
    (dest / "family.json").write_text(json.dumps(meta, indent=1, sort_keys=True) + "\n")
    if not keep:
        shutil.rmtree(work)
    return meta


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--only", nargs="*", help="campaign names (default: all)")
    p.add_argument("--keep-work", action="store_true", help="keep sources and campaign directories under OUT/_work")
    args = p.parse_args(argv)
    args.out = args.out.resolve()  # Snakemake runs in the campaign's own directory
    todo = sources()
    if args.only:
        unknown = sorted(set(args.only) - set(todo))
        if unknown:
            raise SystemExit(f"--only: unknown {unknown}; expected some of {sorted(todo)}")
        todo = {n: todo[n] for n in args.only}
    args.out.mkdir(parents=True, exist_ok=True)
    for name, (arch, fmt, calibrated) in todo.items():
        try:
            meta = run(name, arch, fmt, calibrated, args.out, args.keep_work)
            print(f"{name}: {meta}", flush=True)
        except (subprocess.SubprocessError, AssertionError, SystemExit) as e:
            print(f"{name}: FAILED {str(e)[-3000:]}", flush=True)
    if not args.keep_work:
        shutil.rmtree(args.out / "_work", ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
