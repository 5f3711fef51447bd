"""Where does a chain product in exllamav3 depart from its exact reconstruction? (issue 26, H200)

    python benchmarks/exl3_chain_exact.py CAMPAIGN_DIR [--positions 2048] [--json OUT]

CAMPAIGN_DIR holds published/, signer.pub and the source as demo-model/ or source/ (tests/test_exl3_runtime.py).
For every product of the publication (bases and chains) on held-out windows of 128 tokens:

- end to end: KL(exact ‖ exllamav3), top-1, max |logit diff|, positions over 0.05, against the exact reconstruction
  (fq.runtime.load: transformers in float32, each routed expert = reconstruct_chain of the verified tensors), and
  KL(source ‖ exact), KL(source ‖ exllamav3) with the unquantized source;
- per MoE layer, on identical inputs (the exact model's own input to the layer's MLP, cast to fp16): the relative
  error of exllamav3's MoE block output, the share of tokens whose top-k expert set differs, and the same with the
  exact model's own routing forced on exllamav3 (so routing flips and arithmetic are told apart);
- end to end again with every MoE block's routing forced to the exact model's (exact_vs_exl3_routing_forced);
- per chained expert linear, on the layer's real inputs: each stage's EXL3 GEMM against x @ (that stage's float32
  reconstruction)ᵀ, relative to the stage's own output norm; and the stage's suh/svh magnitudes (fp16 subnormals
  below 6.1e-5 lose precision).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.kits.exl3kit import MoeTap, forward_routing_forced, moe_modules  # noqa: E402

SEQ = 128


def _kl(ref, got):
    import torch

    lp_r, lp_g = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    return (lp_r.exp() * (lp_r - lp_g)).sum(-1)


def agreement(ref, got) -> dict:
    kl = _kl(ref, got).flatten()
    d = (got.float() - ref.float()).abs().amax(-1).flatten()
    return {"kl": kl.mean().item(), "kl_se": (kl.std() / kl.numel() ** 0.5).item(), "kl_max": kl.max().item(),
            "top1": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(), "max_abs_logit_diff": d.max().item(),
            "positions_over_0_05": int((d > 0.05).sum())}


def windows(campaign: Path, positions: int):
    import torch

    from fq.model.demo_model import text
    from fq.runtime.evaluate import tokenize
    from fq.runtime.quality import token_windows

    src = source_dir(campaign)
    ids, _ = tokenize(src, text("heldout"))
    return torch.as_tensor(token_windows(ids, SEQ, positions))


def source_dir(campaign: Path) -> Path:
    return campaign / "source" if (campaign / "source").is_dir() else campaign / "demo-model"


def source_logits(campaign: Path, ids):
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(source_dir(campaign), dtype=torch.float32).to("cuda:0").eval()
    with torch.no_grad():
        out = torch.cat([m(w[None].to("cuda:0")).logits.float() for w in ids])
    del m
    return out


def per_layer(p, tap) -> dict:
    """exllamav3's MoE blocks on the exact model's own inputs (fp16), its own routing and the exact routing forced."""
    import torch

    res = {}
    for layer, m in sorted(moe_modules(p.model).items()):
        if layer not in tap.records:
            continue
        r = tap.layer(layer)
        x = r["x"].half().contiguous()
        with torch.inference_mode():  # exllamav3 adds into its buffers in place
            got = m.forward(x.view(1, *x.shape), {}).float().view(x.shape)
            sel, w = m.routing_fn(x.shape[0], m.routing_cfg, x, {})
            flipped = (sel.sort(-1).values != r["sel"].sort(-1).values).any(-1)
            flips = flipped.float().mean().item()
            # routing weights where both chose the same experts (each side sorted by expert id)
            order_e, order_r = sel.argsort(-1), r["sel"].argsort(-1)
            dw = (w.float().gather(-1, order_e) - r["w"].gather(-1, order_r)).abs()[~flipped]
            wdiff = dw.max().item() if dw.numel() else None
            forced = _forced_routing(m, x, r["sel"], r["w"])
        y = r["y"].float()
        # the shared experts are in both outputs; the routed part is what the chain changes
        res[layer] = {"moe_rel_err": ((got - y).norm() / y.norm()).item(),
                      "moe_rel_err_forced_routing": ((forced - y).norm() / y.norm()).item() if forced is not None else None,
                      "routing_flip_share": flips, "routing_weight_max_diff": wdiff, "tokens": x.shape[0]}
    return res


def _forced_routing(m, x, sel, w):
    """The MoE block with the exact model's routing put in place of its own (routing_fn replaced for one call)."""
    import torch

    saved = m.routing_fn
    m.routing_fn = lambda bsz, cfg, z, params: (sel.to(torch.long).contiguous(), w.half().contiguous())
    try:
        return m.forward(x.view(1, *x.shape), {}).float().view(x.shape)
    finally:
        m.routing_fn = saved


def per_stage(p, tap) -> dict:
    """Every chained expert linear's parts on the layer's real inputs: EXL3 GEMM against the float32 reconstruction of
    that part, relative to the part's output; suh/svh magnitudes."""
    import torch
    import torch.nn.functional as F

    worst: dict = {}
    scales: dict = {}
    for name, lin in sorted(p.linears.items()):
        if len(lin.parts) < 2:
            continue
        layer = int(name.split(".")[2])
        if layer not in tap.records:
            continue
        x = tap.layer(layer)["x"]
        if "down_proj" in name or ".w2." in name:
            # the down projection's input: act(gate) * up of the exact model's own chain weights
            gname, uname = name.replace("down_proj", "gate_proj"), name.replace("down_proj", "up_proj")
            wg, wu = p.linears[gname], p.linears[uname]
            g = sum(_dense(part) for part in wg.parts)
            u = sum(_dense(part) for part in wu.parts)
            x = F.silu(x.float() @ g.T) * (x.float() @ u.T)
        xh = x[:256].half().contiguous()
        for i, part in enumerate(lin.parts):
            want = xh.float() @ _dense(part).T
            with torch.inference_mode():
                got = part.bc.run_alloc(xh, lin.out_features, True).float()
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            key = "base" if i == 0 else f"stage{i}"
            worst[key] = max(worst.get(key, 0.0), err)
            s = scales.setdefault(key, {"suh_min": 1e9, "svh_min": 1e9, "suh_max": 0.0, "svh_max": 0.0,
                                        "subnormal_suh": 0, "subnormal_svh": 0, "out_rms_min": 1e9})
            for t in ("suh", "svh"):
                v = getattr(part, t).float().abs()
                s[f"{t}_min"] = min(s[f"{t}_min"], v.min().item())
                s[f"{t}_max"] = max(s[f"{t}_max"], v.max().item())
                s[f"subnormal_{t}"] += int(((v < 6.1e-5) & (v > 0)).sum())
            s["out_rms_min"] = min(s["out_rms_min"], want.pow(2).mean().sqrt().item())
    return {"gemm_rel_err_max": worst, "scales": scales}


_DENSE: dict = {}


def _dense(part):
    """fq's float32 reconstruction (out, in) of one exllamav3 LinearEXL3's tensors, on the GPU."""
    from fq.codec import reconstruct

    k = id(part)
    if k not in _DENSE:
        t = {"trellis": part.trellis.cpu(), "suh": part.suh.cpu(), "svh": part.svh.cpu()}
        if getattr(part, "mul1_tensor", None) is not None:
            t["mul1"] = part.mul1_tensor.cpu()
        if getattr(part, "mcg_tensor", None) is not None:
            t["mcg"] = part.mcg_tensor.cpu()
        _DENSE[k] = reconstruct(t).to("cuda:0")
    return _DENSE[k]


def main(argv=None) -> int:
    import torch

    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.runtime.exl3 import load_exl3_product
    from fq.runtime.load import load_product

    ap = argparse.ArgumentParser()
    ap.add_argument("campaign", type=Path)
    ap.add_argument("--positions", type=int, default=2048)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--products", nargs="*")
    a = ap.parse_args(argv)
    root = a.campaign / "published"
    key = keys.load_public(a.campaign / "signer.pub")
    products = read_publication(root, key).predicate["products"]
    names = a.products or sorted(products)
    ids = windows(a.campaign, a.positions)
    src = source_logits(a.campaign, ids)
    results = {}
    for name in names:
        plan = root / products[name]["file"]
        loaded = load_product(plan, key, state=None)
        model = loaded.model.to("cuda:0").eval()
        tap = MoeTap(model)
        with torch.no_grad():
            ref = torch.cat([model(w[None].to("cuda:0")).logits.float() for w in ids])
        tap.close()
        model.to("cpu")
        r = {"source_vs_exact": agreement(src, ref)}
        # a chain as fq.runtime.exl3 loads it (its chained layers grouped); a bare base with every MoE layer on the
        # per-expert path (a chain of one each) and on exllamav3's fast paths
        chain = len(products[name]["chain"]) > 1
        for per_expert, tag in [(False, "")] if chain else [(True, ""), (False, "_fastpath")]:
            try:
                with load_exl3_product(plan, key, state=None, per_expert_everywhere=per_expert) as p:
                    if chain:
                        r["moe_paths"] = {str(k): v for k, v in p.moe_paths.items()}
                    got = torch.cat([p.forward(w[None]).to("cuda:0") for w in ids])
                    r["exact_vs_exl3" + tag] = agreement(ref, got)
                    r["exact_vs_exl3_routing_forced" + tag] = agreement(ref, forward_routing_forced(p, tap, ids))
                    r["source_vs_exl3" + tag] = agreement(src, got)
                    r["layers" + tag] = per_layer(p, tap)
                    if not tag:  # the chain's stages, or a base's as a chain of one
                        _DENSE.clear()
                        r["stages"] = per_stage(p, tap)
                        _DENSE.clear()
            except Exception as e:  # noqa: BLE001  a product this runtime refuses: say so, go on
                import traceback

                r["error" + tag] = f"{type(e).__name__}: {e}"
                traceback.print_exc()
        results[name] = r
        print(name, json.dumps(r, indent=1, sort_keys=True), flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
