"""Command-line options shared by several commands: which source checkpoint and which windows (plan, price),
the consumers' plan-version state (verify, eval, combine, tp-export), integer types. Parsing only; the checks live
in fq.model.source, fq.core.layer_ranges, fq.planning.plan and fq.provenance.assembly.PlanState."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from fq.core.targets import EXLLAMAV3
from fq.core.units import is_decimal, parse_bytes
from fq.hessian.affinity import WEIGHTINGS
from fq.model.source import SourceModel, load_sizes, load_source
from fq.planning.plan import DEFAULT_WINDOWS_ON_DISK


def add_source_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, metavar="DIR|REPO",
                   help="checkpoint directory with config.json and model.safetensors.index.json, or a hub repo id "
                        "(metadata only; needs the hub to be reachable)")
    p.add_argument("--sizes", metavar="FILE",
                   help="shard sizes listing (JSON name -> bytes, or the hub's [{path, size}]) when the shards are "
                        "not downloaded yet")
    p.add_argument("--revision", help="source revision recorded in the run identity (default: the hub commit, or a "
                                      "digest of config.json and the index for a local directory)")
    p.add_argument("--allow-unloadable", action="store_true",
                   help=f"plan bases of a family no EXL3 runtime loads (exllamav3 {EXLLAMAV3} has no class for it)")


def source_from_args(args) -> SourceModel:
    sizes = load_sizes(args.sizes) if args.sizes else None
    return load_source(args.model, revision=args.revision, sizes=sizes)


def add_window_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--windows", metavar="RANGES",
                   help="layer windows, e.g. '3-12,13-40,41-77': must cover exactly the MoE layers, each once")
    g.add_argument("--disk-budget", metavar="SIZE",
                   help="local disk for source + outputs, e.g. 1.6TB: the fewest balanced windows that fit")
    p.add_argument("--windows-on-disk", type=int, default=DEFAULT_WINDOWS_ON_DISK, metavar="W",
                   help=f"window w is fetched once window w-W retired (default {DEFAULT_WINDOWS_ON_DISK})")


def window_kwargs(args) -> dict:
    return {
        "allow_unloadable": args.allow_unloadable,
        "windows": args.windows,
        "disk_budget": parse_bytes(args.disk_budget, "--disk-budget") if args.disk_budget else None,
        "windows_on_disk": args.windows_on_disk,
    }


def add_calibration_args(p: argparse.ArgumentParser) -> None:
    from fq.planning.calibration_cost import (DEFAULT_LDLQ_FACTOR, DEFAULT_READ_MB_S, DEFAULT_SETUP_S, DEFAULT_TFLOPS,
                                              DEFAULT_WRITE_MB_S)

    p.add_argument("--calibration", metavar="ROWSxCOLS",
                   help="a calibrated campaign: its calibration chain (all-experts capture), Hessian disk and LDLQ "
                        "encodes (exllamav3's converter: 250x2048; docs/calibration.md)")
    fitted = "fitted on an H100 rehearsal, docs/pricing.md"
    p.add_argument("--calib-tflops", type=float, default=None,
                   help=f"calibration chain's effective rate over its counted FLOPs in TFLOP/s (default "
                        f"{DEFAULT_TFLOPS:g}: {fitted})")
    p.add_argument("--calib-read-mb-s", type=float, default=None,
                   help=f"calibration chain's read rate, hidden states and source shards, in MB/s (default "
                        f"{DEFAULT_READ_MB_S:g}: {fitted})")
    p.add_argument("--calib-write-mb-s", type=float, default=None,
                   help=f"calibration chain's write rate, hidden states and Hessians, in MB/s (default "
                        f"{DEFAULT_WRITE_MB_S:g}: {fitted})")
    p.add_argument("--calib-setup-s", type=float, default=None,
                   help=f"seconds each calibration chain job takes to start (default {DEFAULT_SETUP_S:g})")
    p.add_argument("--ldlq-factor", type=float, default=None,
                   help=f"LDLQ encode time over weight-only (default {DEFAULT_LDLQ_FACTOR:g}, measured on an H200 at "
                        f"K2-K4)")
    p.add_argument("--weighting", default="none", choices=WEIGHTINGS,
                   help="with --calibration: the expert Hessians' router-affinity weighting (config "
                        "calibration.weighting): none (default), affinity-down, or affinity (one input Hessian per "
                        "expert: more disk, memory and capture time; docs/calibration.md)")


def positive_int(text: str) -> int:
    """argparse type: a positive decimal integer (ASCII digits)."""
    if not is_decimal(text) or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def count(text: str) -> int:
    """argparse type: a non-negative decimal integer (ASCII digits)."""
    if not is_decimal(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative integer")
    return int(text)


def calibration_from_args(args, source: SourceModel):
    """The CalibrationPrice of ``--calibration ROWSxCOLS`` and its rates (None without it)."""
    from fq.errors import FqError

    if not args.calibration:
        if args.weighting != "none":
            raise FqError(f"--weighting {args.weighting}: it weights a calibrated campaign's Hessians; give "
                          "--calibration ROWSxCOLS too")
        return None
    from fq.planning.calibration_cost import price_calibration

    rows, _, cols = args.calibration.lower().partition("x")
    if not (is_decimal(rows) and is_decimal(cols)):
        raise FqError(f"--calibration: expected ROWSxCOLS (e.g. 250x2048), got {args.calibration!r}")
    given = {"tflops": args.calib_tflops, "read_mb_s": args.calib_read_mb_s, "write_mb_s": args.calib_write_mb_s,
             "setup_s": args.calib_setup_s, "ldlq_factor": args.ldlq_factor}
    return price_calibration(source, int(rows), int(cols), weighting=args.weighting,
                             **{k: v for k, v in given.items() if v is not None})


def default_state() -> Path:
    """The plan-version state every consumer reads and records unless told otherwise (XDG state directory)."""
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return Path(base) / "fq" / "plan-versions.json"


def add_state_args(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--state", metavar="FILE",
                   help=f"plan-version state: refuse plans and publications older than ones seen (per signer, across "
                        f"its campaigns) and record what was accepted (default {default_state()})")
    g.add_argument("--no-state", action="store_true", help="do not read or record plan versions")


def state_from_args(args):
    """The PlanState of ``--state``/``--no-state`` (None with --no-state)."""
    from fq.provenance.assembly import PlanState

    return None if args.no_state else PlanState(args.state or default_state())
