"""``fq price``: GPU-hours, dollars, wall time for 1..N GPUs and storage of one or more recipes
on one source, from a per-K cost table; with two recipes, their cost ratio."""
from __future__ import annotations

from fq.cli_args import (add_calibration_args, add_source_args, add_window_args, calibration_from_args,
                         source_from_args, window_kwargs)
from fq.planning.price import (DEFAULT_DOWNLOAD_MB_S, DEFAULT_GPUS, DEFAULT_USD_PER_GPU_HOUR, DEFAULT_VERIFY_MB_S,
                               assumptions_line, comparison_table, cost_table_entries, load_cost_table, price_recipe,
                               price_table, source_line, table_line)
from fq.planning.recipe import load_recipe


def register(sub) -> None:
    p = sub.add_parser("price", help="price one or more recipes on a source before renting GPUs", description=__doc__)
    p.add_argument("recipes", nargs="+", metavar="RECIPE", help="fq-cartridge/2 recipe JSON (two or more: side by side)")
    add_source_args(p)
    p.add_argument("--gpus", type=int, default=DEFAULT_GPUS, help=f"price 1..N GPUs (default {DEFAULT_GPUS})")
    p.add_argument("--usd-per-gpu-hour", type=float, default=DEFAULT_USD_PER_GPU_HOUR,
                   help=f"GPU rental price (default {DEFAULT_USD_PER_GPU_HOUR:.2f}, an assumption)")
    p.add_argument("--cost-table", metavar="FILE", help="fq-cost-table/1 (default: the packaged H200 reference table)")
    p.add_argument("--gpu-model", help="GPU model section of the cost table (needed when it holds several)")
    p.add_argument("--download-mb-s", type=float, default=DEFAULT_DOWNLOAD_MB_S,
                   help=f"source download rate in MB/s (default {DEFAULT_DOWNLOAD_MB_S:g}, a 1 Gbit/s link)")
    p.add_argument("--verify-mb-s", type=float, default=DEFAULT_VERIFY_MB_S,
                   help=f"finalize re-hash rate in MB/s (default {DEFAULT_VERIFY_MB_S:g}, measured in the seed)")
    add_window_args(p)
    p.add_argument("--show-cost-table", action="store_true", help="also print every entry of the cost table used")
    add_calibration_args(p)
    p.add_argument("--allocation", metavar="FILE", help="fq-allocation/1 (fq allocate) for budgeted bases (recipe "
                                                        "bits); without it they are priced at their budget's nearest K")
    p.set_defaults(func=run)


def run(args) -> int:
    from fq.planning.budget import resolve_args

    source = source_from_args(args)
    recipes = [resolve_args(load_recipe(r), source, args.allocation)[0] for r in args.recipes]
    table = load_cost_table(args.cost_table, args.gpu_model)
    calibration = calibration_from_args(args, source)
    prices = [price_recipe(r, source, table, gpus=args.gpus, usd_per_gpu_hour=args.usd_per_gpu_hour,
                           download_bytes_per_s=args.download_mb_s * 1e6, verify_bytes_per_s=args.verify_mb_s * 1e6,
                           calibration=calibration, **window_kwargs(args)) for r in recipes]
    print(source_line(source))
    print(table_line(table))
    if args.show_cost_table:
        print(cost_table_entries(table))
    print(assumptions_line(prices[0].assumptions))
    for p in prices:
        print()
        print(price_table(p))
    if len(prices) > 1:
        print()
        print(comparison_table(prices))
    return 0
