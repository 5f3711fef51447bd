"""Train the embedded demo model (fq/data/demo/) from scratch: corpus, tokenizer, model, evaluation, usage.

    .venv/bin/python tools/train_demo_model.py [--out DIR] [--steps N]

CPU only (2 threads), about 15 minutes on a 2-core machine (docs/demo_model.md); everything is seeded. Writes the
data files and manifest.json into DIR (default: fq/data/demo, the package data) and prints the manifest's sha256,
which fq.model.demo_model.MANIFEST_SHA256 must then be set to. Logic: fq.model.demo_train.
"""
import argparse
import sys

from fq.model import demo_train
from fq.model.demo_model import DATA


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DATA), help="directory for the data files (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=demo_train.STEPS, help="optimizer steps (default: %(default)s)")
    ap.add_argument("--trained", metavar="DIR", help="keep the trained float32 model in DIR; if DIR already holds one, "
                                                    "export it instead of training again")
    args = ap.parse_args(argv)
    demo_train.run(args.out, steps=args.steps, trained=args.trained, log=lambda m: print(m, file=sys.stderr, flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
