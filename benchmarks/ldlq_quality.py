#!/usr/bin/env python3
"""What calibration is worth: proxy error of fq's weight-only and LDLQ encoders (and the reference's) per K.

    python benchmarks/ldlq_quality.py [--small] [--device cpu|cuda:0] [--ks 1,2,3,4] [--batch N]
           [--reference auto|yes|no] [--ref-scaled] [--fq-signs] [--json OUT.json]

Inputs (synthetic, GLM-5-shaped; built with numpy, so they are the same bits everywhere): a routed expert's gate/up
weight W (out 2048, in 6144) with heavy tails and uneven channels, and its input Hessian H = X^T X / rows from
8192 activation rows: a correlated low-rank part (rank 64), independent noise, and 16 outlier channels 20x larger.
X is rounded to integers (times 4) so H is exact on any device. ``--small``: W 256 x 512, 1024 rows, rank 16, 4
outliers (a quick CPU check, a few seconds per K).

Per K (mul1 codebook): the proxy error tr(E H E^T) / tr(W H W^T) (fq.codec.proxy_error, E = W_hat - W) of
- fq weight-only (fq.codec.encode), the reference converter's no-Hessian fallback;
- fq LDLQ (fq.codec.encode_ldlq), with its stage times; with ``--batch N``, also N such matrices (other weight
  seeds, one H) through encode_ldlq_batch, the time per matrix;
- the reference (exllamav3 ``quantize_exl3`` with this H, default options: signs-only Hessian rotation, scale
  refit), when exllamav3 and CUDA are importable (its extension JIT-builds on first import, ~4 min with
  MAX_JOBS=16 TORCH_CUDA_ARCH_LIST=9.0; set TORCH_EXTENSIONS_DIR to keep it): its tensors are decoded with fq's
  bit-compatible ``reconstruct`` and measured with the same proxy_error; its own reported figure is listed too.
  ``--ref-scaled`` adds its ``scaled_hessian`` variant (fq's default metric), and ``--fq-signs`` fq's LDLQ with
  the reference's default metric (fq.codec.ldlq_parts.HESSIAN_SCALES = False: signs only).
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from fq.codec import encode, encode_ldlq, encode_ldlq_batch, proxy_error, reconstruct  # noqa: E402
from fq.codec import ldlq_parts  # noqa: E402

FULL = dict(out_f=2048, in_f=6144, rows=8192, rank=64, outliers=16)
SMALL = dict(out_f=256, in_f=512, rows=1024, rank=16, outliers=4)


def log(msg: str) -> None:
    print(msg, flush=True)


def weight(out_f: int, in_f: int, seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    z = rng.standard_normal((out_f, in_f))
    w = z * z * z  # (not z ** 3: numpy may call libm's pow)
    w = w * (0.5 + rng.random((out_f, 1))) * (0.2 + 2.0 * rng.random((1, in_f))) * 0.02
    return torch.from_numpy(w).float()


def hessian(in_f: int, rows: int, rank: int, outliers: int, seed: int, device) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    X = (rng.standard_normal((rows, rank)) @ rng.standard_normal((rank, in_f))) / np.sqrt(rank) * 2.0
    X += rng.standard_normal((rows, in_f))
    X[:, rng.permutation(in_f)[:outliers]] *= 20.0
    X = torch.from_numpy(np.round(X * 4.0)).to(device)  # integers: X^T X exact in float64
    return ((X.t() @ X) / rows).float()  # float32, as a capture would hand it over


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


class Reference:
    """exllamav3 1.6.5's quantize_exl3 on one GPU."""

    def __init__(self, device):
        from exllamav3.modules.quant.exl3_lib import quantize as q  # JIT-builds the extension on first import

        self.q = q
        self.device = torch.device(device)

    def encode(self, W: torch.Tensor, H: torch.Tensor, rows: int, K: int, seed: int, scaled: bool = False,
               fallback: bool = False):
        dev = self.device
        H_data = {"H": (H.to(dev, torch.float32) * rows).contiguous(), "count": 0 if fallback else rows,
                  "finalized": False, "first_key": "bench"}
        quant_args = {"K": K, "devices": [dev.index or 0], "seed": seed, "apply_out_scales": None, "mul1": True,
                      "sigma_reg": 0.025}
        if scaled:
            quant_args["scaled_hessian"] = True
        w = W.t().contiguous().to(dev, torch.float32)  # the reference's (in, out)
        sync(dev)
        t = time.perf_counter()
        _, proxy, tensors = self.q.quantize_exl3(w, H_data, quant_args, return_weight_q=False)
        sync(dev)
        dt = time.perf_counter() - t
        tensors = {k: v.cpu() for k, v in tensors.items()}
        return tensors, float(proxy), dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a small case for a quick CPU check")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--batch", type=int, default=0, help="also time N matrices through encode_ldlq_batch")
    ap.add_argument("--reference", choices=("auto", "yes", "no"), default="auto")
    ap.add_argument("--ref-scaled", action="store_true", help="also the reference with scaled_hessian")
    ap.add_argument("--fq-signs", action="store_true", help="also fq's LDLQ with a signs-only Hessian rotation")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    shape = SMALL if args.small else FULL
    device = torch.device(args.device)
    ks = [int(k) for k in args.ks.split(",")]
    info = dict(shape=shape, device=str(device), platform=platform.platform(), torch=torch.__version__,
                gpu=torch.cuda.get_device_name(device) if device.type == "cuda" else None,
                threads=torch.get_num_threads(), seed=args.seed)
    log(f"W {shape['out_f']}x{shape['in_f']} (out x in), H from {shape['rows']} rows, rank {shape['rank']}, "
        f"{shape['outliers']} outlier channels; device {device}")
    W = weight(shape["out_f"], shape["in_f"], args.seed)
    H = hessian(shape["in_f"], shape["rows"], shape["rank"], shape["outliers"], args.seed + 1000, device)
    Wd = W.to(device)

    ref = None
    if args.reference != "no" and device.type == "cuda":
        try:
            t0 = time.perf_counter()
            ref = Reference(device)
            log(f"reference: exllamav3 imported in {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - a missing or unbuildable reference is reported, not fatal
            if args.reference == "yes":
                raise
            log(f"reference unavailable: {type(e).__name__}: {e}")
    elif args.reference == "yes":
        log("reference needs a CUDA device")
        return 2

    rows = []
    for K in ks:
        row = dict(K=K)
        enc_wo, t_wo = timed(lambda: (encode(Wd, K, "mul1", seed=args.seed, device=device), sync(device))[0])
        row["fq_weight_only"] = proxy_error(Wd, enc_wo.W_hat, H)
        row["fq_weight_only_rel_mse"] = enc_wo.rel_mse
        row["fq_weight_only_s"] = t_wo
        stages: dict = {}
        enc, t_ldlq = timed(lambda: (encode_ldlq(Wd, H, K, "mul1", seed=args.seed, device=device,
                                                 timings=stages), sync(device))[0])
        row["fq_ldlq"] = enc.proxy_err
        row["fq_ldlq_rel_mse"] = enc.rel_mse
        row["fq_ldlq_s"] = t_ldlq
        row["fq_ldlq_stages_s"] = {k: round(v, 3) for k, v in stages.items()}
        if args.fq_signs:
            ldlq_parts.HESSIAN_SCALES = False
            try:
                e_s, t_s = timed(lambda: (encode_ldlq(Wd, H, K, "mul1", seed=args.seed, device=device),
                                          sync(device))[0])
            finally:
                ldlq_parts.HESSIAN_SCALES = True
            row["fq_ldlq_signs"] = e_s.proxy_err
            row["fq_ldlq_signs_s"] = t_s
        if args.batch:
            Ws = [Wd] + [weight(shape["out_f"], shape["in_f"], args.seed + i).to(device) for i in range(1, args.batch)]
            encs, t_b = timed(lambda: (encode_ldlq_batch(Ws, H, K, "mul1", [args.seed + i for i in range(len(Ws))],
                                                         device), sync(device))[0])
            row["fq_ldlq_batch_s_per_matrix"] = t_b / len(Ws)
            row["fq_ldlq_batch_same_as_single"] = all(
                encs[0].tensors[k].numpy().tobytes() == enc.tensors[k].numpy().tobytes() for k in enc.tensors)
        if ref is not None:
            try:
                variants = [("reference", False, False), ("reference_weight_only", False, True)]
                if args.ref_scaled:
                    variants.append(("reference_scaled", True, False))
                for key, scaled, fallback in variants:
                    tensors, own, dt = ref.encode(W, H, shape["rows"], K, args.seed, scaled, fallback)
                    W_hat = reconstruct({k: v.to(device) for k, v in tensors.items()})
                    row[key] = proxy_error(Wd, W_hat, H)
                    row[key + "_self_reported"] = own
                    row[key + "_s"] = dt
            except Exception as e:  # noqa: BLE001
                log(f"reference failed at K{K}: {type(e).__name__}: {e}")
                traceback.print_exc()
                ref = None
        rows.append(row)
        log(json.dumps(row))

    log("")
    head = f"{'K':>2} {'fq weight-only':>15} {'fq LDLQ':>10} {'gain':>6} {'reference':>10} {'ref wo':>10}" \
           f" {'fq wo s':>8} {'fq LDLQ s':>9} {'ref s':>7}"
    log(head)
    for r in rows:
        def f(key, fmt="{:.4g}"):
            return fmt.format(r[key]) if key in r else "n/a"
        log(f"{r['K']:>2} {f('fq_weight_only'):>15} {f('fq_ldlq'):>10} {r['fq_weight_only'] / r['fq_ldlq']:>5.1f}x"
            f" {f('reference'):>10} {f('reference_weight_only'):>10} {f('fq_weight_only_s', '{:.2f}'):>8}"
            f" {f('fq_ldlq_s', '{:.2f}'):>9} {f('reference_s', '{:.2f}'):>7}")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(info=info, rows=rows), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
