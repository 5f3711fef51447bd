"""Regenerate fq/data/cost_table_reference.json (what the reference EXL3 encoder would cost: `fq price
--cost-table` it to compare with fq's own, measured default table) from its H200 numbers in ../shared: anchors (tiles/s per codebook and K) and the golden
matrices' whole-pipeline timings (pipeline_s per GLM-5 expert matrix, mul1).

    python benchmarks/reference_cost_table.py [SHARED_DIR] [OUT]

Model: seconds per matrix pass = overhead_s(shape) + tiles / tiles_per_s(codebook, K), tiles =
out*in/256. Every input and entry says whether it was measured or derived, and from what.
The default table of `fq price` (fq/data/cost_table.json) is fq's own encoder measured by `fq cost-table`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CB = {0: "3inst", 1: "mcg", 2: "mul1"}
SHAPES = ((2048, 6144), (6144, 2048))  # GLM-5 expert gate/up and down, torch (out, in)


def tiles(out_f: int, in_f: int) -> int:
    return out_f * in_f // 256


def build(anchors: dict, golden: dict) -> dict:
    default = {(CB[r["cb"]], r["K"]): r for r in anchors["throughput"] if r["opt"] == "0"}
    tps: dict[str, dict[str, dict]] = {}
    for cb in CB.values():
        tps[cb] = {}
        for K in range(1, 9):
            if (cb, K) in default:
                r = default[(cb, K)]
                tps[cb][str(K)] = {"value": r["tiles_per_s"], "origin": "measured",
                                   "basis": f"anchors: opt 0 (default kernel), cb {r['cb']}, K {K}: "
                                            f"{r['tiles']} tiles in {r['ms']} ms"}
                continue
            src, src_k = ("mcg" if cb == "3inst" else cb), min(K, 4)
            why = [] if cb != "3inst" else ["no 3INST (cb 0) throughput in the anchors: assumed equal to mcg"]
            if K > 4:
                why.append(f"K{K} unmeasured: assumed equal to K4 (calibrate before pricing K5+)")
            tps[cb][str(K)] = {"value": default[(src, src_k)]["tiles_per_s"], "origin": "derived",
                               "basis": "; ".join(why) + f" -> {src} K{src_k}"}
    runs: dict[str, list] = {}
    for p in golden["pipeline_speed_h200"]:
        o, i = p["shape_out_in"]
        kernel = tiles(o, i) / tps["mul1"][str(p["K"])]["value"]
        runs.setdefault(f"{o}x{i}", []).append((p["K"], p["pipeline_s"], p["pipeline_s"] - kernel))
    overhead = {
        shape: {"value": round(sum(r for _, _, r in rs) / len(rs), 5), "origin": "derived",
                "basis": "golden pipeline_s minus tiles/tiles_per_s(mul1, K): "
                         + ", ".join(f"K{K} {s} s -> {r:.5f} s" for K, s, r in rs) + (" (mean)" if len(rs) > 1 else "")}
        for shape, rs in runs.items()}
    measured = {(f"{p['shape_out_in'][0]}x{p['shape_out_in'][1]}", p["K"]): p["pipeline_s"]
                for p in golden["pipeline_speed_h200"]}
    entries = []
    for cb in CB.values():
        for K in range(1, 9):
            for o, i in SHAPES:
                shape = f"{o}x{i}"
                if cb == "mul1" and (shape, K) in measured:
                    entries.append({"codebook": cb, "K": K, "shape": [o, i], "seconds": measured[(shape, K)],
                                    "origin": "measured", "basis": "golden pipeline_speed_h200: the whole weight-only "
                                                                   "pipeline (regularize, scale search, encode, pack)"})
                    continue
                ov, tp = overhead[shape]["value"], tps[cb][str(K)]["value"]
                entries.append({"codebook": cb, "K": K, "shape": [o, i], "seconds": round(ov + tiles(o, i) / tp, 4),
                                "origin": "derived",
                                "basis": f"overhead {ov} s + {tiles(o, i)} tiles / {tp} tiles/s "
                                         f"(tiles/s {tps[cb][str(K)]['origin']})"})
    return {
        "format": "fq-cost-table/1",
        "description": "Seconds per matrix pass (one weight-only EXL3 encode of one torch Linear (out, in) matrix "
                       "at K bits) per codebook, K and shape, per GPU model. fq price multiplies them by the "
                       "matrices each recipe node encodes.",
        "gpus": {anchors["gpu"]: {
            "encoder": "exllamav3 1.6.5 quantize_exl3, weight-only (no Hessian), default kernel (opt 0): the "
                       "reference until fq's own encoder is calibrated (fq calibrate)",
            "model": "seconds = overhead_s(shape) + tiles / tiles_per_s(codebook, K), tiles = out*in/256. 'measured' "
                     "entries are the reference pipeline timed whole; 'derived' entries apply the model to the "
                     "inputs, each labelled measured or derived.",
            "inputs": {"tiles_per_s": tps, "overhead_s": overhead},
            "entries": entries,
        }},
    }


def main(argv: list[str]) -> int:
    shared = Path(argv[0]) if argv else Path(__file__).resolve().parents[2] / "shared"
    out = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "fq" / "data" / "cost_table_reference.json"
    anchors = json.loads((shared / "anchors" / "exllamav3-1.6.5-h200.json").read_text())
    golden = json.loads((shared / "golden" / "exl3_matrix_golden.json").read_text())
    out.write_text(json.dumps(build(anchors, golden), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
