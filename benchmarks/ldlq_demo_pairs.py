#!/usr/bin/env python3
"""fq's LDLQ against exllamav3's quantize_exl3 on the demo model's own (W, H) pairs, and the capture on a GPU.

    python3 benchmarks/ldlq_demo_pairs.py [--device cuda:0] [--ks 1,2,3,4] [--rows 16 --cols 128] [--json OUT.json]

1. The trained demo model (fq.model.demo_model) and its calibration split (the demo campaign's 16 x 128 tokens by
   default) go through the calibration chain (fq.hessian.capture.capture_all) on ``--device`` and on the CPU: the
   time of each, and how far the two devices' Hessians are apart (max |H_dev - H_cpu| / max |H_cpu| per matrix: the
   capture is deterministic per machine, not bit-equal across devices; docs/calibration.md).
2. Every routed expert linear of the MoE layers (layers 1 and 2, 8 experts: gate and up with the layer's input
   Hessian, down with its expert's), per K: the proxy error tr(E H E^T) / tr(W H W^T) of fq weight-only, fq LDLQ
   (encode_ldlq_batch per shared H) and, where exllamav3 is importable on CUDA, quantize_exl3 with the same H
   (its tensors decoded by fq's bit-compatible reconstruct and measured by the same proxy_error). Hessians from the
   ``--device`` capture.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import torch  # noqa: E402

from fq.codec import encode, encode_ldlq_batch, proxy_error, reconstruct  # noqa: E402
from fq.hessian import calibration, capture, layer as layer_mod, store  # noqa: E402
from fq.model import demo_model  # noqa: E402
from ldlq_quality import Reference, log, sync  # noqa: E402


def captured(model: Path, cal, out: Path, device: str) -> tuple[dict, float]:
    sync(device)
    t = time.perf_counter()
    r = capture.capture_all(model, cal, out, device=device, keep_hidden=False)
    sync(device)
    return {L: store.read_hessians(p) for L, p in r["hessians"].items()}, time.perf_counter() - t


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--cols", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    dev = torch.device(args.device)
    ks = [int(k) for k in args.ks.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="fq-demo-pairs-"))
    model = demo_model.write(tmp / "model")
    text = tmp / "calibration.txt"
    text.write_bytes(demo_model.text("calibration").encode("utf-8"))
    cal = calibration.from_text(text, hashlib.sha256(text.read_bytes()).hexdigest(), model, args.rows, args.cols)

    res: dict = dict(device=str(dev), gpu=torch.cuda.get_device_name(dev) if dev.type == "cuda" else None,
                     rows=args.rows, cols=args.cols, torch=torch.__version__)
    hs, t_dev = captured(model, cal, tmp / "cap-dev", str(dev))
    res["capture_s"] = {str(dev): round(t_dev, 2)}
    if dev.type != "cpu":
        hc, t_cpu = captured(model, cal, tmp / "cap-cpu", "cpu")
        res["capture_s"]["cpu"] = round(t_cpu, 2)
        worst = {}
        for L in hs:
            worst[f"layer{L}.input"] = rel(hs[L].input(), hc[L].input())
            worst[f"layer{L}.down"] = max(rel(hs[L].down(e), hc[L].down(e)) for e in range(hs[L].n_experts))
        res["capture_rel_diff_vs_cpu"] = worst
        log(f"capture: {t_dev:.1f} s on {dev}, {t_cpu:.1f} s on the CPU; max relative difference of the Hessians "
            f"{max(worst.values()):.3g}")

    ckpt = layer_mod.read_checkpoint(model)
    pairs = []  # (name, W, H, group): matrices of one group share H
    for L, h in sorted(hs.items()):
        t, _ = layer_mod.layer_tensors(ckpt, L)
        hin = h.input().float()
        for e in range(h.n_experts):
            pre = f"model.layers.{L}.mlp.experts.{e}."
            pairs.append((f"L{L}.e{e}.gate", t[pre + "gate_proj.weight"], hin, f"L{L}.input"))
            pairs.append((f"L{L}.e{e}.up", t[pre + "up_proj.weight"], hin, f"L{L}.input"))
            pairs.append((f"L{L}.e{e}.down", t[pre + "down_proj.weight"], h.down(e).float(), f"L{L}.down{e}"))
    ref = None
    if dev.type == "cuda":
        try:
            ref = Reference(dev)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            log(f"reference unavailable: {type(e).__name__}: {e}")
    rows = []
    for K in ks:
        groups: dict[str, list[int]] = {}
        for i, (_, _, _, g) in enumerate(pairs):
            groups.setdefault(g, []).append(i)
        fq_p = [None] * len(pairs)
        t0 = time.perf_counter()
        for idx in groups.values():
            encs = encode_ldlq_batch([pairs[i][1].to(dev) for i in idx], pairs[idx[0]][2].to(dev), K, "mul1",
                                     [args.seed + i for i in idx], dev)
            for i, e in zip(idx, encs):
                fq_p[i] = e.proxy_err
        sync(dev)
        t_fq = time.perf_counter() - t0
        wo_p, ref_p = [], []
        for i, (name, W, H, _) in enumerate(pairs):
            Wd, Hd = W.to(dev), H.to(dev)
            wo_p.append(proxy_error(Wd, encode(Wd, K, "mul1", seed=args.seed + i, device=dev).W_hat, Hd))
            if ref is not None:
                count = args.rows * args.cols
                tensors, _, _ = ref.encode(W, H, count, K, args.seed + i)
                ref_p.append(proxy_error(Wd, reconstruct({k: v.to(dev) for k, v in tensors.items()}), Hd))
        row = dict(K=K, matrices=len(pairs), fq_ldlq_mean=sum(fq_p) / len(fq_p), fq_weight_only_mean=sum(wo_p) / len(wo_p),
                   fq_ldlq_s=round(t_fq, 2))
        if ref_p:
            ratios = [a / b for a, b in zip(fq_p, ref_p)]
            row.update(reference_mean=sum(ref_p) / len(ref_p), fq_le_reference=sum(a <= b for a, b in zip(fq_p, ref_p)),
                       ratio_mean=sum(ratios) / len(ratios), ratio_worst=max(ratios),
                       worst=pairs[ratios.index(max(ratios))][0])
        rows.append(row)
        log(json.dumps(row))
    res["rows"] = rows
    log("")
    log(f"{'K':>2} {'matrices':>8} {'fq weight-only':>15} {'fq LDLQ':>10} {'quantize_exl3':>14} {'fq <= ref':>9} "
        f"{'mean fq/ref':>11} {'worst fq/ref':>12}")
    for r in rows:
        log(f"{r['K']:>2} {r['matrices']:>8} {r['fq_weight_only_mean']:>15.5g} {r['fq_ldlq_mean']:>10.5g} "
            f"{r.get('reference_mean', float('nan')):>14.5g} {r.get('fq_le_reference', 'n/a')!s:>9} "
            f"{r.get('ratio_mean', float('nan')):>11.4f} {r.get('ratio_worst', float('nan')):>12.4f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
