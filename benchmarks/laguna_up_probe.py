"""Laguna in exllamav3 1.6.5: does it read a routed expert's EXL3 up_proj as the source's matrix divided by 128?

exllamav3's LagunaForCausalLM builds every MoE layer's BlockSparseMLP with ``interm_div`` 128: the up projection gets
``weight_scale`` 1/128 (applied by Linear's unquantized load paths, which its converter encodes from, and not by
``load_exl3``) and the routing weights 128 x ``moe_routed_scaling_factor``. fq's bases store W_up, and a tiny Laguna
base disagreed with fq's reference at KL 0.084, top-1 0% (docs/benchmarks.md, "Model families in exllamav3"); fq now
refuses Laguna bases at plan time. This probe (GPU, exllamav3) loads three directories against fq's verified reference
of the published base (tests/exl3kit.base_agreement, the family test's 4 x 64 random ids):

- ``published``: the base as fq publishes it (expected: the disagreement);
- ``up_proj.svh/128``: a copy whose routed experts' ``up_proj.svh`` are divided by 128 (exact in fp16: a power of
  two; the stored matrix is then W_up / 128), the fix fq would attest (expected: the fp16 floor);
- ``config moe_routed_scaling_factor/128``: a copy whose config states the routing scale divided by 128 (undoes the
  compensation instead; expected to agree on the tiny model, but it removes exllamav3's guard against fp16 overflow).

    python3 benchmarks/laguna_up_probe.py CAMPAIGN OUT.json

CAMPAIGN is a directory benchmarks/family_campaigns.py wrote for Laguna (``published/``, ``signer.pub``), which it
builds only where the refusal is lifted (an fq checkout before it, or ``allow_unloadable``); the copies go to a
temporary directory.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def base_dir(published: Path, product: dict) -> Path:
    return published / "base" / product["chain"][0]


def divide_up_svh(src: Path, dst: Path) -> int:
    """A copy of the base directory with every routed expert's up_proj.svh divided by 128; the count changed."""
    shutil.copytree(src, dst)
    n = 0
    for f in sorted(dst.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            meta, tensors = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
        keys = [k for k in tensors if ".mlp.experts." in k and k.endswith(".up_proj.svh")]
        if not keys:
            continue
        for k in keys:
            tensors[k] = tensors[k] / 128  # a power of two: exact in fp16 (svh is about 0.8-1.2)
        n += len(keys)
        save_file(tensors, str(f), metadata=meta)
    return n


def divide_routing_scale(src: Path, dst: Path) -> float:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config["moe_routed_scaling_factor"] = config.get("moe_routed_scaling_factor", 1.0) / 128
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return config["moe_routed_scaling_factor"]


def main() -> None:
    import exllamav3 as ex
    from exl3kit import base_agreement
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication

    camp, out = Path(sys.argv[1]), Path(sys.argv[2])
    published = camp / "published"
    key = keys.load_public(camp / "signer.pub")
    product = read_publication(published, key).predicate["products"]["a"]
    ids = torch.randint(0, 512, (4, 64), generator=torch.Generator().manual_seed(0))
    work = Path(tempfile.mkdtemp(prefix="laguna-probe-"))
    src = base_dir(published, product)
    print("routed up_proj.svh divided:", divide_up_svh(src, work / "up128"))
    print("routing scale stated:", divide_routing_scale(src, work / "rsf"))
    results = {}
    for name, d in [("published", None), ("up_proj.svh/128", work / "up128"),
                    ("config moe_routed_scaling_factor/128", work / "rsf")]:
        results[name] = base_agreement(ex, published, product, key, ids, exl3_dir=d)
        print(name, results[name], flush=True)
    out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
