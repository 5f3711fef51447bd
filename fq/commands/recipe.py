"""``fq recipe``: validate recipes and show their nodes, products and derived numbers."""
from __future__ import annotations

from fq.planning.recipe import load_recipe, recipe_table


def register(sub) -> None:
    p = sub.add_parser("recipe", help="validate fq-cartridge/2 recipes and print their graph", description=__doc__)
    p.add_argument("recipes", nargs="+", metavar="RECIPE")
    p.set_defaults(func=run)


def run(args) -> int:
    for i, path in enumerate(args.recipes):
        if i:
            print()
        print(recipe_table(load_recipe(path)))
    return 0
