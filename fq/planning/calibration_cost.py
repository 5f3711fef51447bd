"""What a calibrated campaign adds to the price (docs/calibration.md): the calibration chain's wall and GPU time, the
Hessian files' disk, and LDLQ's encode premium. A projection from the model's shapes, stated as such, not a
measurement of this model.

The chain is one job after another, each reading the previous one's hidden states (``price_chain``): the embed job,
every decoder layer the campaign runs (dense and MoE layers alike: 0 .. the last calibrated or captured layer, every
layer when a whole-model base quantizes the head; next-token-prediction layers are not run), and the head's job
(whole-model bases quantizing the head). Each job costs

    setup  +  bytes read / read rate  +  bytes written / write rate  +  FLOPs / TFLOP/s

bytes read    the hidden-state file in (tokens · hidden · 4) and the job's own source tensors (its routed experts and
              non-routed linears from the shapes, the embed job its embeddings; at most the shards holding them): each
              is read as a byte range and checked against its staged shard's range index (fq.model.shard_index),
              which the staging job made in the one pass that verifies the shard whole (priced with staging); the
              head job the committed skeleton shard holding the final norm, twice (verified, then read)
bytes written the hidden-state file out (tokens · hidden · 4), the layer's Hessian file (calibrated MoE layers) and
              its linears' Hessians (whole-model bases: packed float32 triangles)
FLOPs         counted per layer (tokens t = rows · cols, 2 FLOPs a multiply-add):
              linears        2 · t · out · in of every non-routed linear (attention projections at the family's own
                             shapes, e.g. MLA's q_a/q_b/kv_a/kv_b/o; shared experts; dense MLP; a DSA indexer's)
              attention      rows · 2 · pairs · heads · (qk + v head dims), pairs cols² where the family hands sdpa a
                             materialized mask (GLM-5, DeepSeek-V3.2: every pair is computed), cols·(cols+1)/2 where
                             the causal half is skipped; a DSA indexer adds rows · 2 · cols² · its heads · (its head
                             dim + 1). Approximation: every layer is counted as softmax attention over the whole row
                             (sliding-window and linear-attention layers are counted as full ones: an upper bound)
              routed experts the forward (top-k · t · 6 · hidden · inter) and the all-experts capture: every expert's
                             gate/up on every token (E · t · 4 · hidden · inter) and its down Hessian (E · 2 · t ·
                             inter²), and the input Hessian (2 · t · hidden²); with the router-affinity weighting
                             ``affinity`` (config calibration.weighting, fq.hessian.affinity) also every expert's own
                             input Hessian (E · 2 · t · hidden²: 9.9 PFLOP a GLM-5 layer at 250 x 2048 tokens)
              linear Hessians 2 · t · in² of every captured input group (whole-model bases; MLA's o_proj input is
                             heads · v_head = 16384 wide at GLM-5: 2.7e14 FLOPs a layer at 250 x 2048 tokens)
              head           2 · t · hidden² (Σ xᵀx of the final norm's output)

and holds a GPU from its claim, once its inputs are read (fq.workflow.calibration), to its end: its FLOPs and its
writes (the embed job runs on the CPU and holds none). Those GPU seconds are the chain's GPU-hours; its wall is on the
campaign's critical path (fq.planning.price's timeline).

The rates are fitted to the GLM-5-size rehearsal's first GPU run (one H100 80GB, 250 x 2048 tokens; GLM-5's widths,
1 dense + 2 MoE layers of 16 experts, FP8; recipes/rehearsal-glm5.json: linear Hessians on every layer and the head),
by least squares of the relative errors of the five chain jobs' walls (each less its wait for the GPU lock) and the
layer jobs' time on the GPU (``benchmarks/calib_price_fit.py DIR --fit``; docs/pricing.md has the table):

    job       FLOPs      read     written   wall: measured  priced   on the GPU: measured  priced
    embed     0          3.9 GB   12.6 GB    40 s            41 s     (CPU)                  0 s
    layer 0   1.00e15   16.5 GB   13.6 GB   133 s           125 s     68 s                  65 s
    layer 1   1.49e15   16.5 GB   13.5 GB   149 s           144 s     79 s                  84 s
    layer 2   1.49e15   16.5 GB   13.5 GB   149 s           144 s     79 s                  84 s
    head      0.04e15   18.0 GB    0.1 GB    62 s            67 s      4 s                   2 s

The setup cannot be told from the IO in a run of five jobs (any setup from 0 to 8 s fits as well): 5 s is the
calibration tokens job's whole run there (a process start with torch imported). The read rate is the run's
hidden-state load before the one-pass read landed (commit 83a8834: a 1 GB load in 5.0 s before, 2.3 s after; the next
run re-measures it), so reads lean long. ``tflops`` is the effective rate of the whole count (float32 forward, float64
sums, the per-row loops and copies); the H200 capture benchmark (benchmarks/capture_cost.py, a GLM-4-shaped layer
projected to 256 experts: 259, 196 and 155 s in three runs) did 32-53 TFLOP/s of this count: the H100 default does
not promise the H200's speed.
A layer job's capture holds its float64 sums on the GPU: hidden² + E · inter² (+ E · hidden² with ``affinity``) · 8
bytes (GLM-5: 8.9 GB; 86.2 GB with ``affinity``), beside the layer's float32 weights and a row batch; the Hessian
files' disk is ``fq.hessian.store.layer_bytes`` at the weighting (``affinity``: 21.6 GB a GLM-5 layer against 2.2).
LDLQ's encode premium ``ldlq_factor`` (default 1.35) is measured: 0.478 s per 2048×6144 matrix at K2 batched ×32
(a layer's gate/up matrices share one H) against 0.359 s weight-only in the same run, H200; 1.36× at K3 and K4
(docs/benchmarks.md).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from fq.errors import FqError

if TYPE_CHECKING:  # the CLI reads this module's defaults for its help: without numpy and the source reader
    from fq.model.source import SourceModel

DEFAULT_TFLOPS = 25.0  # effective rate of a chain job's counted FLOPs (fitted, H100: module doc)
DEFAULT_READ_MB_S = 300.0  # hidden-state file and source tensors read, hashed as read (fitted, H100: module doc)
DEFAULT_WRITE_MB_S = 550.0  # hidden-state file and Hessians written, hashed as written (fitted, H100: module doc)
DEFAULT_SETUP_S = 5.0  # per chain job: process start and imports (chosen, not separable in the fit: module doc)
DEFAULT_LDLQ_FACTOR = 1.35
# Bounds a price is quoted within: beyond them a figure is a typo, not a campaign (1e6 rows of 1 Mi tokens is
# 1e12 calibration tokens; no accelerator does 1e5 TFLOP/s; no disk moves 1e6 MB/s; a job does not take an hour to
# start; LDLQ is a small multiple of a weight-only encode).
MAX_ROWS, MAX_COLUMNS = 1_000_000, 1 << 20
MAX_TFLOPS, MAX_MB_S, MAX_SETUP_S, MAX_LDLQ_FACTOR = 1e5, 1e6, 3600.0, 100.0
HIDDEN_DTYPE_BYTES = 4  # float32 hidden states between jobs
HESSIAN_DTYPE_BYTES = 4  # packed float32 triangles on disk (the sums are float64 on the GPU)


@dataclass(frozen=True)
class CalibrationPrice:
    """The calibration's settings and rates, and its disk (what every recipe on the source shares)."""
    rows: int
    cols: int
    layers: tuple[int, ...]  # calibrated MoE layers (one Hessian file each)
    hessian_bytes_per_layer: int
    hidden_bytes: int  # one hidden-state file between two jobs (two exist at a time)
    tflops: float
    ldlq_factor: float
    read_bytes_per_s: float = DEFAULT_READ_MB_S * 1e6
    write_bytes_per_s: float = DEFAULT_WRITE_MB_S * 1e6
    setup_s: float = DEFAULT_SETUP_S
    weighting: str = "none"  # config calibration.weighting (fq.hessian.affinity)
    sums_bytes: int = 0  # an MoE layer job's float64 capture sums, held while it runs

    @property
    def tokens(self) -> int:
        return self.rows * self.cols

    @property
    def hessian_bytes(self) -> int:
        return self.hessian_bytes_per_layer * len(self.layers)

    @property
    def disk_bytes(self) -> int:
        """What calibration adds to local disk at its peak: every Hessian (kept for resume) and two hidden files."""
        return self.hessian_bytes + 2 * self.hidden_bytes


@dataclass(frozen=True)
class ChainJob:
    kind: str  # embed | dense | moe | head
    layer: int | None  # the decoder layer (None: embed, head)
    read_bytes: int
    written_bytes: int
    flops: float
    seconds: float  # wall: setup + reads + writes + FLOPs
    gpu_seconds: float  # from its GPU claim (inputs read) to its end: FLOPs and writes; 0 for the embed job

    @property
    def name(self) -> str:
        return self.kind if self.layer is None else f"layer {self.layer}"


@dataclass(frozen=True)
class ChainPrice:
    """The calibration chain of one recipe on one source: its jobs in order (serial)."""
    calibration: CalibrationPrice
    jobs: tuple[ChainJob, ...]

    @property
    def seconds(self) -> float:
        """The chain's wall, one job after the other."""
        return sum(j.seconds for j in self.jobs)

    @property
    def gpu_seconds(self) -> float:
        return sum(j.gpu_seconds for j in self.jobs)


def experts_per_token(source) -> int:
    """Experts each token is routed to, as the config states it (8 where it states none)."""
    return int(source.config.get("num_experts_per_tok") or source.config.get("moe_topk") or 8)


def _check_rate(what: str, value, most: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= most:  # NaN and inf fail
        raise FqError(f"{what}: expected a number above 0 and at most {most:g}, got {value!r}")
    return float(value)


def price_calibration(source: SourceModel, rows: int, cols: int, *, tflops: float = DEFAULT_TFLOPS,
                      ldlq_factor: float = DEFAULT_LDLQ_FACTOR, read_mb_s: float = DEFAULT_READ_MB_S,
                      write_mb_s: float = DEFAULT_WRITE_MB_S, setup_s: float = DEFAULT_SETUP_S,
                      weighting: str = "none") -> CalibrationPrice:
    """The settings and rates, checked, and the Hessians' and hidden states' disk (no shapes beyond the config's:
    cheap enough for a campaign's disk budget). ``price_chain`` prices the jobs."""
    from fq.hessian.affinity import check_weighting
    from fq.hessian.store import layer_bytes

    # before a price is quoted: a family without a chain, or whose router scores the chain cannot read when weighted
    check_weighting(source.family_entry, weighting, f"{source.origin}/config.json")
    for what, v, most in (("calibration rows", rows, MAX_ROWS), ("calibration columns", cols, MAX_COLUMNS)):
        if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= most:
            raise FqError(f"{what}: expected an integer in 1..{most}, got {v!r}")
    tflops = _check_rate("calibration TFLOP/s", tflops, MAX_TFLOPS)
    ldlq_factor = _check_rate("LDLQ encode factor", ldlq_factor, MAX_LDLQ_FACTOR)
    read_mb_s = _check_rate("calibration read MB/s", read_mb_s, MAX_MB_S)
    write_mb_s = _check_rate("calibration write MB/s", write_mb_s, MAX_MB_S)
    if not isinstance(setup_s, (int, float)) or isinstance(setup_s, bool) or not 0 <= setup_s <= MAX_SETUP_S:
        raise FqError(f"calibration job setup seconds: expected a number from 0 to {MAX_SETUP_S:g}, got {setup_s!r}")
    h, i, E = source.hidden_size, source.moe_intermediate_size, source.n_experts
    return CalibrationPrice(rows, cols, calibrated_layers(source), layer_bytes(h, i, E, weighting),
                            rows * cols * h * HIDDEN_DTYPE_BYTES, tflops, ldlq_factor, read_mb_s * 1e6,
                            write_mb_s * 1e6, float(setup_s), weighting, capture_sums_bytes(E, h, i, weighting))


def capture_sums_bytes(experts: int, hidden: int, inter: int, weighting: str = "none") -> int:
    """The float64 sums an MoE layer's capture holds (input, downs; with ``affinity`` an input per expert)."""
    per_expert = inter * inter + (hidden * hidden if weighting == "affinity" else 0)
    return 8 * (hidden * hidden + experts * per_expert)


def calibrated_layers(source: SourceModel) -> tuple[int, ...]:
    """MoE layers whose experts are encoded against a Hessian (next-token-prediction layers stay weight-only)."""
    return tuple(l for l in source.moe_layers if l not in source.mtp_layers and l < source.num_hidden_layers)


# -- the chain's jobs -------------------------------------------------------------------------------------------------


def captured_linears(recipe, source: SourceModel) -> dict[int | None, tuple[str, ...]]:
    """layer (None: the head) -> the linears whose input Hessians the chain captures there: every class a node of
    ``recipe`` quantizes, on the layers it needs (fq.workflow.campaign_calibration.linear_capture's rule)."""
    if recipe is None or not recipe.linear_nodes:
        return {}
    from fq.model.linears import source_linears
    from fq.planning.plan import linear_node_layers

    found, needed = source_linears(source), linear_node_layers(recipe)
    out: dict = {}
    for ln in recipe.linear_nodes:
        for layer, lins in found.get(ln.cls, {}).items():
            if needed[ln.name] is None or layer in needed[ln.name]:
                out.setdefault(layer, set()).update(lin.name for lin in lins)
    return {layer: tuple(sorted(names)) for layer, names in out.items()}


def chain_layers(source: SourceModel, captured: dict) -> tuple[int, ...]:
    """The decoder layers the chain runs (fq.workflow.campaign_calibration.chain_layers' rule)."""
    calibrated = calibrated_layers(source)
    if not calibrated:
        return ()
    if None in captured:  # the head reads the last layer's output
        return tuple(range(source.num_hidden_layers))
    return tuple(range(max([*calibrated, *(l for l in captured if l is not None)]) + 1))


def _text_config(source: SourceModel) -> dict:
    return source.family_entry.text_view(dict(source.config), f"{source.origin}/config.json")


def attention_core_flops(source: SourceModel, rows: int, cols: int) -> float:
    """One layer's attention scores and weighted values, and a DSA indexer's scores (module doc; the linear
    projections are counted apart)."""
    cfg = _text_config(source)
    heads = int(cfg.get("num_attention_heads") or 1)
    if cfg.get("qk_nope_head_dim") is not None:  # MLA: a no-position part and a rotary part per query/key head
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg.get("qk_rope_head_dim") or 0)
    else:
        qk = int(cfg.get("head_dim") or source.hidden_size // heads)
    v = int(cfg.get("v_head_dim") or qk)
    cal = source.family_entry.calibration
    materialized = bool(cal is not None and cal.materialized_mask)
    pairs = cols * cols if materialized else cols * (cols + 1) / 2
    core = 2.0 * pairs * heads * (qk + v)
    if cfg.get("index_n_heads"):  # DSA: every query scores every key (matmul over the whole row) per indexer head
        core += 2.0 * cols * cols * int(cfg["index_n_heads"]) * (int(cfg.get("index_head_dim") or 128) + 1)
    return rows * core


def _linears_by_layer(source: SourceModel, shapes: dict) -> dict[int, list[tuple[int, int]]]:
    """decoder layer -> (out, in) of its non-routed linears (fq.planning.model_bits.linear_shapes)."""
    pattern = re.compile(r"^" + re.escape(source.family_entry.layout.layers) + r"(\d+)\.")
    out: dict = {}
    for name, (_, shape) in shapes.items():
        m = pattern.match(name)
        if m:
            out.setdefault(int(m.group(1)), []).append(shape)
    return out


def _group_inputs(names, shapes: dict) -> list[int]:
    """The input width of each Hessian group of ``names`` (linears reading one input share one)."""
    from fq.planning.model_bits import hessian_groups

    return [shapes[g[0]][1][1] for g in hessian_groups(names)]


def layer_flops(source: SourceModel, layer: int, tokens: int, rows: int, cols: int, linears: list,
                captured_inputs: list[int], weighting: str = "none") -> float:
    """One layer job's counted FLOPs (module doc): its non-routed ``linears`` (out, in), the attention core, the
    routed experts' forward and all-experts capture where the layer has them (at ``weighting``), and the captured
    groups' Hessians (``captured_inputs``: their input widths)."""
    flops = sum(2.0 * tokens * o * i for o, i in linears) + attention_core_flops(source, rows, cols)
    if layer in source.moe_layers:
        flops += routed_flops(tokens, source.n_experts, experts_per_token(source), source.hidden_size,
                              source.moe_intermediate_size, weighting)
    return flops + sum(2.0 * tokens * n * n for n in captured_inputs)


def routed_flops(tokens: int, experts: int, top_k: int, hidden: int, inter: int, weighting: str = "none") -> float:
    """An MoE layer's routed experts in the chain: the forward (top-k of them a token) and the all-experts capture
    (every expert's gate/up on every token, its down Hessian, the input Hessian; with ``affinity`` every expert's own
    input Hessian)."""
    forward = top_k * tokens * 6.0 * hidden * inter
    own_inputs = experts * 2.0 * tokens * hidden * hidden if weighting == "affinity" else 0.0
    return forward + experts * tokens * 4.0 * hidden * inter + experts * 2.0 * tokens * inter * inter \
        + 2.0 * tokens * hidden * hidden + own_inputs


def _shard_bytes(source: SourceModel, prefix: str) -> int:
    """Bytes of every shard holding a tensor whose name starts with ``prefix`` (what a job without range indexes
    hashes whole: an upper bound of what it reads)."""
    return sum(source.shard_sizes[s] for s in {shard for name, shard in source.weight_map.items()
                                               if name.startswith(prefix)})


def _matrix_bytes(source: SourceModel, out: int, inp: int) -> int:
    """A stored (out, in) matrix at the source's weight dtype, with its block scales (FP8: float32 a block)."""
    block = source.source_format.block
    scales = 4 * -(-out // block[0]) * -(-inp // block[1]) if block else 0
    return int(out * inp * source.dtype_bytes) + scales


def _layer_tensor_bytes(source: SourceModel, layer: int, linears: list[tuple[int, int]]) -> int:
    """What a layer job reads of the source: its own tensors' ranges, each checked against its staged shard's range
    index (fq.model.shard_index), not the shards whole. Counted from the shapes: the routed experts and the
    non-routed linears (norms, routers and biases, well under 1%, are not); never more than its shards."""
    from fq.model.source import PROJECTIONS

    experts = source.n_experts * sum(map(source.expert_matrix_bytes, PROJECTIONS)) \
        if layer in source.moe_layers else 0
    own = experts + sum(_matrix_bytes(source, o, i) for o, i in linears)
    return min(own, _shard_bytes(source, f"{source.family_entry.layout.layers}{layer}."))


def _embed_tensor_bytes(source: SourceModel) -> int:
    """The embed job's read: the embedding matrix's range (vocab x hidden at the checkpoint's dtype: never FP8),
    never more than its shard."""
    from fq.model.source import DTYPE_BYTES

    shard_bytes = _shard_bytes(source, source.family_entry.layout.embed)
    vocab = int(source.config.get("vocab_size") or 0)
    return min(vocab * source.hidden_size * DTYPE_BYTES[source.dtype], shard_bytes) if vocab else shard_bytes


def _final_norm_skeleton_bytes(source: SourceModel) -> int:
    """The committed skeleton shard holding the final norm (what the head job verifies, then reads); 0 where the
    source has none under the family's name (the campaign refuses that source's head Hessian)."""
    norm_name = source.family_entry.calibration.final_norm[0]
    shard = source.weight_map.get(source.family_entry.layout.layers.removesuffix("layers.") + norm_name + ".weight")
    return source.shard_skeleton_bytes(shard) if shard is not None else 0


def _job(c: CalibrationPrice, kind: str, layer, read: int, written: int, flops: float) -> ChainJob:
    compute = flops / (c.tflops * 1e12)
    writes = written / c.write_bytes_per_s
    wall = c.setup_s + read / c.read_bytes_per_s + writes + compute
    gpu = 0.0 if kind == "embed" else compute + writes  # claimed once its inputs are read
    return ChainJob(kind, layer, int(read), int(written), float(flops), wall, gpu)


def price_chain(c: CalibrationPrice, source: SourceModel, recipe=None) -> ChainPrice:
    """The chain's jobs for ``recipe`` on ``source`` (module doc): the embed job, every decoder layer it runs, the
    head's job where a whole-model base quantizes the head. Without a recipe, or with an experts-only one, no linear
    Hessians are captured."""
    from fq.hessian.store import packed_len
    from fq.planning.model_bits import linear_shapes

    captured = captured_linears(recipe, source)
    layers = chain_layers(source, captured)
    if not layers:
        return ChainPrice(c, ())
    t, h = c.tokens, source.hidden_size
    hidden = c.hidden_bytes
    shapes = linear_shapes(source)
    by_layer = _linears_by_layer(source, shapes)
    jobs = [_job(c, "embed", None, _embed_tensor_bytes(source), hidden, 0.0)]
    for layer in layers:
        names = captured.get(layer, ())
        inputs = _group_inputs(names, shapes) if names else []
        written = hidden + sum(HESSIAN_DTYPE_BYTES * packed_len(n) for n in inputs)
        if layer in c.layers:
            written += c.hessian_bytes_per_layer
        read = hidden + _layer_tensor_bytes(source, layer, by_layer.get(layer, []))
        flops = layer_flops(source, layer, t, c.rows, c.cols, by_layer.get(layer, []), inputs, c.weighting)
        jobs.append(_job(c, "moe" if layer in source.moe_layers else "dense", layer, read, written, flops))
    if None in captured:
        jobs.append(_job(c, "head", None, hidden + 2 * _final_norm_skeleton_bytes(source),
                         HESSIAN_DTYPE_BYTES * packed_len(h), 2.0 * t * h * h))
    return ChainPrice(c, tuple(jobs))


# -- disk and lines ---------------------------------------------------------------------------------------------------


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


KIND_LABELS = {"embed": "embed", "dense": "dense layers", "moe": "MoE layers", "head": "head"}


def calibration_lines(chain: ChainPrice) -> list[str]:
    from fq.core.units import fmt_bytes, fmt_hours

    c = chain.calibration
    capture = "all-experts capture" + ("" if c.weighting == "none" else f", {c.weighting} weighting")
    lines = [f"calibration (projected, {capture}): {c.rows} x {c.cols} tokens through {len(chain.jobs)} "
             f"chain jobs, one after the other (each reads the previous one's hidden states): "
             f"{fmt_hours(chain.seconds)} of wall, {chain.gpu_seconds / 3600:.2f} GPU-h held; at {c.tflops:g} TFLOP/s, "
             f"reads {c.read_bytes_per_s / 1e6:g} MB/s, writes {c.write_bytes_per_s / 1e6:g} MB/s, {c.setup_s:g} s "
             f"setup a job"]
    for kind, label in KIND_LABELS.items():
        jobs = [j for j in chain.jobs if j.kind == kind]
        if jobs:
            lines.append(_kind_line(label, jobs))
    lines.append(f"  Hessians {fmt_bytes(c.hessian_bytes_per_layer)} per layer, {fmt_bytes(c.hessian_bytes)} in all; "
                 f"hidden states {fmt_bytes(c.hidden_bytes)} per file (two at a time); LDLQ encodes priced at "
                 f"{c.ldlq_factor:g}x the cost table's weight-only seconds")
    lines.append(f"  capture memory: {fmt_bytes(c.sums_bytes)} of float64 sums per MoE layer job, beside the layer's "
                 f"weights")
    return lines


def _kind_line(label: str, jobs: list[ChainJob]) -> str:
    """One kind of chain job: how many, and per job its FLOPs, IO, wall and GPU-held seconds (means)."""
    from fq.core.units import fmt_bytes

    n = len(jobs)
    mean = lambda f: sum(map(f, jobs)) / n  # noqa: E731
    return (f"  {label:<12} {n:>3} job{'s' if n > 1 else ' '}  {mean(lambda j: j.flops) / 1e15:6.2f} PFLOP  "
            f"{fmt_bytes(int(mean(lambda j: j.read_bytes + j.written_bytes))):>9} IO  "
            f"{mean(lambda j: j.seconds):7.0f} s{' each' if n > 1 else '     '}  "
            f"{mean(lambda j: j.gpu_seconds):6.0f} s on a GPU")
