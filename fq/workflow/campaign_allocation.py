"""A campaign's allocation targets: budgeted bases (recipe ``bits``) take their K per unit from the campaign's own
sensitivity and allocate jobs, or from a named allocation file (docs/allocation.md). ``Campaign.alloc``."""
from __future__ import annotations

from fq.errors import FqError

SENSITIVITY_FILE = "allocation/sensitivity.json"  # the units measured (rule sensitivity), under OUT
ALLOCATION_FILE = "allocation/allocation.json"  # the allocations solved from it (rule allocate): what plans read


class AllocationTargets:
    def __init__(self, campaign):
        self.c = campaign  # fq.workflow.campaign.Campaign: what every job shares

    @property
    def settings(self) -> dict:
        from fq.allocation.document import SENSITIVITY, STREAM_BYTES

        cfg = self.c.config.get("allocation") or {}
        return {"file": cfg.get("file"), **{k: int(cfg.get(k, v)) for k, v in SENSITIVITY.items()},
                "ks": self._ks(cfg.get("ks")),
                "stream_bytes": int(float(cfg.get("stream_gib", STREAM_BYTES / 2**30)) * 2**30)}

    def _ks(self, ks) -> list | None:
        """allocation.ks checked against the budgeted nodes' codebook (None: every K of it)."""
        if ks is None:
            return None
        from fq.allocation.error_model import candidate_ks

        cbs = {n.codebook for n in self.c.recipe.nodes if n.is_budgeted} or {"mul1"}
        have = set.intersection(*(set(candidate_ks(cb)) for cb in cbs)) | {16}
        out = sorted({int(k) if float(k).is_integer() else float(k) for k in ks})
        bad = [k for k in out if k not in have]
        if bad:
            raise FqError(f"config allocation.ks {ks!r}: {', '.join(map(str, bad))} not a candidate K of "
                          f"codebook {', '.join(sorted(cbs))} (1..8, 16 kept as published; mul1 also 1.5, 2.5, 3.5)")
        return out

    @property
    def measures(self) -> bool:
        """Whether this campaign measures its own allocation (budgeted bases and no allocation.file)."""
        return self.c.recipe.needs_allocation and not self.settings["file"]

    @property
    def sensitivity_file(self) -> str:
        return self.c.p(SENSITIVITY_FILE)

    @property
    def file(self) -> str:
        return self.settings["file"] or self.c.p(ALLOCATION_FILE)

    @property
    def sensitivity_text(self) -> str:
        """The text the sensitivity job measures on: the calibration text (the demo's split in a weight-only demo)."""
        return self.c.calib.text if self.c.calib.settings else self.c.p("demo-text", "calibration.txt")

    @property
    def budgets(self) -> list[float]:
        return sorted({n.bits for n in self.c.recipe.budgeted})
