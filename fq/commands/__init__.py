"""Subcommands of ``fq``: one module per group, each exposing ``register(subparsers)``.

What it may import: anything of fq but fq.cli (which imports it). A command's work lives in the package of its
concept (fq.provenance.verify, fq.planning.price, fq.workflow.gate, ...); the module here parses arguments, calls
it and prints. Torch-backed packages are imported inside the handler that needs them (tests/test_imports.py).
"""
