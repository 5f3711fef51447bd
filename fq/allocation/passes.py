"""How the streamed sensitivity measurement (fq.allocation.streamed) walks the layers: pure, for the measurement and
for ``fq price`` alike.

The injection streams (one per unit and injected K, each rows x columns x hidden float32) are taken in layer order
in groups that fit a memory cap; each group is one pass over the layers, from its first unit's layer to the head.

    plan(unit_layers, streams_per_unit, per_stream, stream_bytes) -> [[unit, ...] per pass]
    layer_reads(n_layers, passes, unit_layers) -> layer (and head) reads of the whole measurement
"""
from __future__ import annotations


def plan(unit_layers: dict, streams_per_unit: int, per_stream: int, stream_bytes: int) -> list:
    """Units (in the order given, each with its layer; the head's is the layer count) grouped into passes whose
    ``streams_per_unit`` streams of ``per_stream`` bytes each fit ``stream_bytes`` (at least one unit a pass)."""
    fit = max(1, stream_bytes // max(1, per_stream * streams_per_unit))
    order = list(unit_layers)
    return [order[i: i + fit] for i in range(0, len(order), fit)]


def starts(passes: list, unit_layers: dict) -> list:
    """The first layer each pass reads (its first unit's)."""
    return [min(unit_layers[u] for u in p) for p in passes]


def layer_reads(n_layers: int, passes: list, unit_layers: dict) -> int:
    """Layer (and head) reads of the whole measurement: the forward's (every layer and the head), the Fisher's (every
    layer), and each injection pass's from its first unit's layer to the head."""
    return 2 * n_layers + 1 + sum(n_layers + 1 - s for s in starts(passes, unit_layers))
