"""``fq demo-model OUT``: write the embedded demo checkpoint (what the workflow's demo_model rule runs)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo-model", help="write the embedded demo MoE checkpoint (a trained Glm4MoeForCausalLM, "
                                          "Hugging Face layout)")
    p.add_argument("out", metavar="OUT", help="directory to write config.json, generation_config.json, the tokenizer, "
                                              "the shard index and the shards into: new, empty, or holding only "
                                              "this demo model's files (a rerun); anything else is refused")
    p.add_argument("--text", metavar="DIR", help="also write the demo's text splits (train.txt, calibration.txt, "
                                                 "heldout.txt) into DIR")
    p.set_defaults(func=run)


def run(args) -> int:
    from fq.model import demo_model

    d = demo_model.write(args.out, args.text, out_what="OUT", text_what="--text")
    print(f"demo model written to {d} ({len(demo_model.files())} files)"
          + (f"; text splits in {args.text}" if args.text else ""))
    return 0
