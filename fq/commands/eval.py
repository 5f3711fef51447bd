"""``fq eval PUBLISHED --key PUBKEY --source DIR --text FILE --out FILE.json [--tsv FILE] [--native DIR]
[--weight-only DIR] [--campaign-json FILE] [--tokens N] [--seq-len N]``.

Every product of a published campaign (every one-pass comparison point under ``--native``,
every product's weight-only twin under ``--weight-only``) loaded on the CPU,
verified first, and measured against the source model on the text: KL, perplexity, top-1 agreement
(``fq.runtime.evaluate``).
"""
from __future__ import annotations

import sys

from fq.cli_args import add_state_args, positive_int, state_from_args
from fq.commands.verify import load_pinned
from fq.display import printable
from fq.workflow.common import recorded_shards


def register(sub) -> None:
    p = sub.add_parser("eval", help="measure every product of a published campaign against its source model")
    p.add_argument("published", metavar="PUBLISHED", help="the published tree (holds publication.intoto.jsonl)")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    p.add_argument("--source", required=True, metavar="DIR", help="the source checkpoint (config, shards, tokenizer.json)")
    p.add_argument("--text", required=True, metavar="FILE", help="held-out text (UTF-8)")
    p.add_argument("--native", metavar="DIR", help="the campaign's one-pass encodes (OUT/native)")
    p.add_argument("--weight-only", metavar="DIR",
                   help="the calibrated campaign's weight-only twins (OUT/weight-only): each product measured without "
                        "its Hessians too")
    p.add_argument("--campaign-json", metavar="FILE",
                   help="campaign.json: check each source shard against the sha256 fq init recorded")
    p.add_argument("--tokens", type=positive_int, default=4096, metavar="N",
                   help="tokens of text to measure (default 4096)")
    p.add_argument("--seq-len", type=positive_int, default=256, metavar="N", help="tokens per window (default 256)")
    p.add_argument("--out", required=True, metavar="FILE", help="fq-eval/1 JSON to write")
    p.add_argument("--tsv", metavar="FILE", help="also write the rows as TSV")
    add_state_args(p)
    p.set_defaults(func=run)


def check_paths(args) -> None:
    """What would otherwise fail only after every forward pass (the outputs) or after the products are verified
    (the text): checked first."""
    from fq.core.paths import check_output_file, read_text_arg

    read_text_arg(args.text, "--text")
    check_output_file(args.out, "--out")
    if args.tsv:
        check_output_file(args.tsv, "--tsv")


def run(args) -> int:
    check_paths(args)
    from fq.runtime.evaluate import evaluate  # torch and transformers: only for this command

    key, _ = load_pinned(args)
    state = state_from_args(args)
    if state is not None:
        state.validate()
    shas = recorded_shards(args.campaign_json) if args.campaign_json else None
    evaluate(args.published, key, source=args.source, text=args.text, out_json=args.out, native_dir=args.native,
             weight_only_dir=args.weight_only,
             source_sha256=shas, tokens=args.tokens, seq_len=args.seq_len, out_tsv=args.tsv, state=state,
             progress=lambda m: print(printable(m), file=sys.stderr))
    print(printable(f"wrote {args.out}" + (f" and {args.tsv}" if args.tsv else "")))
    return 0
