"""``fq cost-table``: measure the cost table of ``fq price`` on the GPU at hand (or, with --device
cpu, on this CPU) by timing fq.codec.quantize, and write it atomically. Formerly ``fq calibrate`` (a name every other
part of fq gives Hessian capture): that spelling is kept as an alias for one release and says so."""
from __future__ import annotations

import platform
import sys
from pathlib import Path

import fq
from fq.core import canonical
from fq.core.atomic import write_text
from fq.core.schema_check import validate
from fq.errors import FqError
from fq.planning.cost_table import DEFAULT_SHAPES, measure, merge_table, parse_ks, parse_shapes, table_section
from fq.planning.recipe import CODEBOOKS


def register(sub) -> None:
    p = sub.add_parser("cost-table", aliases=["calibrate"],
                       help="measure seconds per matrix pass by K on this GPU into a cost table", description=__doc__)
    p.add_argument("--out", required=True, metavar="FILE",
                   help="cost table to write; an existing table keeps its other GPU models")
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda; refused without CUDA)")
    p.add_argument("--k", default="1-8", help="K values, e.g. 1-4,8 (default 1-8)")
    p.add_argument("--codebook", default=",".join(CODEBOOKS), help=f"codebooks (default {','.join(CODEBOOKS)})")
    p.add_argument("--shape", default=",".join(f"{o}x{i}" for o, i in DEFAULT_SHAPES),
                   help="matrix shapes OUTxIN (default GLM-5's expert matrices 2048x6144,6144x2048)")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per entry; the median is kept (default 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs before each entry (default 1)")
    p.add_argument("--gpu-model", help="name of the table section (default: the device's own name)")
    p.set_defaults(func=run)


def run(args) -> int:
    import torch

    if args.command == "calibrate":
        print("fq calibrate is now fq cost-table (it measures the cost table, not calibration); the old name goes in "
              "the next release", file=sys.stderr)
    device = args.device
    if device == "cpu":
        name = "cpu: " + _cpu_name()
        sync = None
    elif device == "cuda" or device.startswith("cuda:"):
        if not torch.cuda.is_available():
            raise FqError("no CUDA device visible: fq cost-table measures the GPU at hand; run it on the GPU machine, "
                          "or pass --device cpu for a CPU table")
        dev = torch.device(device)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= torch.cuda.device_count():
            raise FqError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) visible")
        device = f"cuda:{index}"
        name = torch.cuda.get_device_name(index)
        sync = lambda: torch.cuda.synchronize(index)  # noqa: E731
    else:
        raise FqError(f"--device: expected cuda, cuda:N or cpu, got {device!r}")
    codebooks = [c for c in args.codebook.replace(" ", ",").split(",") if c]
    try:
        from fq.codec import quantize
    except ImportError as e:
        raise FqError(f"fq.codec.quantize is not available in this build ({e})") from None

    out = Path(args.out)
    existing = None
    if out.exists():
        existing = canonical.load(out)
        validate(existing, "cost-table", f"cost table {out}")
    entries = measure(quantize, ks=parse_ks(args.k), codebooks=codebooks, shapes=parse_shapes(args.shape),
                      device=device, repeats=args.repeats, warmup=args.warmup, synchronize=sync)
    measured_with = {"fq": fq.__version__, "torch": torch.__version__, "device": device,
                     "repeats": args.repeats, "warmup": args.warmup}
    gpu = args.gpu_model or name
    doc = merge_table(existing, gpu, table_section(entries, f"fq.codec.quantize (fq {fq.__version__})", measured_with))
    validate(doc, "cost-table", f"cost table {out}")
    write_text(out, canonical.pretty(doc))
    print(f"{'codebook':<8} {'K':>2} {'shape':>10} {'seconds':>10}")
    for e in entries:
        print(f"{e['codebook']:<8} {e['K']:>2} {'x'.join(map(str, e['shape'])):>10} {e['seconds']:>10.4f}")
    print(f"wrote {out} (section {gpu!r})")
    return 0


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
