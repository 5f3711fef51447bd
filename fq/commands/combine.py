"""``fq combine --key PUBKEY --plan PLAN [--experts SELECTION] [--base DIR] --out FILE``.

Verifies the signed plan, narrows to the chosen experts before reading any payload, and writes one
adapter (the residual tensors of the chosen experts) plus its attestation ``FILE.intoto.jsonl``.
"""
from __future__ import annotations

from fq.cli_args import add_state_args, count, state_from_args
from fq.commands.verify import load_pinned
from fq.core.paths import check_output_file
from fq.display import printable
from fq.provenance.attest import keys


def register(sub) -> None:
    p = sub.add_parser("combine", help="build one verified adapter for a product and chosen experts")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    p.add_argument("--plan", required=True, metavar="PLAN", help="ROOT/assemblies/PRODUCT.assembly.intoto.jsonl")
    p.add_argument("--experts", default="all", metavar="SELECTION",
                   help="'all' (default), '0-7,12' (every layer) or '3:0-7;5:1' (per layer)")
    p.add_argument("--base", metavar="DIR", help="the base checkpoint that will be loaded; compared with the plan")
    p.add_argument("--root", metavar="DIR", help="campaign root (default: the directory above assemblies/)")
    p.add_argument("--out", required=True, metavar="FILE", help="adapter to write (safetensors)")
    p.add_argument("--sign-key", metavar="KEY", help="sign the adapter's attestation with this private key")
    p.add_argument("--min-version", type=count, metavar="N", help="refuse plans with a version below N")
    add_state_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    # the adapter and its attestation beside it: checked before a fragment is read, not when the adapter is done
    check_output_file(args.out, "--out")
    check_output_file(f"{args.out}.intoto.jsonl", "--out")
    from fq.provenance.combine import combine  # torch: loaded by the command that needs it, not by every `fq` start

    key, fp = load_pinned(args)
    state = state_from_args(args)
    sign_key = keys.load_private(args.sign_key) if args.sign_key else None
    result = combine(args.plan, key, args.out, experts=args.experts, base_dir=args.base, root=args.root,
                     state=state, min_version=args.min_version, sign_key=sign_key,
                     base_option="--base" if args.base is not None else None)
    stages = ", ".join(f"{s['node']} (K={s['K']} {s['codebook']})" for s in result.stages)
    print(printable(f"wrote {result.path} ({len(result.experts)} experts, stages: {stages}; sha256 {result.sha256})"))
    print(printable(f"attestation: {result.attestation}"))
    return 0
