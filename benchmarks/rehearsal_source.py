"""Write a GLM-5-shaped FP8 source checkpoint for the campaign rehearsal (issue 43; ``fq.model.rehearsal`` has the
logic and says where every number comes from).

    python3 benchmarks/rehearsal_source.py /tmp/rehearsal/source                 # full width: 1 dense + 2 MoE layers, 32 experts
    python3 benchmarks/rehearsal_source.py /tmp/twin --tiny                      # the CPU twin (seconds)
    python3 benchmarks/rehearsal_source.py /tmp/quarter --width-scale 4          # a reduced width, same layout
    python3 benchmarks/rehearsal_source.py /tmp/plan --experts 16 --metadata-only  # what fq price reads, no shards

Full width (hidden 6144, MoE intermediate 2048, MLA at GLM-5's ranks and head dims, the DSA indexer, vocab 154880),
``--experts`` routed experts per MoE layer (default 32 of GLM-5's 256: every expert job, fragment and Hessian of the
price scales by 256 / experts; rehearsal.json gives the projection). Weights are random with a trained model's
structure (low-rank spectrum, outlier channels), seeded by ``--seed``: the same seed writes the same bytes. Shards
already complete are kept, so a killed run continues where it stopped. Prints where it wrote and the sizes.
"""
from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fq.errors import FqError  # noqa: E402
from fq.model import rehearsal  # noqa: E402


def layers(spec: str) -> tuple[int, int]:
    """``DENSE+MOE``, e.g. 1+2."""
    try:
        dense, moe = (int(x) for x in spec.split("+"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected DENSE+MOE layer counts such as 1+2, got {spec!r}") from None
    if dense < 0 or moe < 1:
        raise argparse.ArgumentTypeError(f"{spec!r}: at least one MoE layer, and no negative count")
    return dense, moe


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write the checkpoint into (created; complete shards in it are kept)")
    p.add_argument("--layers", type=layers, default=None, metavar="DENSE+MOE",
                   help="dense and MoE layer counts (default 1+2; GLM-5 has 3+75)")
    p.add_argument("--experts", type=int, default=None, help="routed experts kept per MoE layer (default 32; tiny 8)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--tiny", action="store_true", help="the CPU twin: hidden 256, GLM-5's head dims, vocab 512")
    size.add_argument("--width-scale", type=int, default=1, metavar="S",
                      help="divide the hidden size, intermediates, heads, q rank and indexer heads by S (default 1)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary rows (default 154880; tiny 512)")
    p.add_argument("--shard-bytes", type=int, default=None,
                   help="shard size limit in bytes (default 5e9, Hugging Face's; tiny 2e6)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--metadata-only", action="store_true",
                   help="write config.json, the index and sizes.json only (fq plan / fq price --sizes), no shards")
    args = p.parse_args(argv)

    over = {}
    if args.layers:
        over["dense_layers"], over["moe_layers"] = args.layers
    if args.experts is not None:
        over["experts"] = args.experts
    if args.vocab is not None:
        over["vocab"] = args.vocab
    try:
        dims = rehearsal.tiny(**over) if args.tiny else rehearsal.scaled(args.width_scale, **over)
        dims = replace(dims, top_k=max(1, min(dims.top_k, dims.experts)))  # GLM-5's top-8 (tiny: 2), at most all
        shard_bytes = args.shard_bytes or (2_000_000 if args.tiny else rehearsal.SHARD_BYTES)
        t0 = time.monotonic()
        if args.metadata_only:
            info = rehearsal.write_metadata(args.out, dims, shard_bytes=shard_bytes)
        else:
            info = rehearsal.write_source(args.out, dims, seed=args.seed, shard_bytes=shard_bytes,
                                          progress=not args.quiet)
    except FqError as e:
        print(f"rehearsal_source: {e}", file=sys.stderr)
        return 1
    print(f"wrote {args.out} in {time.monotonic() - t0:.1f} s: {len(info['shards'])} shards, "
          f"{info['bytes'] / 1e9:.3f} GB, {info['tensors']} tensors")
    for name, s in info["shards"].items():
        print(f"  {name}  {s['bytes'] / 1e9:8.3f} GB  layers {s['layers']}")
    for layer, row in info["layers"].items():
        print(f"  {layer:>9}: {row['total'] / 1e9:.3f} GB ({', '.join(f'{k} {v / 1e9:.3f}' for k, v in row.items() if k != 'total')})")
    proj = info["projection_256"]
    print(f"  at 256 experts: {proj['moe_layer_bytes'] / 1e9:.2f} GB per MoE layer, GLM-5 (3 + 75 layers) "
          f"{proj['glm5_bytes'] / 1e9:.0f} GB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
