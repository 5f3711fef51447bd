"""``fq demo-model OUT``: write the embedded demo checkpoint (what the workflow's demo_model rule runs)."""
from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo-model", help="write the embedded, seeded demo MoE checkpoint (Hugging Face layout)")
    p.add_argument("out", metavar="OUT", help="directory to write config.json, the index, shards and expert_usage.json into")
    p.set_defaults(func=run)


def run(args) -> int:
    from fq import demo_model

    d = demo_model.write(args.out)
    print(f"demo model written to {d} ({len(demo_model.files())} files + expert_usage.json)")
    return 0
