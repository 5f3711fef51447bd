"""``fq verify PATH --key PUBKEY``: check shards, a directory of them, or a published campaign.

Exit 0 only if everything holds; otherwise one line per problem on stderr and exit 1.
"""
from __future__ import annotations

import sys

from fq.cli_args import add_state_args, state_from_args
from fq.display import printable
from fq.provenance.attest import keys
from fq.provenance.verify import publication_versions, verify_path


def register(sub) -> None:
    p = sub.add_parser("verify", help="verify fragments, attestations, manifests and plans against a pinned key",
                       description="PATH: a shard, its attestation, a base manifest, a plan, or a directory "
                                   "(every file in it must be accounted for).")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    add_state_args(p)
    p.set_defaults(func=run)


def load_pinned(args):
    from fq.errors import FqError
    key = keys.load_public(args.key)
    fp = keys.fingerprint(key)
    if args.fingerprint is not None and args.fingerprint.lower() != fp:
        raise FqError(f"--key {args.key}: fingerprint {fp} is not the pinned {args.fingerprint}")
    return key, fp


def run(args) -> int:
    key, fp = load_pinned(args)
    state = state_from_args(args)
    if state is not None:
        state.validate()
    report = verify_path(args.path, key, state=state)
    for problem in report.problems:  # names in problem lines come from the tree: shown escaped
        print(f"fq verify: {printable(problem)}", file=sys.stderr)
    if not report.ok:
        return 1
    report.record(state)  # what was accepted: a later consumer with this state refuses anything older
    print(f"ok: {report.shards} shards, {report.manifests} base manifests, {report.assemblies} plans"
          f"{publication_versions(report)} verified under key {fp}")
    return 0
