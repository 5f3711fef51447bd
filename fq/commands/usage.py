"""``fq usage --model DIR --text FILE --out FILE``: measure expert usage (fq-expert-usage/1) by routing text."""
from __future__ import annotations

from fq.cli_args import positive_int


def register(sub) -> None:
    p = sub.add_parser("usage", help="measure expert usage (fq-expert-usage/1, for hot stages) by routing text through "
                                     "the model with transformers and counting each layer's router top-k selections")
    p.add_argument("--model", required=True, metavar="DIR", help="a Hugging Face checkpoint directory (config, tokenizer, "
                                                                   "safetensors) that transformers loads; never a hub "
                                                                   "repo id")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 calibration text, tokenized as one stream")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the statistics (the recipe's hot "
                                                                "selection reads them: --usage FILE / config usage:)")
    p.add_argument("--seq-len", type=positive_int, default=256, metavar="N",
                   help="tokens per window (default: %(default)s)")
    p.add_argument("--batch", type=positive_int, default=8, metavar="N",
                   help="windows per forward (default: %(default)s)")
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads (default: torch's)")
    p.add_argument("--no-hash-weights", action="store_true",
                   help="record only config/index sha256, not every shard's (hashing a huge checkpoint takes a while)")
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from fq.core.paths import check_output_file, read_text_arg
    from fq.model.usage import check_checkpoint_dir, measure_usage, parse_usage, write_usage

    # before the model loads and the measurement runs (tens of seconds): not only after them
    check_checkpoint_dir(args.model, "--model")
    check_output_file(args.out, "--out")
    text = read_text_arg(args.text, "--text")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    doc = measure_usage(args.model, text, seq_len=args.seq_len, batch=args.batch, hash_weights=not args.no_hash_weights,
                        text_name=Path(args.text).name, progress=True)
    write_usage(args.out, doc)
    u = parse_usage(doc, args.out)
    tokens = doc["provenance"]["text"]["tokens"]
    print(f"{args.out}: {len(u.counts)} MoE layers, {tokens} tokens routed; hottest per layer: "
          + "; ".join(f"{L}: {', '.join(map(str, u.hottest(L, 2, len(c))))}" for L, c in sorted(u.counts.items())))
    return 0
