"""Command-line options shared by the planning commands (plan, price): which source checkpoint,
which windows. Parsing only; the checks live in fq.model.source, fq.core.layer_ranges and fq.planning.plan."""
from __future__ import annotations

import argparse

from fq.core.units import parse_bytes
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
        "windows": args.windows,
        "disk_budget": parse_bytes(args.disk_budget, "--disk-budget") if args.disk_budget else None,
        "windows_on_disk": args.windows_on_disk,
    }
