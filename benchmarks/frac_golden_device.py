"""Half-integer K against exllamav3 1.6.5's own kernels, on a GPU (docs/codec.md "Half-integer K").

For K in 1.5, 2.5, 3.5 (and K=2 as a control), on the same seeded N(0,1) tiles laid out as a (16*tk, 16*tn) matrix:
  1. exllamav3 encodes them: quantize_tiles_frac (via quantize_tiles) -> (reconstructed tiles, 16-bit states),
     and pack_trellis -> the (tk, tn, 16K) trellis;
  2. fq's format against it, bit for bit: fq.pack(exllamav3's states) == exllamav3's trellis; fq.unpack(that trellis)
     == its states; fq's mul1 values of its states == its reconstructed tiles; ext.unpack_trellis_frac(fq's trellis)
     == fq's states;
  3. exllamav3 decodes fq's own encoding: ext.reconstruct (the inner weight, every element's fp16 bits) and a
     LinearEXL3 built from fq's tensors (trellis + suh/svh + mul1 marker; get_weight_tensor and a forward) against
     fq's decode_inner / reconstruct;
  4. quality: fq's MSE against exllamav3's on the same tiles (fq searches in float32, exllamav3 in fp16) and the
     fraction of tiles whose states agree.
Prints one JSON document (and writes it with --json); exit status 1 if any bit-exact check fails.

    python3 benchmarks/frac_golden_device.py --json $OUT/frac_golden.json
(the environment of benchmarks/device_setup.sh: exllamav3 1.6.5 importable, its extension built).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fq.codec import rate
from fq.codec.codebook import marker_value, values_torch
from fq.codec.packing import pack, tiles_to_matrix, unpack
from fq.codec.tensors import decode_inner, reconstruct
from fq.codec.viterbi import viterbi


def seeded_tiles(tk: int, tn: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tk, tn, 256, generator=g)


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    ints = {torch.float32: torch.int32, torch.float16: torch.int16}
    if a.dtype in ints:
        a, b = a.view(ints[a.dtype]), b.view(ints[b.dtype])
    return torch.equal(a, b)


def one_k(K, tiles: torch.Tensor, dev: str) -> dict:
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.quant.exl3 import LinearEXL3
    from exllamav3.modules.quant.exl3_lib import quantize as q

    tk, tn, _ = tiles.shape
    qa = {"K": K, "mul1": True}
    flat = tiles.reshape(-1, 256).to(dev)
    torch.cuda.synchronize()
    t0 = time.time()
    ref_q, ref_idx = q.quantize_tiles(flat, qa)
    torch.cuda.synchronize()
    t_ref = time.time() - t0
    ref_packed = q.pack_trellis(ref_idx.reshape(tk, tn, 256).contiguous(), qa).cpu()
    ref_states = (ref_idx.cpu().to(torch.int32) & 0xFFFF).reshape(tk, tn, 256)
    ref_q = ref_q.cpu().reshape(tk, tn, 256)

    t0 = time.time()
    fq_states = viterbi(tiles.reshape(-1, 256), K, "mul1").reshape(tk, tn, 256)
    t_fq = time.time() - t0
    fq_packed = pack(fq_states, K)
    v = values_torch("mul1")
    out = {"K": K, "tiles": tk * tn, "words_per_tile": int(ref_packed.shape[-1]),
           "exl3_encode_s": round(t_ref, 3), "fq_cpu_encode_s": round(t_fq, 3)}

    # 2. the format, on exllamav3's encoding
    out["pack_of_ref_states_equals_ref_trellis"] = bits_equal(pack(ref_states, K), ref_packed)
    out["unpack_of_ref_trellis_equals_ref_states"] = bits_equal(unpack(ref_packed, K), ref_states)
    out["fq_values_of_ref_states_equal_ref_tiles"] = bits_equal(v[ref_states.long()], ref_q)
    if rate.is_half(K):
        un = torch.zeros(tk, tn, 256, dtype=torch.int16, device=dev)
        ext.unpack_trellis_frac(un, fq_packed.to(dev), rate.ka(K), 0xAAAA)
        out["ref_unpack_of_fq_trellis_equals_fq_states"] = bits_equal(un.cpu().to(torch.int32) & 0xFFFF, fq_states)

    # 3. exllamav3 decodes fq's encoding
    inner_fq = decode_inner(fq_packed, K, "mul1")  # (16 tk, 16 tn) float32, exact fp16 values
    inner_ref = torch.empty(16 * tk, 16 * tn, dtype=torch.half, device=dev)
    ext.reconstruct(inner_ref, fq_packed.to(dev), K, False, True)
    out["ref_reconstruct_of_fq_trellis_bit_exact"] = bits_equal(inner_ref, inner_fq.half())
    g = torch.Generator().manual_seed(99)
    suh = (torch.rand(16 * tk, generator=g) + 0.5).half()
    svh = (torch.rand(16 * tn, generator=g) + 0.5).half()
    tensors = {"trellis": fq_packed, "suh": suh, "svh": svh, "mul1": torch.tensor(marker_value("mul1"), dtype=torch.int32)}
    W_fq = reconstruct(tensors)  # (out, in) float32
    lin = LinearEXL3(None, 16 * tk, 16 * tn, suh=suh.to(dev), svh=svh.to(dev), trellis=fq_packed.to(dev),
                     mul1=tensors["mul1"].to(dev), key=f"frac{K}")
    W_ref = lin.get_weight_tensor().float().cpu()  # exllamav3's (in, out)
    scale = float(W_fq.abs().max())
    out["linear_weight_max_abs_diff_rel"] = float((W_ref.t() - W_fq).abs().max()) / scale
    x = torch.randn(4, 16 * tk, generator=g).half()
    y_ref = lin.forward(x.to(dev).contiguous(), {}).float().cpu()
    y_fq = x.float() @ W_fq.t()
    out["linear_forward_max_abs_diff_rel"] = float((y_ref - y_fq).abs().max()) / float(y_fq.abs().max())

    # 4. quality
    x64 = tiles.double()
    out["mse_exl3"] = float(((ref_q.double() - x64) ** 2).mean())
    out["mse_fq"] = float(((v[fq_states.long()].double() - x64) ** 2).mean())
    out["tiles_with_equal_states"] = float((fq_states == ref_states).all(-1).double().mean())
    return out


BIT_EXACT = ("pack_of_ref_states_equals_ref_trellis", "unpack_of_ref_trellis_equals_ref_states",
             "fq_values_of_ref_states_equal_ref_tiles", "ref_unpack_of_fq_trellis_equals_fq_states",
             "ref_reconstruct_of_fq_trellis_bit_exact")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiles", type=int, nargs=2, default=(8, 16), metavar=("TK", "TN"),
                    help="tile grid (a (16 TK, 16 TN) inner matrix; TK, TN multiples of 8 for the 128 blocks)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    tiles = seeded_tiles(*args.tiles, args.seed)
    dev = "cuda:0"
    res = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "seed": args.seed, "cases": []}
    ok = True
    for K in (1.5, 2.5, 3.5, 2):
        r = one_k(K, tiles, dev)
        res["cases"].append(r)
        ok &= all(r[k] for k in BIT_EXACT if k in r)
        ok &= r["linear_weight_max_abs_diff_rel"] < 2e-3 and r["linear_forward_max_abs_diff_rel"] < 1e-2
    res["all_bit_exact_checks_pass"] = bool(ok)
    text = json.dumps(res, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
