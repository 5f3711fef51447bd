"""What a calibrated campaign adds to the price (docs/calibration.md): the calibration chain's GPU time, the Hessian
files' disk, and LDLQ's encode premium. A projection from the model's shapes, stated as such, not a measurement
of this model: the capture is priced at all-experts (every token through every routed expert, the default and the
upper bound), its FLOPs counted per MoE layer as

    expert forward    tokens · E · 3 · 2 · hidden · inter
    input Hessian     2 · tokens · hidden²          (one per layer, float64 sums)
    down Hessians     E · 2 · tokens · inter²       (one per expert: the dominant term at GLM-5 sizes)

(attention, norms and dense layers left out of the count), run at ``tflops``: default 42, measured on an H200
(benchmarks/capture_cost.py --experts 8,32 --rows 4,40 --cols 2048: a GLM-5-shaped MoE layer at two expert and two
token counts, which separates the layer's one-time setup from the per-token work, projected to 256 experts and
250 x 2048 tokens: 259 s per layer for the 11.0 PFLOP count, 42.6 TFLOP/s, setup 20 s). Three runs on one warm
H200 projected 259, 155 and 196 s (42.6, 71.3, 56.4 TFLOP/s): the default is the slowest, so a price does not
promise what a run may miss. An earlier run that could not separate the setup projected 1416 s (7.8 TFLOP/s), an
upper bound now known to be 5x too high.
LDLQ's encode premium ``ldlq_factor`` (default 1.35) is measured: 0.478 s per 2048×6144 matrix at K2 batched ×32
(a layer's gate/up matrices share one H) against 0.359 s weight-only in the same run, H200; 1.36× at K3 and K4
(docs/benchmarks.md).
"""
from __future__ import annotations

from dataclasses import dataclass

from fq.errors import FqError
from fq.hessian.store import layer_bytes
from fq.model.source import SourceModel

DEFAULT_TFLOPS = 42.0  # the slowest of three H200 projections (see above; docs/pricing.md)
DEFAULT_LDLQ_FACTOR = 1.35
# Bounds a price is quoted within: beyond them a figure is a typo, not a campaign (1e6 rows of 1 Mi tokens is
# 1e12 calibration tokens; no accelerator does 1e5 TFLOP/s; LDLQ is a small multiple of a weight-only encode).
MAX_ROWS, MAX_COLUMNS = 1_000_000, 1 << 20
MAX_TFLOPS, MAX_LDLQ_FACTOR = 1e5, 100.0


@dataclass(frozen=True)
class CalibrationPrice:
    rows: int
    cols: int
    layers: tuple[int, ...]  # calibrated MoE layers
    flops_per_layer: float
    seconds_per_layer: float
    hessian_bytes_per_layer: int
    hidden_bytes: int  # one hidden-state file between two layers (two exist at a time)
    tflops: float
    ldlq_factor: float

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    @property
    def gpu_seconds(self) -> float:
        return self.seconds_per_layer * len(self.layers)

    @property
    def hessian_bytes(self) -> int:
        return self.hessian_bytes_per_layer * len(self.layers)

    @property
    def disk_bytes(self) -> int:
        """What calibration adds to local disk at its peak: every Hessian (kept for resume) and two hidden files."""
        return self.hessian_bytes + 2 * self.hidden_bytes


def capture_flops(tokens: int, experts: int, hidden: int, inter: int) -> int:
    """One MoE layer's all-experts capture, counted as the module docstring says (expert forward, input Hessian,
    down Hessians)."""
    return tokens * experts * 6 * hidden * inter + 2 * tokens * hidden * hidden + experts * 2 * tokens * inter * inter


def price_calibration(source: SourceModel, rows: int, cols: int, *, tflops: float = DEFAULT_TFLOPS,
                      ldlq_factor: float = DEFAULT_LDLQ_FACTOR) -> CalibrationPrice:
    from fq.model import families

    families.check_calibration(source.family_entry, f"{source.origin}/config.json")  # before a price is quoted
    for what, v, most in (("calibration rows", rows, MAX_ROWS), ("calibration columns", cols, MAX_COLUMNS)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
            raise FqError(f"{what}: expected an integer in 1..{most}, got {v!r}")
    for what, v, most in (("calibration TFLOP/s", tflops, MAX_TFLOPS), ("LDLQ encode factor", ldlq_factor, MAX_LDLQ_FACTOR)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 < v <= most:  # NaN and inf fail too
            raise FqError(f"{what}: expected a number above 0 and at most {most:g}, got {v!r}")
    t, E, h, i = rows * cols, source.n_experts, source.hidden_size, source.moe_intermediate_size
    flops = capture_flops(t, E, h, i)
    layers = tuple(l for l in source.moe_layers if l not in source.mtp_layers)
    return CalibrationPrice(rows, cols, layers, float(flops), flops / (tflops * 1e12), layer_bytes(h, i, E),
                            t * h * 4, float(tflops), float(ldlq_factor))


def windows_budget(disk_budget: int | None, calibration: CalibrationPrice | None, where: str = "disk budget") -> int | None:
    """The disk budget left for the windows once calibration's files (every Hessian, two hidden-state files) are
    counted: they share the campaign's local disk. ``where`` names the setting in the error."""
    if disk_budget is None or calibration is None:
        return disk_budget
    left = int(disk_budget) - calibration.disk_bytes
    if left <= 0:
        raise FqError(f"{where}: {disk_budget} bytes, but calibration alone needs {calibration.disk_bytes} (every "
                      f"Hessian of {len(calibration.layers)} layers and two hidden-state files of {calibration.rows} x "
                      f"{calibration.cols} tokens)")
    return left


def calibration_lines(c: CalibrationPrice) -> list[str]:
    from fq.core.units import fmt_bytes

    return [f"calibration (projected, all-experts capture): {c.rows} x {c.cols} tokens through "
            f"{len(c.layers)} MoE layers, {c.flops_per_layer / 1e15:.1f} PFLOP per layer at {c.tflops:g} TFLOP/s = "
            f"{c.seconds_per_layer / 3600:.2f} GPU-h per layer, {c.gpu_seconds / 3600:.1f} GPU-h in all "
            f"(the chain is serial: one layer after the other, overlapping the encodes)",
            f"  Hessians {fmt_bytes(c.hessian_bytes_per_layer)} per layer, {fmt_bytes(c.hessian_bytes)} in all; "
            f"hidden states {fmt_bytes(c.hidden_bytes)} per file (two at a time); LDLQ encodes priced at "
            f"{c.ldlq_factor:g}x the cost table's weight-only seconds"]
