"""fq: signed EXL3 bases and residual cartridges for mixture-of-experts checkpoints."""

__version__ = "0.1.0"
