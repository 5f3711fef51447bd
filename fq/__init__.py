"""fq: signed EXL3 bases and residual cartridges for mixture-of-experts checkpoints.

One package per concept (fq.core, fq.codec, fq.model, fq.planning, fq.provenance, fq.runtime, fq.tp, fq.workflow,
fq.promote, fq.commands), each ``__init__`` saying what it owns and may import. They are layered: a package imports
only the ones below it. The order is declared once, ``LAYERS`` in tests/test_layering.py (README, "Layout").
This module itself imports nothing.
"""

__version__ = "0.1.0"
