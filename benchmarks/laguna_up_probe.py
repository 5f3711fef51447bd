"""Laguna in exllamav3 1.6.5: does the published base, which stores each routed up_proj times 2^-7, agree with fq?

exllamav3's LagunaForCausalLM builds every MoE layer's BlockSparseMLP with ``interm_div`` 128: the up projection gets
``weight_scale`` 1/128 (applied by Linear's unquantized load paths, which its converter encodes from, and not by
``load_exl3``) and the routing weights 128 x ``moe_routed_scaling_factor``. A base storing W_up disagreed with fq's
reference at KL 0.084, top-1 0% (H100; docs/benchmarks.md). fq's Laguna bases now store each routed expert's up_proj
as the encoding of W_up with svh times 2^-7 (``fq.model.experts``, "Stored scales"; the plan's layout says
``stored_scale_log2: {"up_proj": -7}``) and fq's reference multiplies it back. This probe (GPU, exllamav3) loads, against
fq's verified reference of the published product (tests/kits/exl3kit.base_agreement, the family test's 4 x 64 random
ids):

- ``published``: the base as fq publishes it. The decisive row: expected at the fp16 floor (KL ~1e-8, top-1 ~100%,
  the bound tests/test_exl3_families.py applies is KL < 1e-3);
- ``control: up_proj.svh x 128``: a copy whose routed experts' ``up_proj.svh`` are multiplied by 128 (exact in fp16),
  i.e. W_up stored as fq stored it before: expected to reproduce the disagreement (exllamav3 still reads it / 128);
- ``control: up_proj.svh x 128, moe_routed_scaling_factor / 128``: that copy with the routing scale divided by 128 in
  its config (undoes exllamav3's compensation instead): expected to agree again.

    python3 benchmarks/laguna_up_probe.py CAMPAIGN OUT.json

CAMPAIGN is the directory benchmarks/family_campaigns.py writes for Laguna (``published/``, ``signer.pub``):

    .venv/bin/python benchmarks/family_campaigns.py OUT --only laguna      # on the CPU; CAMPAIGN = OUT/laguna

A campaign an fq without the stored scale wrote (its plan's layout states none) is refused: its base is the second row.
The copies go to a temporary directory, removed at the end.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout: fq, tests.kits

UP = "up_proj"
BOUND = 1e-3  # tests/test_exl3_families.py's bound on KL(fq || exllamav3)


def base_dir(published: Path, product: dict) -> Path:
    return published / "base" / product["chain"][0]


def check_stored_scale(published: Path, product: dict, key) -> int:
    """n of the plan's layout for the routed up_proj (the verified plan's own word); refuses an unscaled campaign."""
    from fq.model.experts import ExpertLayout
    from fq.provenance.product import open_product

    plan = open_product(published / product["file"], key, root=published).predicate
    n = ExpertLayout.from_json(plan["layout"], "plan layout").scale_log2(UP)
    if n != -7:
        raise SystemExit(f"{published}: the plan's layout stores the routed {UP} times 2^{n}, not 2^-7: a campaign of "
                         "an fq before the stored scale; rebuild it with benchmarks/family_campaigns.py")
    return n


def scale_up_svh(src: Path, dst: Path, factor: float) -> int:
    """A copy of the base directory with every routed expert's up_proj.svh times ``factor`` (a power of two: exact in
    fp16 while it stays normal); the count changed."""
    shutil.copytree(src, dst)
    n = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
        keys = [k for k in tensors if ".mlp.experts." in k and k.endswith(f".{UP}.svh")]
        if not keys:
            continue
        for k in keys:
            tensors[k] = (tensors[k].float() * factor).half()
        n += len(keys)
        save_file(tensors, str(f), metadata=meta)
    return n


def divide_routing_scale(d: Path) -> float:
    config = json.loads((d / "config.json").read_text())
    config["moe_routed_scaling_factor"] = config.get("moe_routed_scaling_factor", 1.0) / 128
    (d / "config.json").write_text(json.dumps(config, indent=2))
    return config["moe_routed_scaling_factor"]


def main() -> None:
    import exllamav3 as ex
    from tests.kits.exl3kit import base_agreement
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication

    camp, out = Path(sys.argv[1]), Path(sys.argv[2])
    published = camp / "published"
    key = keys.load_public(camp / "signer.pub")
    product = read_publication(published, key).predicate["products"]["a"]
    check_stored_scale(published, product, key)
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    work = Path(tempfile.mkdtemp(prefix="laguna-probe-"))
    try:
        src = base_dir(published, product)
        unscaled, undone = work / "unscaled", work / "unscaled-rsf"
        print("routed up_proj.svh multiplied:", scale_up_svh(src, unscaled, 128.0))
        shutil.copytree(unscaled, undone)
        print("routing scale stated:", divide_routing_scale(undone))
        results = {}
        for name, d in [("published", None), ("control: up_proj.svh x 128", unscaled),
                        ("control: up_proj.svh x 128, moe_routed_scaling_factor / 128", undone)]:
            results[name] = base_agreement(ex, published, product, key, ids, exl3_dir=d)
            print(name, results[name], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    kl = results["published"]["kl_ref_exl3"]
    results["verdict"] = f"published base {'agrees' if kl < BOUND else 'DISAGREES'}: KL {kl:.2e} (bound {BOUND})"
    print(results["verdict"])
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
