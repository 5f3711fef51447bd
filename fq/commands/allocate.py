"""``fq allocate --model DIR --text FILE --bits B --out FILE``: a K per allocation unit by measured sensitivity."""
from __future__ import annotations

from fq.allocation.document import SENSITIVITY
from fq.cli_args import positive_int


def register(sub) -> None:
    p = sub.add_parser("allocate", help="measure what each unit's LDLQ-shaped error costs the source model's output "
                                        "on calibration text (injected at a few K, KL measured; Fisher forms for "
                                        "the experts) and choose a K per unit (exllamav3's rules) that minimizes "
                                        "predicted KL under a bits budget")
    p.add_argument("--model", required=True, metavar="DIR", help="a checkpoint directory transformers loads")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 calibration text")
    p.add_argument("--out", required=True, metavar="FILE", help="where to write the allocation (fq-allocation/1)")
    p.add_argument("--bits", required=True, type=float, action="append", metavar="B",
                   help="bits per weight over every allocated linear (stored bytes x 8 / weights); repeat for several")
    p.add_argument("--codebook", default="mul1", choices=("mul1", "mcg", "3inst"))
    p.add_argument("--ks", default="1-8", metavar="LIST", help="candidate K, e.g. 2-6 or 2,2.5,3,16 (16: kept as "
                                                                "published; default %(default)s)")
    p.add_argument("--rows", type=positive_int, default=SENSITIVITY["rows"], metavar="N", help="calibration windows (default %(default)s)")
    p.add_argument("--columns", type=positive_int, default=SENSITIVITY["columns"], metavar="N", help="tokens per window (%(default)s)")
    p.add_argument("--samples", type=positive_int, default=SENSITIVITY["samples"], metavar="N",
                   help="label samples per window for the experts' Fisher forms (default %(default)s)")
    p.add_argument("--seed", type=int, default=SENSITIVITY["seed"])
    p.add_argument("--threads", type=positive_int, default=None, metavar="N", help="torch CPU threads")
    p.add_argument("--streamed", action="store_true",
                   help="one decoder layer in memory at a time (as the campaign's sensitivity job; families with a "
                        "calibration chain): the same result, for a model larger than this machine's memory")
    p.add_argument("--stream-gib", type=float, default=None, metavar="GIB",
                   help="with --streamed: memory for the injection streams alive at once (default 16 GiB)")
    p.add_argument("--device", default="cpu", metavar="DEV",
                   help="with --streamed: where the layers run, cpu or cuda:N (default %(default)s)")
    p.set_defaults(func=run)


def parse_ks(text: str, codebook: str = "mul1") -> list:
    """Candidate K from ``--ks``: values and ranges; a range holds the half-integer rates inside it where the codebook
    has them (mul1: 1.5, 2.5, 3.5), and a half-integer value is taken with mul1 only."""
    from fq.allocation.error_model import candidate_ks
    from fq.errors import FqError

    have = candidate_ks(codebook)
    ks: set = set()
    try:
        for part in text.replace(" ", "").split(","):
            lo, _, hi = part.partition("-")
            a, b = float(lo), float(hi or lo)
            if hi:
                ks.update(k for k in have if a <= k <= b)
            ks.add(int(a) if a == int(a) else a)
            if hi:
                ks.add(int(b) if b == int(b) else b)
    except ValueError:
        raise FqError(f"--ks {text!r}: expected K values or ranges such as 2-6 or 2,2.5,3,16") from None
    bad = sorted(k for k in ks if k not in have and k != 16)
    if bad or not ks:
        raise FqError(f"--ks {text!r}: K must be 1..8, 16 (kept as published) or, with codebook mul1, 1.5, 2.5, "
                      f"3.5 (codebook {codebook}); got {bad or 'none'}")
    return sorted(ks)


def run(args) -> int:
    from pathlib import Path

    import torch
    from tqdm import tqdm

    from fq.allocation import document, solve
    from fq.allocation.measure import unit_bytes, weights
    from fq.core import atomic, canonical
    from fq.core.paths import check_output_file, read_text_arg
    from fq.errors import FqError
    from fq.model.usage import check_checkpoint_dir
    from fq.workflow.allocation import measure

    check_checkpoint_dir(args.model, "--model")
    check_output_file(args.out, "--out")
    text = read_text_arg(args.text, "--text")
    ks = parse_ks(args.ks, args.codebook)
    for b in args.bits:
        solve.budget_from_bits(b, 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.stream_gib is not None and (not args.streamed or args.stream_gib <= 0):
        raise FqError(f"--stream-gib {args.stream_gib}: a positive size, with --streamed")
    if args.device != "cpu" and not args.streamed:
        raise FqError(f"--device {args.device}: with --streamed (the in-memory measurement runs where transformers "
                      "loads the model)")
    if args.streamed:  # the shapes only (meta tensors): nothing of the weights is read
        from fq.allocation.streamed import Source

        W = Source(args.model, args.columns).shapes()
    else:
        from transformers import AutoModelForCausalLM

        W = weights(AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval())
    sizes, n_weights = unit_bytes(W, ks), sum(w.numel() for w in W.values())
    for b in args.bits:  # an unmeetable budget is refused before the measurement, by the solver's own check
        solve.solve({u: {K: (0.0, by) for K, by in s.items()} for u, s in sizes.items()},
                    solve.budget_from_bits(b, n_weights), n_weights)
    del W
    if args.streamed:
        bar = tqdm(desc="sensitivity", unit="layer")

        def progress(what, done, total):
            bar.total = total
            bar.update(1)
    else:
        bar = tqdm(total=args.rows, desc="sensitivity", unit="window")

        def progress(done, total):
            bar.update(1)
    doc = measure(Path(args.model), text, codebook=args.codebook, ks=ks, rows=args.rows,
                  columns=args.columns, samples=args.samples, seed=args.seed, progress=progress,
                  streamed=args.streamed,
                  stream_bytes=None if args.stream_gib is None else int(args.stream_gib * 2**30),
                  device=args.device)
    bar.close()
    doc = document.with_allocations(doc, args.bits)
    for a in doc["allocations"]:
        print(f"{a['budget_bits']:g} bits: {a['bits']:.4f} bits, {a['bytes']} bytes, predicted KL "
              f"{a['predicted_kl']:.6g} (within {a['gap_bound']:.2g} of the optimum)")
        print("  " + ", ".join(f"{u} K{k}" for u, k in a["ks"].items()))
    atomic.write_text(args.out, canonical.pretty(doc))
    print(f"{args.out}: {len(doc['units'])} units, {len(doc['allocations'])} allocation(s)")
    return 0
