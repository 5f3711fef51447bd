"""``fq generate PUBLISHED PRODUCT --key PUBKEY (--prompt TEXT ... | --prompt-file FILE) [--max-new-tokens N]
[--device cuda:0] [--cache-tokens N]``.

One product of a published campaign served by exllamav3 (CUDA): verified under the pinned key first (plan, whole
base, every stage byte; ``fq.runtime.exl3``), then loaded with a paged KV cache and run through exllamav3's own
Generator, greedy, every prompt enqueued at once (batched). Chain products generate as the sum of their stages. Prints
each completion; ``--json`` writes prompts, token ids and completions.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from fq.cli_args import add_state_args, positive_int, state_from_args
from fq.commands.verify import load_pinned
from fq.display import printable
from fq.errors import FqError


def register(sub) -> None:
    p = sub.add_parser("generate", help="verify one product and generate text with it in exllamav3 (CUDA)")
    p.add_argument("published", metavar="PUBLISHED", help="the published tree (holds publication.intoto.jsonl)")
    p.add_argument("product", metavar="PRODUCT", help="a product the publication lists (a base or a chain)")
    p.add_argument("--key", required=True, metavar="PUBKEY", help="the signer's public key (PEM)")
    p.add_argument("--fingerprint", metavar="HEX", help="refuse unless PUBKEY has this fingerprint")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt (repeat for a batch)")
    src.add_argument("--prompt-file", metavar="FILE", help="prompts, one per line (UTF-8)")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, metavar="N", help="tokens per completion (64)")
    p.add_argument("--device", default="cuda:0", metavar="DEV", help="the CUDA device (default cuda:0)")
    p.add_argument("--cache-tokens", type=positive_int, default=8192, metavar="N",
                   help="KV cache size in tokens, a multiple of 256 (default 8192)")
    p.add_argument("--json", metavar="FILE", help="also write the completions as JSON")
    add_state_args(p)
    p.set_defaults(func=run)


def _prompts(args) -> list[str]:
    if args.prompt:
        prompts = args.prompt
    else:
        from fq.core.paths import read_text_arg

        prompts = [line for line in read_text_arg(args.prompt_file, "--prompt-file").splitlines() if line.strip()]
    if not prompts or any(not p for p in prompts):
        raise FqError("--prompt/--prompt-file: no prompt, or an empty one")
    return prompts


def run(args) -> int:
    if args.cache_tokens % 256:
        raise FqError(f"--cache-tokens {args.cache_tokens}: exllamav3's cache takes a multiple of 256 tokens")
    if args.max_new_tokens >= args.cache_tokens:  # refused before anything is verified or loaded
        raise FqError(f"--max-new-tokens {args.max_new_tokens}: a completion and its prompt must fit in the KV cache "
                      f"(--cache-tokens {args.cache_tokens}); expected at most {args.cache_tokens - 1}")
    prompts = _prompts(args)
    if args.json:
        from fq.core.paths import check_output_file

        check_output_file(args.json, "--json")
    from fq.provenance.publication import read_publication
    from fq.runtime.exl3 import load_exl3_product

    key, _ = load_pinned(args)
    state = state_from_args(args)
    if state is not None:
        state.validate()
    products = read_publication(args.published, key).predicate["products"]
    if args.product not in products:
        raise FqError(f"{args.published}: no product {args.product!r} in the publication (it lists "
                      f"{', '.join(sorted(products))})")
    plan = Path(args.published) / products[args.product]["file"]
    with load_exl3_product(plan, key, device=args.device, state=state, cache_tokens=args.cache_tokens) as p:
        ids = [p.encode(t) for t in prompts]
        for prompt, i in zip(prompts, ids):
            if len(i) + args.max_new_tokens > args.cache_tokens:
                raise FqError(f"prompt {prompt[:40]!r}{'…' if len(prompt) > 40 else ''}: {len(i)} tokens and "
                              f"--max-new-tokens {args.max_new_tokens} do not fit in the KV cache (--cache-tokens "
                              f"{args.cache_tokens})")
        outs = p.generate(ids, args.max_new_tokens)
        texts = [p.decode(o["tokens"]) for o in outs]
    for prompt, text in zip(prompts, texts):
        print(printable(f"--- {prompt}"))
        print(printable(text))
    if args.json:
        from fq.core.atomic import write_text

        write_text(args.json, json.dumps({"product": args.product, "completions": [
            {"prompt": pr, "prompt_ids": i, "tokens": o["tokens"], "text": t}
            for pr, i, o, t in zip(prompts, ids, outs, texts)]}, indent=1) + "\n")
    print(f"{len(prompts)} completion(s) of product {printable(args.product)}", file=sys.stderr)
    return 0
