"""Expert-usage statistics (fq-expert-usage/1): how often each routed expert was selected, per layer.

A stage with ``{"hot": N}`` encodes the N most used experts of each layer. Ranking is by count,
ties broken by the lower expert index, so the same file always selects the same experts, and the
N hottest are always within the M hottest for N <= M (a hot stage under a hot parent nests).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fq import canonical
from fq.errors import FqError
from fq.schema_check import validate

FORMAT = "fq-expert-usage/1"


@dataclass(frozen=True, eq=False)
class ExpertUsage:
    counts: Mapping[int, tuple[float, ...]]  # layer -> count per expert index
    sha256: str  # of the canonical document; part of a plan's run identity
    source: str

    def hottest(self, layer: int, n: int, n_experts: int) -> tuple[int, ...]:
        """The ``n`` most used experts of ``layer``, sorted by expert index."""
        if layer not in self.counts:
            raise FqError(f"expert usage {self.source}: no counts for layer {layer} "
                          f"(has layers {', '.join(str(l) for l in sorted(self.counts))})")
        counts = self.counts[layer]
        if len(counts) != n_experts:
            raise FqError(f"expert usage {self.source}: layers.{layer} has {len(counts)} counts; "
                          f"expected one per expert ({n_experts})")
        ranked = sorted(range(n_experts), key=lambda e: (-counts[e], e))
        return tuple(sorted(ranked[:n]))


def parse_usage(doc, source: str = "<usage>") -> ExpertUsage:
    validate(doc, "expert-usage", f"expert usage {source}")
    counts = {int(k): tuple(v) for k, v in doc["layers"].items()}
    return ExpertUsage(counts=counts, sha256=canonical.sha256_hex(canonical.dumps(doc)), source=source)


def load_usage(path: str | Path) -> ExpertUsage:
    path = Path(path)
    return parse_usage(canonical.load(path), str(path))
