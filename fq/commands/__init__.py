"""Subcommands of ``fq``: one module per group, each exposing ``register(subparsers)``."""
