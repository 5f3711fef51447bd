"""``fq plan``: blocks, windows, staging/retirement and peak disk of a campaign, written as a plan file."""
from __future__ import annotations

from fq.cli_args import (add_calibration_args, add_source_args, add_window_args, calibration_from_args,
                         source_from_args, window_kwargs)
from fq.core.paths import check_output_file
from fq.model.usage import load_usage
from fq.planning.calibration_cost import windows_budget
from fq.planning.plan import DEFAULT_BLOCK_SIZE, make_plan, plan_table, write_plan
from fq.allocation import document
from fq.planning.budget import allocation_table, resolve_args
from fq.planning.recipe import load_recipe


def register(sub) -> None:
    p = sub.add_parser("plan", help="plan a campaign (blocks, windows, staging, peak disk) and write the plan file",
                       description=__doc__)
    p.add_argument("recipe", help="fq-cartridge/2 recipe JSON")
    add_source_args(p)
    p.add_argument("--usage", metavar="FILE", help="expert-usage statistics (fq-expert-usage/1) for hot stages")
    p.add_argument("--allocation", metavar="FILE", help="fq-allocation/1 (fq allocate) holding an allocation at each "
                                                        "budgeted base's bits: K per unit, shown per layer; without "
                                                        "it a budgeted base is planned at its budget's nearest K")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help=f"experts per block (default {DEFAULT_BLOCK_SIZE})")
    add_window_args(p)
    add_calibration_args(p)
    p.add_argument("--out", metavar="PLAN.json", help="write the plan here (canonical JSON, atomic); omit to only print")
    p.set_defaults(func=run)


def run(args) -> int:
    if args.out:  # before the source is read (perhaps from the hub) and the plan made
        check_output_file(args.out, "--out")
    recipe = load_recipe(args.recipe)
    source = source_from_args(args)
    usage = load_usage(args.usage) if args.usage else None
    calibration = calibration_from_args(args, source)
    windows = window_kwargs(args)
    # the Hessians and hidden states share the disk budget (None and weight-only campaigns pass through)
    windows["disk_budget"] = windows_budget(windows["disk_budget"], calibration, "--disk-budget")
    recipe, allocation = resolve_args(recipe, source, args.allocation)
    plan = make_plan(recipe, source, usage=usage, block_size=args.block_size, **windows,
                     allocation_sha256=allocation and document.sha256(allocation))
    print(plan_table(plan))
    if recipe.needs_allocation:
        print()
        print(allocation_table(recipe, source) if allocation is not None else
              f"budgeted node(s) {', '.join(n.name for n in recipe.nodes if n.is_budgeted)}: no --allocation, planned "
              "at their budget's nearest K (a stage: the first experts of each layer); the campaign measures the "
              "allocation first (docs/allocation.md)")
    if calibration is not None:
        from fq.core.units import fmt_bytes
        from fq.planning.calibration_cost import calibration_lines, price_chain

        print("\n".join(calibration_lines(price_chain(calibration, source, recipe))))
        print(f"peak local with calibration: {fmt_bytes(plan.bytes['peak_local'] + calibration.disk_bytes)} "
              "(the windows above were chosen from the disk budget less calibration's)")
    if args.out:
        digest = write_plan(args.out, plan)
        print(f"\nwrote {args.out} (plan sha256 {digest})")
    return 0
