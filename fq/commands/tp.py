"""``fq tp-export`` and ``fq mesh-plan``: tensor-parallel products (docs/tp.md).

    fq tp-export PLAN --key PUBKEY --tp N [--ep M] [--assign contiguous|strided] --sign-key KEY --out DIR
    fq mesh-plan PLAN --key PUBKEY --tp N [--ep M] [--pp P] [--epoch E] [--assign ...] [--json]

PLAN is a published product's signed assembly (ROOT/assemblies/PRODUCT.assembly.intoto.jsonl), verified
under the pinned campaign key before anything else is read.
"""
from __future__ import annotations

import argparse

from fq.cli_args import add_state_args, count, positive_int, state_from_args
from fq.commands.verify import load_pinned
from fq.core.canonical import pretty
from fq.provenance.attest import keys
from fq.tp.manifest import ASSIGNMENTS
from fq.tp.mesh import DeviceMesh, describe, plan


def _product_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan", metavar="PLAN", help="ROOT/assemblies/PRODUCT.assembly.intoto.jsonl")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the campaign signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    p.add_argument("--root", metavar="DIR", help="campaign root (default: the directory above assemblies/)")
    p.add_argument("--tp", type=positive_int, required=True, metavar="N", help="tensor-parallel size")
    p.add_argument("--ep", type=positive_int, default=1, metavar="M", help="expert-parallel size (default 1)")
    p.add_argument("--assign", choices=ASSIGNMENTS, default="contiguous",
                   help="experts over ep ranks: contiguous blocks (default) or strided (expert i on i mod ep)")


def register(sub) -> None:
    p = sub.add_parser("tp-export", help="cut a published product into per-rank shards (whole 128-aligned tiles)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _product_args(p)
    p.add_argument("--sign-key", required=True, metavar="KEY", help="sign the export with this private key")
    p.add_argument("--out", required=True, metavar="DIR", help="export directory to create (must not exist)")
    p.add_argument("--min-version", type=count, metavar="N", help="refuse plans with a version below N")
    add_state_args(p)
    p.set_defaults(func=run_export)

    q = sub.add_parser("mesh-plan", help="print where every weight of a product goes on a tp x ep x pp mesh",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    _product_args(q)
    q.add_argument("--pp", type=positive_int, default=1, metavar="P", help="pipeline stages (default 1)")
    q.add_argument("--epoch", type=count, default=0, metavar="E", help="mesh epoch (default 0)")
    q.add_argument("--json", action="store_true", help="print the full plan as JSON (fq-mesh-plan/1)")
    q.set_defaults(func=run_plan)


def run_export(args) -> int:
    from fq.tp.export import tp_export
    key, _ = load_pinned(args)
    state = state_from_args(args)
    res = tp_export(args.plan, key, args.out, tp=args.tp, ep=args.ep, assign=args.assign,
                    sign_key=keys.load_private(args.sign_key), root=args.root, state=state,
                    min_version=args.min_version)
    res.product.record(state)
    print(f"wrote {res.path}: {res.files} shards for tp={args.tp} ep={args.ep} ({args.assign}); "
          f"index sha256 {res.index_sha256}")
    for (g, t), n in sorted(res.bytes_per_rank.items()):
        print(f"  rank-ep{g}-tp{t}: {n} bytes")
    return 0


def run_plan(args) -> int:
    from fq.tp.moe import moe_manifest  # torch: loaded by the command that needs it, not by every `fq` start
    from fq.tp.sources import ProductSource

    key, _ = load_pinned(args)
    src = ProductSource(args.plan, key, root=args.root)
    mesh = DeviceMesh(tp=args.tp, ep=args.ep, pp=args.pp, epoch=args.epoch)
    result = plan(moe_manifest(src.spec(), args.assign, args.tp), mesh)
    print(pretty(result.to_json()) if args.json else describe(result), end="" if args.json else "\n")
    return 0
