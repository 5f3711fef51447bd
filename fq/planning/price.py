"""Pricing a campaign before a GPU is rented: GPU-hours, dollars, wall time, storage.

A cost table (fq-cost-table/1, fq/data/cost_table.json by default) gives seconds per matrix
pass by codebook, K and shape on one GPU model. A node costs its experts x the seconds of its
three projections at its K (nothing for a base that publishes another base's expert encoding:
``Node.experts_from``); a recipe costs the sum of its nodes. Wall time for n GPUs follows
the plan's windows: window w's shards download once window w-W has retired, and encoding of
window w waits for its shards and for window w-1 (ideal load balance inside a window). Staging
of the first window and the final verification overlap nothing. GPUs are billed from the start
of staging until the last window is encoded; finalize (re-hash and publish) runs after they are
released. ``price_recipe`` is pure: it takes a Recipe, a SourceModel and a CostTable.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Mapping, Sequence

from fq.allocation.document import SENSITIVITY, STREAM_BYTES
from fq.core import canonical, kbits
from fq.core.layer_ranges import format_layers
from fq.errors import FqError
from fq.planning.calibration_cost import CalibrationPrice, ChainPrice, experts_per_token, price_chain, windows_budget
from fq.planning.plan import (DEFAULT_WINDOWS_ON_DISK, choose_windows, encoded_expert_bytes, layer_output_bytes,
                              stage_schedule)
from fq.core.schema_check import validate
from fq.core.units import fmt_bytes, fmt_hours
from fq.model.source import PROJECTIONS, SourceModel
from fq.planning.recipe import Recipe, selection_counts

TABLE_FORMAT = "fq-cost-table/1"
DEFAULT_DOWNLOAD_MB_S = 125.0  # assumption: a 1 Gbit/s link to the hub; pass the one you rent
DEFAULT_VERIFY_MB_S = 908.0  # the seed's measured finalize re-hash rate (9.32 GB in 10.263 s)
DEFAULT_USD_PER_GPU_HOUR = 3.0  # assumption: an on-demand H200 price; pass yours
DEFAULT_GPUS = 8
# A linear job encodes its matrices one at a time (the experts of a block share one LDL per Hessian), so each LDLQ
# matrix also pays its Hessian's factorization and walk set-up, growing with its input width: 1.79e-4 s per input
# channel, fitted to benchmarks/linear_encode_cost.py's GLM-5 matrices on an H200 (docs/benchmarks.md; the cost
# table's seconds times the LDLQ factor alone priced those jobs at half their measured 0.32 GPU-h)
LINEAR_LDLQ_S_PER_INPUT = 1.79e-4
# A half-integer K has no CUDA Viterbi kernel: its search runs on the host's C kernel (fq.codec.viterbi), which on an
# H100 host did 1,880 tiles/s at K1.5 on 16 threads (benchmarks/frac_speed_probe.py, other jobs beside it): 117.5 per
# thread, and an encode job has the threads its profile sets (profiles/local-gpu: 2, one job per GPU; a test keeps
# ENCODE_THREADS equal to it). An LDLQ encode at K1.5 searches each tile 1.9 times (its scale search's passes,
# counted on the CPU). Added to the GPU's cost at the integer K above, which prices the rest of the pipeline.
HOST_FRAC_TILES_S_PER_THREAD = 117.5
ENCODE_THREADS = 2
HOST_FRAC_TILES_S = HOST_FRAC_TILES_S_PER_THREAD * ENCODE_THREADS
FRAC_PASSES_PER_TILE = 1.9


# -- cost tables -------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class CostTable:
    gpu: str
    encoder: str
    seconds_by_key: Mapping[tuple[str, int, int, int], float]  # (codebook, K, out, in) -> s per matrix
    origin_by_key: Mapping[tuple[str, int, int, int], str]  # measured | derived
    source: str
    sha256: str

    def seconds(self, codebook: str, K, shape: tuple[int, int]) -> tuple[float, bool]:
        """Seconds of one pass over an (out, in) matrix, and whether it was scaled from other shapes.

        A shape the table lacks is priced per tile (out*in/256) from the table's shapes at the same
        codebook and K: fixed costs then scale with size, so measure on the model's own shapes. A half-integer K
        (1.5, 2.5, 3.5) is priced as the integer K above it plus its search on the host's cores
        (HOST_FRAC_TILES_S; fq.codec.viterbi has no CUDA frac kernel yet), and marked scaled.
        """
        key = (codebook, K, shape[0], shape[1])
        if key in self.seconds_by_key:
            return self.seconds_by_key[key], False
        if isinstance(K, float):  # a half-integer K: the K above on the GPU, and the search on the host's cores
            host = shape[0] * shape[1] / 256 * FRAC_PASSES_PER_TILE / HOST_FRAC_TILES_S
            return self.seconds(codebook, int(K) + 1, shape)[0] + host, True
        same = [(o * i // 256, s) for (cb, k, o, i), s in self.seconds_by_key.items() if cb == codebook and k == K]
        if not same:
            have = sorted({f"{cb} K{k}" for cb, k, _, _ in self.seconds_by_key})
            raise FqError(f"cost table {self.source} ({self.gpu}) has no entry for codebook {codebook} K{K} "
                          f"(it has {', '.join(have)}); run fq cost-table for it")
        per_tile = sum(s / t for t, s in same) / len(same)
        return per_tile * (shape[0] * shape[1] // 256), True

    @property
    def measured_share(self) -> tuple[int, int]:
        return sum(1 for o in self.origin_by_key.values() if o == "measured"), len(self.origin_by_key)


def default_cost_table_path() -> Path:
    return Path(str(resources.files("fq").joinpath("data", "cost_table.json")))


def parse_cost_table(doc, source: str = "<cost table>", gpu_model: str | None = None) -> CostTable:
    validate(doc, "cost-table", f"cost table {source}")
    gpus = doc["gpus"]
    if gpu_model is None:
        if len(gpus) > 1:
            raise FqError(f"cost table {source} holds {len(gpus)} GPU models ({', '.join(sorted(gpus))}): "
                          f"choose one with --gpu-model")
        gpu_model = next(iter(gpus))
    if gpu_model not in gpus:
        raise FqError(f"cost table {source}: no GPU model {gpu_model!r} (it has {', '.join(sorted(gpus))})")
    section = gpus[gpu_model]
    seconds, origins = {}, {}
    for i, e in enumerate(section["entries"]):
        key = (e["codebook"], e["K"], e["shape"][0], e["shape"][1])
        if key in seconds:
            raise FqError(f"cost table {source}: gpus.{gpu_model}.entries[{i}] repeats codebook {key[0]} K{key[1]} "
                          f"shape {key[2]}x{key[3]}")
        seconds[key], origins[key] = float(e["seconds"]), e["origin"]
    return CostTable(gpu=gpu_model, encoder=section["encoder"], seconds_by_key=seconds, origin_by_key=origins,
                     source=source, sha256=canonical.sha256_hex(canonical.dumps(doc)))


def load_cost_table(path: str | Path | None = None, gpu_model: str | None = None) -> CostTable:
    """A cost table file, or the packaged one (fq measured on an H200 by fq cost-table) when ``path`` is None."""
    if path is None:
        return parse_cost_table(canonical.load(default_cost_table_path()), "fq/data/cost_table.json (packaged)", gpu_model)
    return parse_cost_table(canonical.load(path), str(path), gpu_model)


# -- pricing (pure) ------------------------------------------------------------------------------


@dataclass(frozen=True)
class NodePrice:
    name: str
    K: int
    codebook: str
    experts: int  # expert instances encoded (over all layers)
    seconds_per_expert: float  # gate + up + down at this K
    gpu_seconds: float
    output_bytes: int
    scaled: bool  # a shape the cost table lacks was priced per tile
    experts_from: str | None = None  # a base publishing another base's expert encoding (experts 0, no GPU time)
    # K above is a fq.core.kbits node spec for a budgeted base (K per layer and projection); seconds_per_expert its
    # mean over the encoded experts


@dataclass(frozen=True)
class LinearPrice:
    """A linear node of whole-model bases: one class of non-expert linears at K over every layer holding it."""
    name: str
    K: int
    codebook: str
    matrices: int
    gpu_seconds: float
    output_bytes: int
    replaced_bytes: int  # the source bytes of those linears, which leave the skeleton of each base using the node
    hessian_bytes: int  # their input Hessians (calibrated campaigns; packed fp32 triangles, one per input group)
    scaled: bool
    # layer ("head" for the head) -> (output bytes, replaced bytes): what a budgeted base taking the node on some
    # layers only publishes and replaces
    layer_bytes: Mapping = field(default_factory=dict)


@dataclass(frozen=True)
class SensitivityPrice:
    """The sensitivity job of a recipe with budgeted bases (fq.workflow.allocation), streamed one decoder layer at a
    time (fq.allocation.streamed): the forward (the clean and the Fisher streams, each layer's Hessians captured with
    every token through every expert), per label sample a recomputed forward and a backward of every layer, each
    allocated linear's LDLQ-shaped error direction once in the Fisher pass and once per injected K (one Cholesky of
    its Hessian and a triangular solve), the injection streams (each from its unit's layer to the
    head), the encoder's efficiency encodes (a few linears at every candidate K), and the layer reads (the forward's,
    the Fisher's, and each injection pass's from its first unit's layer). FLOPs at the calibration's TFLOP/s, the
    encodes at the cost table's seconds, reads at the verify rate (a read hashes every shard it touches)."""
    tokens: int
    samples: int
    model_flops: float  # the forward's two streams, and per label sample a forward and a backward
    direction_flops: float  # every allocated linear, 1 + injected Ks times: in^3/3 + out*in^2
    seconds: float
    injection_flops: float = 0.0  # the streams, each from its unit's layer to the head
    efficiency_seconds: float = 0.0  # fq.allocation.error_model.ldlq_efficiency's encodes
    capture_flops: float = 0.0  # the Hessian captures: all-experts gate/up and the float64 sums
    passes: int = 0  # injection passes over the layers
    layer_reads: int = 0  # layer (and head) reads of the whole measurement
    read_bytes: int = 0
    read_seconds: float = 0.0
    memory_bytes: int = 0  # the bound: the largest layer's weights, gradients and directions, kept states, streams


@dataclass(frozen=True)
class ProductPrice:
    name: str
    chain: tuple[str, ...]
    bpw: int
    bytes: int  # what a consumer stores: skeleton (less its quantized linears) + their nodes + every node of the chain
    increment_bytes: int  # the chain's last node alone (for a stage: the cartridge over its parent product)
    model_bpw: float | None = None  # whole-model recipes: nominal bits over every linear but the head (model_bits)
    head_bits: int = 16


@dataclass(frozen=True)
class GpuOption:
    gpus: int
    first_window_s: float  # staging of window 0, GPUs idle
    encode_done_s: float  # GPUs released here
    verify_s: float  # finalize re-hash after release
    wall_s: float
    billed_gpu_hours: float
    usd: float


@dataclass(frozen=True, eq=False)
class Price:
    recipe: Mapping  # Recipe.summary()
    nodes: tuple[NodePrice, ...]
    products: tuple[ProductPrice, ...]
    gpu_seconds: float  # pure encode compute, any number of GPUs
    published_bytes: int  # bases with skeleton + every fragment
    skeleton_bytes: int
    windows: tuple[tuple[int, ...], ...]
    peak_local_bytes: int
    options: tuple[GpuOption, ...]  # 1..gpus
    assumptions: Mapping
    calibration: "CalibrationPrice | None" = None  # calibrated: its Hessians' and hidden states' disk in the peak
    chain: ChainPrice | None = None  # calibrated: the chain's jobs, on the timeline and in the GPU-hours
    linears: tuple[LinearPrice, ...] = ()  # whole-model bases: the non-expert encodes (in gpu_seconds and bytes)
    sensitivity: SensitivityPrice | None = None  # budgeted bases: the allocation's measurement (in gpu_seconds)

    @property
    def gpu_hours(self) -> float:
        return self.gpu_seconds / 3600

    def option(self, gpus: int) -> GpuOption:
        return self.options[gpus - 1]


def price_recipe(recipe: Recipe, source: SourceModel, table: CostTable, *, gpus: int = DEFAULT_GPUS,
                 usd_per_gpu_hour: float = DEFAULT_USD_PER_GPU_HOUR,
                 download_bytes_per_s: float = DEFAULT_DOWNLOAD_MB_S * 1e6,
                 verify_bytes_per_s: float = DEFAULT_VERIFY_MB_S * 1e6,
                 windows=None, disk_budget: int | None = None,
                 windows_on_disk: int = DEFAULT_WINDOWS_ON_DISK, allow_unloadable: bool = False,
                 calibration: "CalibrationPrice | None" = None) -> Price:
    """``calibration`` (fq.planning.calibration_cost.price_calibration): encodes cost its ``ldlq_factor`` times the
    table's weight-only seconds, the chain's jobs for this recipe (``price_chain``) go on the timeline and their GPU
    seconds into the GPU-hours, local disk gains its Hessians and hidden states."""
    from fq.model import families

    families.check_publishable(source.family_entry, source.exl3_problems, allow_unloadable, f"{source.origin}/config.json")
    gpus = _positive(gpus, "gpus", integer=True)
    ldlq = calibration.ldlq_factor if calibration is not None else 1.0
    usd_per_gpu_hour = _nonnegative(usd_per_gpu_hour, "usd per GPU-hour")
    download_bytes_per_s = _positive(download_bytes_per_s, "download rate")
    verify_bytes_per_s = _positive(verify_bytes_per_s, "verify rate")
    counts = selection_counts(recipe, source.moe_layers, source.n_experts)

    per_expert: dict[str, dict[int, float]] = {}  # node -> layer -> seconds per expert
    nodes = []
    for node in recipe.nodes:
        layer_s, scaled, out_b = {}, False, 0
        for layer in source.moe_layers:
            K, secs = node.K_at(layer), 0.0
            for proj in PROJECTIONS:  # the encoder codes the padded matrix
                s, sc = table.seconds(node.codebook, kbits.proj(K, proj), source.stored_shape(proj))
                secs, scaled = secs + s * ldlq, scaled or sc
            layer_s[layer] = secs
            out_b += counts[node.name].get(layer, 0) * encoded_expert_bytes(source, K)
        n_exp = sum(counts[node.name].values())
        total = sum(layer_s[l] * counts[node.name].get(l, 0) for l in source.moe_layers)
        if node.experts_from is not None:  # another base's encoding, copied: no encode, the same bytes published
            layer_s, n_exp, total, scaled = {l: 0.0 for l in layer_s}, 0, 0.0, False
        per_expert[node.name] = layer_s
        nodes.append(NodePrice(node.name, node.K, node.codebook, n_exp, total / n_exp if n_exp else 0.0, total, out_b,
                               scaled, node.experts_from))
    node_bytes = {n.name: n.output_bytes for n in nodes}
    skeleton = source.skeleton_bytes
    linears, weights, layer_weights = _price_linears(recipe, source, table, ldlq, calibration is not None)
    lin = {ln.name: ln for ln in linears}

    def base_bytes(base: str) -> int:
        out = skeleton
        for _, ln, layers in recipe.linear_assignments(base):
            u = lin[ln.name]
            if layers is None:
                out += u.output_bytes - u.replaced_bytes
            else:  # a budgeted base takes this node on some layers only
                for layer in layers:
                    o, r = u.layer_bytes["head" if layer is None else str(layer)]
                    out += o - r
        return out

    def stage_linear_bytes(stage: str) -> int:  # a stage's residuals on non-expert linears, published with it
        return sum(lin[ln.name].output_bytes for _, ln, _ in recipe.linear_assignments(stage))

    products = []
    for p in recipe.products:
        extra = {}
        if weights is not None:
            from fq.planning.model_bits import product_bits

            bits = product_bits(recipe, p, weights, layer_weights)
            extra = {"model_bpw": bits["model"], "head_bits": bits["head"]}
        products.append(ProductPrice(p.name, p.chain, recipe.product_bpw(p),
                                     base_bytes(p.chain[0]) + sum(node_bytes[n] for n in p.chain)
                                     + sum(stage_linear_bytes(n) for n in p.chain[1:]),
                                     node_bytes[p.chain[-1]] + (stage_linear_bytes(p.chain[-1]) if len(p.chain) > 1
                                                                else 0), **extra))
    products = tuple(products)
    published = sum(base_bytes(b.name) for b in recipe.bases) + sum(node_bytes.values()) + \
        sum(stage_linear_bytes(n.name) for n in recipe.stages)

    layer_out = layer_output_bytes(recipe, source, counts)
    budget = windows_budget(disk_budget, calibration)  # the Hessians and hidden states share the disk
    partition = choose_windows(source, layer_out, windows=windows, disk_budget=budget,
                               windows_on_disk=windows_on_disk)
    sched = stage_schedule(source, partition, windows_on_disk, layer_out)
    layer_secs = {l: sum(per_expert[n][l] * counts[n][l] for n in per_expert) for l in source.moe_layers}
    chain = price_chain(calibration, source, recipe) if calibration is not None else None
    head_linear_s = sum(lp.gpu_seconds for ln, lp in zip(recipe.linear_nodes, linears) if ln.cls == "head")
    per_window = _window_work(partition, layer_secs, chain, head_linear_s)
    # linear jobs read the committed skeleton and (calibrated) Hessians the chain writes up to its last layer and
    # the head: priced as running with the last window
    per_window[-1].encode.extend(ln.gpu_seconds for ln in linears)
    stage_s = [w.stage_bytes / download_bytes_per_s for w in sched["windows"]]
    verify_s = published / verify_bytes_per_s
    sens = price_sensitivity(source, recipe, calibration, table=table) if recipe.needs_allocation else None
    ahead = sens.seconds if sens is not None else 0.0  # the allocation is measured before the plan is encoded
    options = []
    for n in range(1, gpus + 1):
        first, done = _timeline(stage_s, per_window, n, windows_on_disk)
        first, done = first + ahead, done + ahead
        billed = n * done / 3600
        options.append(GpuOption(n, first, done, verify_s, done + verify_s, billed, billed * usd_per_gpu_hour))
    return Price(
        recipe=recipe.summary(), nodes=tuple(nodes), products=products,
        gpu_seconds=sum(n.gpu_seconds for n in nodes) + (chain.gpu_seconds if chain is not None else 0.0)
        + sum(ln.gpu_seconds for ln in linears)
        + (sens.seconds if sens is not None else 0.0),
        published_bytes=published, skeleton_bytes=skeleton,
        windows=partition, peak_local_bytes=max(w.local_bytes for w in sched["windows"])
        + (calibration.disk_bytes if calibration is not None else 0)
        + sum(ln.hessian_bytes + ln.output_bytes for ln in linears), options=tuple(options),
        assumptions={"download_bytes_per_s": download_bytes_per_s, "verify_bytes_per_s": verify_bytes_per_s,
                     "usd_per_gpu_hour": usd_per_gpu_hour, "windows_on_disk": windows_on_disk,
                     "disk_budget": disk_budget, "windows": windows},
        calibration=calibration, chain=chain, linears=linears, sensitivity=sens,
    )


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(linear: str) -> int | None:
    """The decoder layer a linear's name is in (None: the head, outside the layers)."""
    m = _LAYER.search(linear)
    return None if m is None else int(m.group(1))


def _layer_params(source, shapes: dict) -> tuple[list[int], list[int], int, list[int]]:
    """(active parameters per token, stored parameters, per decoder layer; the head's; the non-expert linears'
    parameters per layer) from the linear shapes and the experts (top-k of them active)."""
    n_layers = source.num_hidden_layers
    top_k = experts_per_token(source)
    expert = 3 * source.hidden_size * source.moe_intermediate_size
    dense, head = [0] * n_layers, 0
    for name, (cls, (o, i)) in shapes.items():
        layer = _layer_of(name)
        if layer is None:
            head += o * i
        elif layer < n_layers:
            dense[layer] += o * i
    moe = {l for l in source.moe_layers if l < n_layers}
    active = [d + (top_k * expert if l in moe else 0) for l, d in enumerate(dense)]
    stored = [d + (source.n_experts * expert if l in moe else 0) for l, d in enumerate(dense)]
    return active, stored, head or source.hidden_size * int(source.config.get("vocab_size") or 0), dense


def _capture_flops(source, shapes: dict, layer: int, tokens: int) -> float:
    """One Hessian capture of ``layer``: every expert's gate/up on every token, and x^T x of every linear's input
    (the experts' gate/up one sum; down one per expert)."""
    h, m = source.hidden_size, source.moe_intermediate_size
    sums = sum(i * i for name, (_, (o, i)) in shapes.items() if _layer_of(name) == layer)
    if layer in source.moe_layers:
        sums += h * h + source.n_experts * m * m
        return 2.0 * tokens * (source.n_experts * 2 * m * h + sums)
    return 2.0 * tokens * sums


def _sensitivity_memory(source, stored: list, dense: list, streams: int, rows: int, cols: int, samples: int,
                        stream_bytes: int) -> int:
    """The streamed measurement's memory bound (fq.allocation.streamed): the largest layer's float32 weights and
    Hessians (float64: the experts' shared input's, each expert's down input's, each other linear's), the kept inputs
    (two streams), clean log-probs and head gradients, and the larger of the injection's (the streams alive and a
    unit's weights copied to restore them: at most every expert's gate and up) and the Fisher pass's (the non-expert
    linears' float32 gradients and float64 directions, the experts' kept inputs and output gradients)."""
    h, m, E = source.hidden_size, source.moe_intermediate_size, source.n_experts
    top_k = experts_per_token(source)
    vocab = int(source.config.get("vocab_size") or 0)
    tokens = rows * cols
    layer = 4 * max(stored)
    hessians = 8 * (h * h + E * m * m + max(dense) * 2)  # the other linears' inputs: ~ their weights' size or less
    kept = 2 * (source.num_hidden_layers + 1) * tokens * h * 4 + rows * (cols - 1) * vocab * 4 \
        + samples * tokens * h * 4
    injection = min(stream_bytes, streams * tokens * h * 4) + 4 * max(E * 2 * h * m, max(dense))
    fisher = 12 * max(dense) + samples * tokens * top_k * (2 * h + 3 * m) * 4
    return int(layer + hessians + kept + max(injection, fisher))


def price_sensitivity(source: SourceModel, recipe: Recipe, calibration: "CalibrationPrice | None" = None, *,
                      rows: int = SENSITIVITY["rows"], cols: int = SENSITIVITY["columns"],
                      samples: int = SENSITIVITY["samples"], table: "CostTable | None" = None,
                      ks=range(1, 9), stream_bytes: int = STREAM_BYTES,
                      read_bytes_per_s: float = DEFAULT_VERIFY_MB_S * 1e6) -> SensitivityPrice:
    """The streamed measurement (``SensitivityPrice``): FLOPs at the calibration's TFLOP/s (the default without)."""
    from fq.allocation import passes as walk
    from fq.allocation.inject import INJECT_KS
    from fq.allocation.units import order
    from fq.planning.budget import source_units
    from fq.planning.calibration_cost import DEFAULT_TFLOPS
    from fq.planning.model_bits import linear_shapes

    shapes = linear_shapes(source)
    active, stored, head, dense = _layer_params(source, shapes)
    n_layers, tokens, h, m = source.num_hidden_layers, rows * cols, source.hidden_size, source.moe_intermediate_size
    fwd = 2.0 * tokens  # FLOPs per active parameter of one stream's forward
    model = fwd * (2 * sum(active) + head) + 3 * samples * fwd * (sum(active) + head)
    per_expert = 2 * (h ** 3 / 3 + m * h * h) + (m ** 3 / 3 + h * m * m)  # gate, up (in h) and down (in m)
    # each once in the Fisher pass and once per injected K (a unit's directions are made one linear at a time, not
    # held together)
    directions = (1 + len(INJECT_KS)) * (sum(i ** 3 / 3 + o * i * i for _, (o, i) in shapes.values())
                                         + len([l for l in source.moe_layers if l < n_layers]) * source.n_experts
                                         * per_expert)
    unit_layers = {u: n_layers if layer is None else layer
                   for u, (_, layer) in sorted(source_units(source).items(), key=lambda kv: order(kv[0]))}
    after = [sum(active[l:]) + head for l in range(n_layers + 1)]  # one stream from layer l to the head
    injection = len(INJECT_KS) * sum(fwd * after[l] for l in unit_layers.values())
    passes = walk.plan(unit_layers, len(INJECT_KS), tokens * h * 4, stream_bytes)
    firsts = walk.starts(passes, unit_layers)
    # a layer is captured by the forward, the Fisher pass, and each injection pass that starts a unit of it
    captured = [2 + sum(1 for p in passes if any(unit_layers[u] == l for u in p)) for l in range(n_layers)]
    capture = sum(c * _capture_flops(source, shapes, l, tokens) for l, c in enumerate(captured))
    reads = [2 + sum(1 for f in firsts if f <= l) for l in range(n_layers)]
    db = source.dtype_bytes
    read_bytes = int(db * (sum(r * p for r, p in zip(reads, stored)) + head * (1 + len(passes))))
    read_s = read_bytes / read_bytes_per_s
    memory = _sensitivity_memory(source, stored, dense, len(unit_layers) * len(INJECT_KS), rows, cols, samples,
                                 stream_bytes)
    tflops = calibration.tflops if calibration is not None else DEFAULT_TFLOPS
    # one linear per unit kind (fq.allocation.measure.efficiency_names) encoded at every candidate K
    kinds = [(h, h), (h, h), (m, h), (h, m)]  # attention-like, dense/shared-like, routed gate/up, routed down
    eff = 0.0
    if table is not None:
        for K in ks:
            for shape in kinds:
                eff += table.seconds("mul1", K, shape)[0] if K != 16 else 0.0
    seconds = (model + directions + injection + capture) / (tflops * 1e12) + eff + read_s
    return SensitivityPrice(tokens, samples, model, directions, seconds, injection, eff, capture, len(passes),
                            walk.layer_reads(n_layers, passes, unit_layers), read_bytes, read_s, memory)


def _price_linears(recipe: Recipe, source: SourceModel, table: "CostTable", ldlq: float, calibrated: bool):
    """(LinearPrice per linear node, the source's weights per class, per class and layer) of a recipe's whole-model
    bases; ((), None, None) without any. The linears' shapes come from the config (fq.planning.model_bits.linear_shapes);
    each encodes at the cost table's seconds for its padded shape; its Hessian is shared by the linears reading one
    input. A budgeted base's per-K node counts only the layers its allocation gives that K."""
    if not recipe.linear_nodes:
        return (), None, None
    from fq.codec.shape import padded_shape
    from fq.hessian.store import packed_len
    from fq.model.linears import source_linears
    from fq.planning.model_bits import hessian_groups, linear_layer_weights, linear_shapes, linear_weights
    from fq.planning.plan import linear_node_layers

    shapes = linear_shapes(source)
    weights = linear_weights(source, shapes)
    layer_of = {lin.name: lin.layer for d in source_linears(source).values() for v in d.values() for lin in v}
    needed = linear_node_layers(recipe)
    dtype_bytes = source.dtype_bytes
    out = []
    for ln in recipe.linear_nodes:
        mine = {n: shape for n, (cls, shape) in shapes.items() if cls == ln.cls
                and (needed[ln.name] is None or layer_of.get(n) in needed[ln.name])}
        secs, scaled, out_b, hess_b = 0.0, False, 0, 0
        per_layer: dict = {}
        for n, shape in mine.items():
            s, sc = table.seconds(ln.codebook, ln.K, padded_shape(shape))
            secs, scaled = secs + s * ldlq + (LINEAR_LDLQ_S_PER_INPUT * shape[1] if calibrated else 0.0), scaled or sc
            o, i = padded_shape(shape)
            out_b += o * i * ln.K // 8 + 2 * (i + o) + 4
            key = "head" if layer_of.get(n) is None else str(layer_of[n])
            lo, lr = per_layer.get(key, (0, 0))
            per_layer[key] = (lo + o * i * ln.K // 8 + 2 * (i + o) + 4,
                              lr + (int(shape[0] * shape[1] * dtype_bytes) if ln.parent is None else 0))
        if calibrated:
            by_layer: dict = {}
            for n in mine:
                by_layer.setdefault(n.rsplit(".", 2)[0] if n != "lm_head" else n, []).append(n)
            for names in by_layer.values():
                hess_b += sum(4 * packed_len(mine[g[0]][1]) for g in hessian_groups(names))
        # a base's linear node replaces the bf16 weights in its directory; a stage's residual replaces nothing
        replaced = sum(int(o * i * dtype_bytes) for o, i in mine.values()) if ln.parent is None else 0
        out.append(LinearPrice(ln.name, ln.K, ln.codebook, len(mine), secs, out_b, replaced, hess_b, scaled, per_layer))
    return tuple(out), weights, (linear_layer_weights(source, shapes) if recipe.budgeted else None)


@dataclass
class WindowWork:
    """One window's work on the timeline: its encodes' GPU seconds (a list the linear jobs join in the last window),
    the wall and the GPU-held seconds of the calibration chain's jobs run for it, and the GPU seconds that can only
    start once that part of the chain has ended (its last calibrated layer's encodes; the last window's head job's
    linear job too)."""
    encode: list
    chain_s: float = 0.0
    chain_gpu_s: float = 0.0
    tail_s: float = 0.0


def _window_work(partition, layer_secs: Mapping[int, float], chain: ChainPrice | None,
                 head_linear_s: float) -> list[WindowWork]:
    """Per window, its work (``WindowWork``). A chain job goes with the window of the first MoE layer at or after its
    layer (the embed job and the dense layers before it with window 0: their shards are staged with it); the head
    job, and any layer after the last MoE layer, with the last window."""
    work = [WindowWork([layer_secs[l] for l in layers]) for layers in partition]
    calibrated = chain.calibration.layers if chain is not None else tuple(layer_secs)
    for w, layers in zip(work, partition):
        mine = [l for l in layers if l in calibrated]
        w.tail_s = layer_secs[mine[-1]] if mine else 0.0
    if chain is None:
        return work
    for job in chain.jobs:
        if job.kind == "embed":
            i = 0
        elif job.kind == "head":
            i = len(partition) - 1
        else:
            i = next((i for i, layers in enumerate(partition) if max(layers) >= job.layer), len(partition) - 1)
        work[i].chain_s += job.seconds
        work[i].chain_gpu_s += job.gpu_seconds
    if any(j.kind == "head" for j in chain.jobs):
        work[-1].tail_s += head_linear_s  # the head's linear job reads the head job's Hessian
    return work


def _timeline(stage_s: Sequence[float], windows: Sequence[WindowWork], gpus: int, W: int) -> tuple[float, float]:
    """(end of window 0's staging, end of the last window's encode) in seconds from the start. The encodes and the
    chain's GPU-held seconds spread over the GPUs; the calibration chain is serial (each job starts from the previous
    one's hidden states: embed, every layer, the head), and a job's reads hold no GPU; a layer's encodes cannot
    start before its calibration has ended: so a window ends no sooner than its GPU work over the GPUs after the
    previous window, nor sooner than the chain's end of its part plus its tail over the GPUs."""
    staged, encoded, chain = [], [], 0.0
    for w, (st, work) in enumerate(zip(stage_s, windows)):
        start = staged[-1] if w else 0.0
        if w - W >= 0:
            start = max(start, encoded[w - W])  # window w fetches once window w-W retired
        staged.append(start + st)
        chain = max(chain, staged[-1]) + work.chain_s
        encoded.append(max(max(staged[-1], encoded[-1] if w else 0.0) + (sum(work.encode) + work.chain_gpu_s) / gpus,
                           chain + work.tail_s / gpus))
    return staged[0], encoded[-1]


def _positive(value, what: str, integer: bool = False):
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not value > 0 or value != value:
        raise FqError(f"{what}: expected a positive {'integer' if integer else 'number'}, got {value!r}")
    return value


def _nonnegative(value, what: str):
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise FqError(f"{what}: expected a number >= 0, got {value!r}")
    return float(value)


# -- tables -----------------------------------------------------------------------------------------


def source_line(source: SourceModel) -> str:
    shapes = ", ".join(f"{'x'.join(map(str, source.expert_shape(p)))} ({p})" for p in PROJECTIONS)
    if source.padded:
        shapes += " (stored zero-padded to " + ", ".join('x'.join(map(str, source.stored_shape(p)))
                                                      for p in PROJECTIONS) + ")"
    return (f"source {source.model_type or source.family} ({source.family_entry.title}) @ {source.revision}\n"
            f"  {len(source.moe_layers)} MoE layers ({format_layers(source.moe_layers)}) x {source.n_experts} experts; "
            f"expert matrices (out x in) {shapes}; {source.dtype}; {len(source.shards)} shards, "
            f"{fmt_bytes(source.total_bytes)} (skeleton {fmt_bytes(source.skeleton_bytes)})")


def table_line(table: CostTable) -> str:
    measured, total = table.measured_share
    return (f"cost table {table.source} (sha256 {table.sha256[:16]})\n"
            f"  GPU {table.gpu}: {table.encoder}\n"
            f"  {measured} of {total} entries measured, the rest derived (see the table's 'basis' fields)")


def cost_table_entries(table: CostTable) -> str:
    """Every entry: codebook, K, shape, seconds per matrix pass, measured or derived."""
    lines = [f"{'codebook':<8} {'K':>2} {'shape (out x in)':>17} {'s/matrix':>9}  origin"]
    for (cb, K, o, i), secs in sorted(table.seconds_by_key.items()):
        lines.append(f"{cb:<8} {K:>2} {f'{o}x{i}':>17} {secs:>9.4f}  {table.origin_by_key[(cb, K, o, i)]}")
    return "\n".join(lines)


def assumptions_line(a: Mapping) -> str:
    if a["windows"] is not None:
        win = f"windows {a['windows']}"
    elif a["disk_budget"] is not None:
        win = f"windows from a disk budget of {fmt_bytes(a['disk_budget'])}"
    else:
        win = "one window (no --windows or --disk-budget)"
    return (f"assumptions: download {a['download_bytes_per_s'] / 1e6:g} MB/s; finalize verify "
            f"{a['verify_bytes_per_s'] / 1e6:g} MB/s; ${a['usd_per_gpu_hour']:.2f} per GPU-hour; "
            f"{a['windows_on_disk']} window(s) on disk; {win}")


def _has_half(spec) -> bool:
    """Whether a K spec (one K, or per layer / projection mappings) holds a half-integer K anywhere."""
    if isinstance(spec, Mapping):
        return any(_has_half(v) for v in spec.values())
    return isinstance(spec, float)


def price_table(price: Price) -> str:
    r = price.recipe
    lines = [f"== {r['recipe']} (sha256 {r['sha256'][:16]}): {r['passes']} passes emitting {r['encoded_bpw']} bpw; "
             f"{r['products']} products spanning {r['nominal_bpw']} nominal bpw", "",
             f"{'node':<14} {'K':>2} {'codebook':<8} {'experts':>8} {'matrices':>9} {'s/matrix':>9} {'GPU-h':>8} {'output':>11}"]
    for n in price.nodes:
        mark = "*" if n.scaled else ""
        K = n.K if kbits.is_one(n.K) else "b"  # a budgeted base: K per layer and projection (fq plan shows them)
        lines.append(f"{n.name:<14} {K:>2} {n.codebook:<8} {n.experts:>8} {3 * n.experts:>9} "
                     f"{n.seconds_per_expert / 3:>8.4f}{mark or ' '} {n.gpu_seconds / 3600:>8.2f} {fmt_bytes(n.output_bytes):>11}"
                     + (f"  (the experts of {n.experts_from}, encoded once)" if n.experts_from else ""))
    total_m = sum(3 * n.experts for n in price.nodes)
    if price.chain is not None:
        lines.append(f"{'calibration':<14} {'':>2} {'':<8} {'':>8} {'':>9} {'':>9} "
                     f"{price.chain.gpu_seconds / 3600:>8.2f} {fmt_bytes(price.calibration.hessian_bytes):>11}")
    if price.sensitivity is not None:
        lines.append(f"{'sensitivity':<14} {'':>2} {'':<8} {'':>8} {'':>9} {'':>9} "
                     f"{price.sensitivity.seconds / 3600:>8.2f} {'':>11}")
    lines.append(f"{'total':<14} {'':>2} {'':<8} {'':>8} {total_m:>9} {'':>9} {price.gpu_hours:>8.2f} "
                 f"{fmt_bytes(sum(n.output_bytes for n in price.nodes)):>11}")
    if any(n.scaled for n in price.nodes):
        lines.append("  * shape not in the cost table: priced per tile from its shapes (run fq cost-table --shape)")
    if any(_has_half(n.K) for n in price.nodes) or any(_has_half(ln.K) for ln in price.linears or ()):
        lines.append(f"  half-integer K (1.5, 2.5, 3.5): the next integer K's cost plus their search on the host's "
                     f"cores ({HOST_FRAC_TILES_S:,.0f} tiles/s on an encode job's {ENCODE_THREADS} threads, "
                     f"{FRAC_PASSES_PER_TILE} passes a tile): fq has no CUDA kernel for them yet; allocation.ks can "
                     f"leave them out")
    if price.chain is not None:
        from fq.planning.calibration_cost import calibration_lines

        lines += calibration_lines(price.chain)
    if price.sensitivity is not None:
        sv = price.sensitivity
        lines.append(f"sensitivity (budgeted bases' allocation, measured before encoding): {sv.tokens} tokens x "
                     f"{sv.samples} label samples, {sv.model_flops:.3g} model FLOPs + {sv.direction_flops:.3g} for the "
                     f"error directions + {sv.injection_flops:.3g} for the injected errors + "
                     f"{sv.capture_flops:.3g} for the Hessian captures + {sv.efficiency_seconds:.0f} s of efficiency "
                     f"encodes + {sv.layer_reads} layer reads ({fmt_bytes(sv.read_bytes)}, {sv.read_seconds / 3600:.2f} "
                     f"h; {sv.passes} injection passes): {sv.seconds / 3600:.2f} GPU-h, streamed one layer at a time in "
                     f"about {fmt_bytes(sv.memory_bytes)} of memory")
    if price.linears:
        lines += ["", f"{'linear node':<20} {'matrices':>8} {'GPU-h':>8} {'output':>11} {'replaces':>11} {'Hessians':>11}"]
        for ln in price.linears:
            lines.append(f"{ln.name + ('*' if ln.scaled else ''):<20} {ln.matrices:>8} {ln.gpu_seconds / 3600:>8.2f} "
                         f"{fmt_bytes(ln.output_bytes):>11} {fmt_bytes(ln.replaced_bytes):>11} "
                         f"{fmt_bytes(ln.hessian_bytes):>11}")
        lines += ["", f"{'product':<14} {'bpw experts':>11} {'bpw model':>9} {'head':>4} {'stored (with skeleton)':>23} "
                      f"{'last node alone':>16}  chain"]
        for p in price.products:
            lines.append(f"{p.name:<14} {p.bpw:>11} {p.model_bpw:>9} {p.head_bits:>4} {fmt_bytes(p.bytes):>23} "
                         f"{fmt_bytes(p.increment_bytes):>16}  {' -> '.join(p.chain)}")
    else:
        lines += ["", f"{'product':<14} {'bpw':>3} {'stored (with skeleton)':>23} {'last node alone':>16}  chain"]
        for p in price.products:
            lines.append(f"{p.name:<14} {p.bpw:>3} {fmt_bytes(p.bytes):>23} {fmt_bytes(p.increment_bytes):>16}  "
                         f"{' -> '.join(p.chain)}")
    n_bases = sum(1 for n in price.nodes if n.name in {p.chain[0] for p in price.products})
    lines += [f"published in total: {fmt_bytes(price.published_bytes)} ({n_bases} base(s) carrying the "
              f"{fmt_bytes(price.skeleton_bytes)} skeleton + every fragment)",
              f"windows: {len(price.windows)} ({'; '.join(format_layers(w) for w in price.windows)}); "
              f"peak local disk {fmt_bytes(price.peak_local_bytes)}", "",
              f"{'GPUs':>4} {'stage window 0':>15} {'encode ends':>12} {'verify':>9} {'wall':>9} {'billed GPU-h':>13} {'USD':>10}"]
    for o in price.options:
        lines.append(f"{o.gpus:>4} {fmt_hours(o.first_window_s):>15} {fmt_hours(o.encode_done_s):>12} "
                     f"{fmt_hours(o.verify_s):>9} {fmt_hours(o.wall_s):>9} {o.billed_gpu_hours:>13.1f} {o.usd:>10.2f}")
    return "\n".join(lines)


def comparison_table(prices: Sequence[Price]) -> str:
    names = [p.recipe["recipe"] for p in prices]
    width = max(16, *(len(n) + 2 for n in names))
    gpus = prices[0].options[-1].gpus
    rows = [
        ("passes", [str(p.recipe["passes"]) for p in prices]),
        ("encoded bpw", [str(p.recipe["encoded_bpw"]) for p in prices]),
        ("products", [str(p.recipe["products"]) for p in prices]),
        ("nominal bpw", [str(p.recipe["nominal_bpw"]) for p in prices]),
        ("GPU-hours", [f"{p.gpu_hours:.2f}" for p in prices]),
        (f"USD at {gpus} GPUs", [f"{p.option(gpus).usd:.2f}" for p in prices]),
        (f"wall at {gpus} GPUs", [fmt_hours(p.option(gpus).wall_s) for p in prices]),
        ("published", [fmt_bytes(p.published_bytes) for p in prices]),
        ("peak local disk", [fmt_bytes(p.peak_local_bytes) for p in prices]),
    ]
    lines = ["== comparison", f"{'':<18}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:<18}" + "".join(f"{v:>{width}}" for v in values) for label, values in rows]
    base = prices[0]
    for p in prices[1:]:
        lines.append(f"cost ratio {p.recipe['recipe']} / {base.recipe['recipe']}: "
                     f"{p.gpu_seconds / base.gpu_seconds:.4f} (GPU-hours), "
                     f"{p.option(gpus).usd / base.option(gpus).usd:.4f} (USD at {gpus} GPUs); storage "
                     f"{p.published_bytes / base.published_bytes:.4f}")
    return "\n".join(lines)
