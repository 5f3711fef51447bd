"""A published campaign of a second model family with chain products, packed for the GPU box like the demo's.

The demo campaign (``.devpack/campaign.tar.xz``) is GLM-4-MoE. This script builds a tiny random checkpoint of another
family with tests/kits/familykit.py (default ``Qwen3MoeForCausalLM``: vocab 512, hidden 256, 3 MoE layers of 8 experts
of intermediate 128, top-2, 4/4 attention heads of 64, untied head, 13 bf16 shards; seeded, byte-identical per seed),
gives it the demo's tokenizer (the kit's vocab is the demo's 512) and generation config (eos = pad = 0), and runs a
real Snakemake campaign on it on the CPU, calibrated (LDLQ, the demo's calibration split, 16 x 128 tokens) with the
demo's chain recipe minus the whole-model bases:

    nodes     k2 (base, K2, routed experts only)  k3 (base, K3)
              k2.r1 (stage, K1, every expert, parent k2)  k2.r1.h2 (stage, K2, the 2 most used experts per layer)
    products  k2 = [k2]  k3 = [k3]  k2.r1 = [k2, k2.r1]  k2.r1.h2 = [k2, k2.r1, k2.r1.h2]

The hot stage selects from expert usage measured on the checkpoint (``fq usage`` on the calibration split, config
``usage:``). OUT is laid out as tests/test_exl3_runtime.py and benchmarks/exl3_chain_exact.py want a campaign
directory: ``published/``, ``signer.pub``, ``source/`` (the checkpoint with tokenizer.json); the campaign's working
files stay in ``OUT.work/`` (``--work``). It then packs OUT's three entries as ``--pack`` (xz), unpacks that into a
fresh temporary directory and checks it there on the CPU: ``fq verify`` of published/ under signer.pub, the demo's
held-out text tokenized with source/'s tokenizer (what both GPU scripts do), and every product loaded with
fq.runtime.load.load_product from its plan and run on held-out windows (finite logits; KL to the source printed).

    .venv/bin/python benchmarks/family_chain_campaign.py .devcampaign/qwen3moe \\
        [--arch Qwen3MoeForCausalLM] [--pack .devpack/campaign_qwen3moe.tar.xz] [--cores 2] [--weight-only]
        [--check-only]                  # only the check of an existing tarball

On the GPU box, carry .devpack/ without the demo's campaign.tar.xz (both campaigns, the wheels and the extension
exceed the 64 MiB carry together) and name this one (benchmarks/device_setup.sh's install_step unpacks it):

    CAMPAIGN_TAR=.devpack/campaign_qwen3moe.tar.xz STEP="install exact test" bash benchmarks/exl3_chain_device.sh /tmp/qwen

``FQ_EXL3_CAMPAIGN=/tmp/qwen`` for tests/test_exl3_runtime.py directly. The weights are random (the kit's
init, logit std about 0.3): the source-relative KLs say little about quantization quality; what this campaign is for
is a second family through the chained EXL3 runtime (agreement with the exact reconstruction, generation, routing).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.kits import familykit as fk  # noqa: E402
# the campaign's verified targets; PATH with the venv's bin first
from tests.kits.crashkit import TARGETS, env  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
PACKED = ("published", "signer.pub", "source")
HOT = 2

RECIPE = {
    "format": "fq-cartridge/2", "name": "famchain",
    "description": "a second family's chain products: bases K2 and K3 (routed experts only), a K1 residual on every "
                   f"expert of the K2 base, and a K2 residual on the {HOT} most used experts of each layer on top",
    "nodes": [
        {"name": "k2", "kind": "base", "K": 2, "codebook": "mul1"},
        {"name": "k3", "kind": "base", "K": 3, "codebook": "mul1"},
        {"name": "k2.r1", "kind": "stage", "K": 1, "codebook": "mul1", "parent": "k2", "experts": "all"},
        {"name": "k2.r1.h2", "kind": "stage", "K": 2, "codebook": "mul1", "parent": "k2.r1",
         "experts": {"hot": HOT}, "description": f"K2 residual on the {HOT} most used experts of each layer"},
    ],
    "products": [{"name": "k2", "chain": ["k2"]}, {"name": "k3", "chain": ["k3"]},
                 {"name": "k2.r1", "chain": ["k2", "k2.r1"]},
                 {"name": "k2.r1.h2", "chain": ["k2", "k2.r1", "k2.r1.h2"]}],
}


def build_source(arch: str, src: Path, seed: int) -> Path:
    """The kit's checkpoint of ``arch`` with the demo's tokenizer and generation config; dims checked."""
    from fq.model import demo_model
    from fq.model.source import load_source

    if src.exists():
        shutil.rmtree(src)
    extra = fk._merged(fk.PUBLISHED_KEYS.get(arch) or {}, {"eos_token_id": 0, "pad_token_id": 0})
    if fk.ARCHS[arch].text_config:  # a vision-language wrapper: the language model's ids are under text_config
        extra = fk._merged(extra, {fk.ARCHS[arch].text_config: {"eos_token_id": 0, "pad_token_id": 0}})
    fk.build(arch, src, seed=seed, extra_config=extra)
    for name in TOKENIZER_FILES:  # the demo's (vocab 512, <|endoftext|> = 0), as the demo checkpoint ships them
        shutil.copyfile(demo_model.DATA / name, src / name)
    cfg = fk.text_of(arch, json.loads((src / "config.json").read_text()))
    r = fk.ARCHS[arch]
    got = {"vocab_size": cfg["vocab_size"], "hidden_size": cfg["hidden_size"],
           "experts": cfg.get(r.expert_count_key, cfg.get(r.renames.get(r.expert_count_key, ""))),
           "top_k": cfg["num_experts_per_tok"], "expert_intermediate": cfg[r.expert_inter_key]}
    want = {"vocab_size": demo_model.VOCAB, "hidden_size": 256, "experts": 8, "top_k": 2, "expert_intermediate": 128}
    if got != want:
        raise SystemExit(f"{arch}: the kit's dims {got}, expected {want}")
    s = load_source(src)
    if s.exl3_problems:
        raise SystemExit(f"{arch}: exllamav3 would not load a base of it: {s.exl3_problems}")
    print(f"source: {src} ({arch}, {len(list(src.glob('*.safetensors')))} shards, dims {got})", flush=True)
    return src


def run_campaign(work: Path, src: Path, cores: int, calibrated: bool) -> Path:
    """usage measurement, config and Snakemake in ``work``; returns the campaign's output directory."""
    from fq.model import demo_model

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    cal = work / "calibration.txt"
    cal.write_text(demo_model.text("calibration"), encoding="utf-8")
    usage = work / "expert_usage.json"
    subprocess.run([sys.executable, "-m", "fq", "usage", "--model", str(src), "--text", str(cal), "--out", str(usage),
                    "--threads", str(cores)], check=True, env=env())
    (work / "recipe.json").write_text(json.dumps(RECIPE, indent=1))
    cfg = {"campaign": "famchain", "out": "campaign",
           "source": {"kind": "local", "path": str(src), "revision": "kit-1"},
           "recipe": str(work / "recipe.json"), "usage": str(usage), "block_size": 4, "windows": None,
           "windows_on_disk": 1, "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0},
           "compare_native": False, "eval": None, "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}
    if calibrated:
        cfg["calibration"] = {"text": str(cal), "sha256": hashlib.sha256(cal.read_bytes()).hexdigest(), "rows": 16,
                              "columns": 128, "capture": "all-experts", "compare_weight_only": False}
    (work / "config.yaml").write_text(json.dumps(cfg))  # YAML is a superset of JSON
    t0 = time.monotonic()
    subprocess.run([sys.executable, "-m", "snakemake", "-s", str(ROOT / "Snakefile"), "--directory", str(work),
                    "--configfile", str(work / "config.yaml"), "--cores", str(cores), *TARGETS],
                   check=True, env=env())
    print(f"campaign: {time.monotonic() - t0:.0f} s of Snakemake", flush=True)
    return work / "campaign"


def fq_verify(campaign: Path) -> None:
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(campaign / "published"), "--key",
                        str(campaign / "signer.pub"), "--no-state"], capture_output=True, text=True, env=env())
    if p.returncode != 0:
        raise SystemExit(f"fq verify {campaign / 'published'} failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}")
    print(f"fq verify: ok ({campaign / 'published'})", flush=True)


def lay_out(out: Path, campaign: Path) -> None:
    """OUT/published and OUT/signer.pub from the campaign (OUT/source is the checkpoint already)."""
    for name in ("published", "signer.pub"):
        p = out / name
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    shutil.copytree(campaign / "published", out / "published")
    shutil.copyfile(campaign / "signer.pub", out / "signer.pub")


def pack(out: Path, tarball: Path) -> None:
    tarball.parent.mkdir(parents=True, exist_ok=True)
    tmp = tarball.with_name(tarball.name + ".tmp")
    subprocess.run(["tar", "-C", str(out), "-cJf", str(tmp), *PACKED], check=True)
    tmp.replace(tarball)
    print(f"packed: {tarball} ({tarball.stat().st_size} bytes)", flush=True)


def check(campaign: Path, positions: int = 256) -> dict:
    """On the CPU, what the GPU scripts need of the campaign directory: fq verify; the held-out text tokenized with
    source/'s tokenizer into windows (benchmarks/exl3_chain_exact.windows); every product loaded from its plan
    (fq.runtime.load.load_product) and run on them: finite logits, KL to the source model."""
    import torch
    from transformers import AutoModelForCausalLM

    from exl3_chain_exact import SEQ, agreement, source_dir, windows
    from fq.provenance.attest import keys
    from fq.provenance.combine import combine
    from fq.provenance.publication import read_publication
    from fq.runtime.load import load_adapter, load_product

    fq_verify(campaign)
    key = keys.load_public(campaign / "signer.pub")
    products = read_publication(campaign / "published", key).predicate["products"]
    ids = windows(campaign, positions)
    assert ids.shape == (positions // SEQ, SEQ), ids.shape
    src = AutoModelForCausalLM.from_pretrained(source_dir(campaign), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = src(ids).logits.float()
    out = {}
    for name in sorted(products):
        loaded = load_product(campaign / "published" / products[name]["file"], key, state=None)
        with torch.no_grad():
            got = loaded.model(ids).logits.float()
        if not torch.isfinite(got).all():
            raise SystemExit(f"{name}: non-finite logits")
        a = agreement(ref, got)
        out[name] = {"chain": products[name]["chain"], "kl_source": a["kl"], "top1_source": a["top1"]}
        print(f"{name:10s} chain {'+'.join(products[name]['chain']):20s} finite logits {tuple(got.shape)}; "
              f"KL(source || product) {a['kl']:.3e}, top-1 {a['top1']:.3f}", flush=True)
    chains = [n for n, e in products.items() if len(e["chain"]) > 1]
    if not chains:
        raise SystemExit("the campaign publishes no chain product")
    # tests/test_exl3_runtime.py's adapter: the longest chain narrowed to experts 0-1 (fq combine), on its base
    name = max(chains, key=lambda n: len(products[n]["chain"]))
    plan = campaign / "published" / products[name]["file"]
    base_dir = campaign / "published" / "base" / products[name]["chain"][0]
    with tempfile.TemporaryDirectory(prefix="famchain-adapter-") as tmp:
        adapter = Path(tmp) / "narrow.safetensors"
        combine(plan, key, adapter, experts="0-1", base_dir=base_dir, state=None)
        loaded = load_adapter(base_dir, adapter, plan, key, state=None)
        with torch.no_grad():
            got = loaded.model(ids).logits.float()
    if not torch.isfinite(got).all():
        raise SystemExit(f"{name} adapter experts 0-1: non-finite logits")
    a = agreement(ref, got)
    out[f"{name} adapter experts 0-1"] = {"kl_source": a["kl"], "top1_source": a["top1"]}
    print(f"{name} adapter experts 0-1 (fq combine) on base {products[name]['chain'][0]}: finite logits; "
          f"KL(source || adapter) {a['kl']:.3e}, top-1 {a['top1']:.3f}", flush=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the campaign directory to write: published/, signer.pub, source/")
    p.add_argument("--arch", default="Qwen3MoeForCausalLM", choices=sorted(fk.ARCHS))
    p.add_argument("--work", type=Path, help="the campaign's working directory (default: OUT.work)")
    p.add_argument("--pack", type=Path, help="the tarball (default: .devpack/campaign_<family>.tar.xz)")
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--weight-only", action="store_true", help="no calibration (weight-only encodes)")
    p.add_argument("--check-only", action="store_true", help="only unpack the existing --pack tarball and check it")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    out = args.out.resolve()
    work = (args.work or out.with_name(out.name + ".work")).resolve()
    tarball = (args.pack or ROOT / ".devpack" / f"campaign_{args.arch.removesuffix('ForCausalLM').lower()}.tar.xz")
    if not args.check_only:
        out.mkdir(parents=True, exist_ok=True)
        src = build_source(args.arch, out / "source", args.seed)
        campaign = run_campaign(work, src, args.cores, calibrated=not args.weight_only)
        fq_verify(campaign)
        lay_out(out, campaign)
        pack(out, tarball.resolve())
    with tempfile.TemporaryDirectory(prefix="famchain-") as tmp:
        with tarfile.open(tarball) as tf:
            tf.extractall(tmp, filter="data")
        result = check(Path(tmp))
    if work.is_dir():
        (work / "check.json").write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    print(f"done in {time.monotonic() - t0:.0f} s: {out} packed as {tarball} ({tarball.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
