"""``fq promote CAMPAIGN --to DEST --key PUBKEY``: publish a finalized campaign in one visible step.

DEST is a local publication directory (``DEST/published`` becomes a link to a verified generation) or a
Hugging Face repository, ``--to hf://OWNER/NAME`` or ``--repo OWNER/NAME`` (staging branch, then main in
one commit of server-side copies). See fq.promote.local and fq.promote.hub.
"""
from __future__ import annotations

from fq.commands.verify import load_pinned


def register(sub) -> None:
    p = sub.add_parser("promote", help="publish a finalized campaign to a directory or a Hub repository, atomically",
                       description="CAMPAIGN: the campaign directory (holding published/ and campaign_summary.json). "
                                   "Only base/, stages/, assemblies/, publication.intoto.jsonl and the summary are "
                                   "published; the publication version must be above the destination's.")
    p.add_argument("campaign", metavar="CAMPAIGN")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--to", metavar="DEST", help="a local publication directory, or hf://OWNER/NAME")
    where.add_argument("--repo", metavar="OWNER/NAME", help="a Hugging Face model repository (same as --to hf://...)")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the campaign signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    p.add_argument("--keep", type=int, metavar="N",
                   help="local: remove generations beyond the N most recent (default: keep all); never the one this "
                        "promotion replaces, nor one replaced less than --grace seconds ago (docs/promote.md)")
    p.add_argument("--grace", type=float, metavar="SECONDS",
                   help="local, with --keep: how long a replaced generation stays for readers that resolved it "
                        "(default 86400)")
    p.add_argument("--staging", metavar="BRANCH", help="hub: the staging branch (default fq-staging)")
    p.add_argument("--endpoint", metavar="URL", help="hub: API endpoint (default: HF_ENDPOINT or huggingface.co)")
    p.set_defaults(func=run)


def run(args) -> int:
    from fq.core.paths import check_output_dir
    from fq.errors import FqError
    from fq.promote import collect, raise_report

    if args.repo is None and not args.to.startswith("hf://"):
        check_output_dir(args.to, "--to")  # a local destination: before the campaign is read and verified
    key, fp = load_pinned(args)
    pub = collect(args.campaign)
    hub = args.repo is not None or args.to.startswith("hf://")
    if hub:
        from fq.promote.hub import DEFAULT_STAGING, parse_target, promote_hub
        from fq.provenance.verify import verify_path

        if args.keep is not None or args.grace is not None:
            raise FqError("--keep and --grace apply to a local publication directory, not a Hub repository")
        repo = parse_target(args.repo or args.to)
        report = verify_path(pub.published, key, summary=pub.summary)  # sizes before any whole-file hash
        raise_report(report, f"promote {pub.campaign}")
        pub.adopt(report)
        r = promote_hub(pub, repo, staging=args.staging or DEFAULT_STAGING, endpoint=args.endpoint, key=key)
        print(f"promoted {pub.campaign} to hf://{r.repo}: main {r.previous_main[:12]} -> {r.main_sha[:12]}, "
              f"a copy of {r.staging}@{r.staged_sha[:12]} ({r.files} files"
              f"{f', {len(r.deleted)} stale removed' if r.deleted else ''}); signer {fp}")
        return 0
    if args.staging or args.endpoint:
        raise FqError("--staging and --endpoint apply to a Hub repository (--to hf://OWNER/NAME)")
    from fq.promote.local import DEFAULT_GRACE_S, promote_local

    if args.grace is not None and args.keep is None:
        raise FqError("--grace applies only with --keep (without --keep no generation is ever removed)")
    r = promote_local(pub, args.to, key, keep=args.keep, grace=DEFAULT_GRACE_S if args.grace is None else args.grace)
    state = "already current" if r.unchanged else f"was {r.previous or 'none'}"
    print(f"promoted {pub.campaign} to {args.to}/published -> generations/{r.generation} ({state}; {r.files} files, "
          f"{r.bytes} bytes verified under {fp}{f'; pruned {len(r.pruned)}' if r.pruned else ''}"
          f"{f'; {len(r.retained)} replaced kept for readers' if r.retained else ''})")
    if r.behind is not None:
        print(f"rollback: {r.generation}'s publication version is below version {r.behind} promoted before; consumers "
              f"holding a state file refuse it (to roll back for them too, publish it again with a higher version)")
    return 0
