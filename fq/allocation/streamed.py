"""``fq.allocation.measure.unit_options`` streamed layer by layer: the same measurement on a source that does not fit
in memory, one decoder layer's weights at a time, read from the checkpoint's safetensors as the calibration chain
reads them (``fq.hessian.layer``: transformers' own decoder layer built from that layer's tensors, FP8 dequantized).

The windows (rows x columns tokens) are the in-memory measurement's, each run as a batch of one through every layer,
as the in-memory path runs the whole model per window; names are the full model's module paths (the layer module
sits under its path in a ``tree``), so the hooks, seeds and sums are the in-memory path's own
(fq.allocation.measure.HessianCapture, fq.allocation.sensitivity.FisherTaps):

1. **Forward** (every layer read once). From the embeddings, two streams through each layer: the clean one (the
   model as transformers runs it: each layer's Hessians captured on it; the injections start from it) and the
   Fisher one (routed experts as the Fisher measurement computes them, ``_ExpertsTap``, whose rounding differs from
   grouped_mm's in the last bits). Each layer's input of both is kept. At the head: the clean log-probs (the
   injections' reference) and, per window and label sample, the labels drawn from the Fisher stream's distribution
   with the in-memory path's generator and order, and the gradient of their log-likelihood at the head's input.
   The efficiency samples' (W, H) are kept as their layers pass; c(K) is encoded after the forward.
2. **Fisher** (every layer read once more, last to first). Layer l recomputed from its kept Fisher input with
   autograd, each (window, sample)'s incoming gradient back-propagated, the gradient at its input passed to layer
   l-1. Non-expert linears: the weight gradient's quadratic form in the linear's direction (recomputed from the
   layer's Hessian, itself recomputed from the clean input: the same sums), as in memory. Routed experts: no weight
   gradient; their inputs and output gradients are kept and the forms made one expert at a time after the layer's
   last backward (``sensitivity.expert_forms``: equal to float tolerance, not bit for bit).
3. **Injection** (passes over the layers). For each unit and injected K, a perturbed stream starts at the unit's
   layer from that layer's clean input and is advanced through every later layer while it is loaded; at the head,
   its KL against the clean log-probs. A unit's linears are moved one at a time (each direction made, applied,
   dropped; the weights restored from a CPU copy). Streams are bounded by ``stream_bytes``: units are taken in layer
   order in groups whose streams fit, one pass per group, each pass reading the layers from its first unit's to the
   last (fq.allocation.passes).

Memory: one layer's float32 weights and Hessians, the kept inputs (2 x layers x rows x columns x hidden x 4 B), the
clean log-probs (rows x (columns-1) x vocab x 4 B), the head's incoming gradients (rows x samples x columns x hidden
x 4 B), and in the Fisher pass the non-expert linears' gradients and directions and the experts' kept activations,
in the injection the streams (at most ``stream_bytes``) and one unit's weights copied (fq.planning.price's bound).
``device``: where the layers run; everything kept stays on the CPU.

    unit_options(model_dir, windows, ks, codebook, *, samples, seed, stream_bytes, progress, device)
        -> (options, weights count, Sensitivity, fit)      as fq.allocation.measure.unit_options
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from fq.allocation import error_model, inject, measure, passes as walk, sensitivity, units
from fq.allocation.document import STREAM_BYTES
from fq.errors import FqError


@dataclass
class Loaded:
    """One decoder layer (or the head) built from the checkpoint: ``tree`` holds it under its module path, so that
    names are the full model's; ``run(h)`` is its forward on hidden states [1, cols, hidden]."""

    tree: object
    run: object


def _tree(path: str, module):
    """``module`` under the dotted ``path`` in nested ModuleDicts (named_modules gives the full model's names)."""
    import torch

    root = cur = torch.nn.ModuleDict()
    parts = path.split(".")
    for p in parts[:-1]:
        cur[p] = torch.nn.ModuleDict()
        cur = cur[p]
    cur[parts[-1]] = module
    return root


class Source:
    """A checkpoint read layer by layer: its chain (``fq.hessian.layer.architecture``: refused by name for a family
    without one), and the count of layer reads."""

    def __init__(self, model_dir, cols: int, device="cpu"):
        from fq.hessian import layer as layer_mod

        from fq.model import families

        self.lm = layer_mod
        self.ckpt = layer_mod.read_checkpoint(model_dir)
        where = f"{self.ckpt.dir}/config.json"
        family = families.for_config(self.ckpt.config, where)
        if family.calibration is None:
            raise FqError(f"{where}: {family.architectures[0]} ({family.title}) has no calibration chain (a "
                          "transformers decoder layer fq runs one at a time), which the streamed sensitivity "
                          "measurement runs the source with; measure it in memory (fq allocate) and name that file "
                          "as the campaign's allocation.file")
        self.arch = layer_mod.architecture(self.ckpt.config, where)
        self.hfc = layer_mod.hf_config(self.ckpt.config)
        self.n_layers = self.arch.n_layers(self.ckpt.config, where)
        self.device = device
        rot = layer_mod.rotary(self.hfc, self.arch)
        self.rot = None if rot is None else rot.to(device)
        self.cols = cols
        self.reads = 0

    def path(self, layer: int) -> str:
        return self.arch.prefix.format(layer=layer).rstrip(".")

    def shapes(self) -> dict:
        """linear -> a meta tensor of its weight's shape, for every quantizable linear (no payload read)."""
        import torch

        layer_cls, _ = self.arch.classes()
        out = {}
        with torch.device("meta"):
            for layer in range(self.n_layers):
                out.update(measure.weights(_tree(self.path(layer), layer_cls(self.hfc, layer))))
            out["lm_head"] = torch.empty(self.hfc.vocab_size, self.hfc.hidden_size)
        return out

    def layer(self, layer: int) -> Loaded:
        from fq.hessian import capture

        capture.check_layer(self.arch, self.hfc, layer)
        tensors, _ = self.lm.layer_tensors(self.ckpt, layer)
        module = self.lm.build_layer(self.hfc, self.arch, layer, tensors).to(self.device)
        del tensors
        capture.check_built(self.arch, self.ckpt.config, layer, module)
        call = capture.layer_call(self.arch, self.hfc, layer, self.rot, self.cols, self.device)
        self.reads += 1
        return Loaded(_tree(self.path(layer), module), lambda h: call(module, h.to(self.device)))

    def head(self) -> Loaded:
        """The final norm and ``lm_head`` (the embeddings where the config ties them)."""
        import torch

        from fq.hessian import capture

        norm, _ = capture.final_norm(self.ckpt)
        name = self.arch.family.head
        if name not in self.ckpt.weight_map:
            if not getattr(self.hfc, "tie_word_embeddings", False):
                raise FqError(f"{self.ckpt.dir}: no head weight {name} in the weight map and no tied embeddings")
            name = self.arch.embed
        weight = self.lm.read_tensors(self.ckpt, [name])[0][name].float()
        head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        head.weight = torch.nn.Parameter(weight, requires_grad=False)
        tree = torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"norm": norm}), "lm_head": head}).to(self.device)
        self.reads += 1
        return Loaded(tree, lambda h: head(norm(h.to(self.device))))

    def embed(self, windows):
        from fq.hessian import capture

        return capture.embed(self.ckpt, windows)


def _rows(loaded: Loaded, hidden):
    """Each window (row) through ``loaded`` as a batch of one, without gradients."""
    import torch

    out = torch.empty_like(hidden)
    with torch.no_grad():
        for i in range(hidden.shape[0]):
            out[i: i + 1] = loaded.run(hidden[i: i + 1]).to(out.device)
    return out


def _capture(loaded: Loaded, hidden):
    """(``loaded``'s output on ``hidden``, its linears' Hessians)."""
    import torch

    with measure.HessianCapture(loaded.tree) as cap, torch.no_grad():
        out = _rows(loaded, hidden)
    return out, cap.result()


def _log_probs(head: Loaded, hidden_row):
    return inject.log_probs(head.run(hidden_row))


def _directions(W: dict, H: dict, names, index: dict, seed: int) -> dict:
    direction = _direction_of(W, H, index, seed)
    return {n: [direction(n)] for n in names}


class _Progress:
    def __init__(self, progress, total: int):
        self.progress, self.total, self.done = progress, total, 0

    def step(self, what: str):
        self.done += 1
        if self.progress is not None:
            self.progress(what, self.done, self.total)


def _forward(src: Source, windows, eff_names: set, samples: int, seed: int, index: dict, stats: dict, prog):
    """Step 1 (module docstring): (clean inputs per layer and the head's, Fisher inputs likewise, clean log-probs,
    the head's incoming gradients [window][sample], efficiency (W, H) by name, the head's Hessian)."""
    import torch

    clean = [src.embed(windows)]
    fisher = [clean[0]]  # the same embeddings; the streams part at layer 0's experts
    eff = {}
    for layer in range(src.n_layers):
        loaded = src.layer(layer)
        out, H = _capture(loaded, clean[-1])
        W = measure.weights(loaded.tree)
        eff.update({n: (W[n].clone(), H[n]) for n in eff_names if n in W})
        with sensitivity.FisherTaps(loaded.tree) as taps:
            taps.record[0] = False
            fisher.append(_rows(loaded, fisher[-1]))
        clean.append(out)
        del loaded, W, H
        prog.step(f"forward: layer {layer}")
    head = src.head()
    ref = []
    with measure.HessianCapture(head.tree) as cap, torch.no_grad():
        for i in range(windows.shape[0]):
            ref.append(_log_probs(head, clean[-1][i: i + 1]).cpu())
    H_head = cap.result()["lm_head"]
    W_head = head.tree["lm_head"].weight.detach()
    dirs = _directions({"lm_head": W_head}, {"lm_head": H_head}, ["lm_head"], index, seed)
    gen = torch.Generator().manual_seed(seed)
    grads = []
    with sensitivity.FisherTaps(head.tree, stats) as taps:
        for i in range(windows.shape[0]):
            grads.append([])
            for s in range(samples):
                taps.record[0] = s == 0  # energies once per window
                x = fisher[-1][i: i + 1].clone().requires_grad_(True)
                logp = _log_probs(head, x)
                logp = logp.reshape(-1, logp.shape[-1])
                y = sensitivity.draw_labels(logp, gen)
                logp.gather(1, y).sum().backward()
                taps.take_grads(dirs)
                grads[-1].append(x.grad)
    prog.step("forward: head")
    return clean, fisher, ref, grads, eff, H_head


def _fisher(src: Source, clean: list, fisher: list, grads: list, samples: int, seed: int, index: dict, stats: dict,
            prog) -> None:
    """Step 2 (module docstring): the layers' Fisher forms into ``stats``, last layer first. The routed experts'
    forms come from their inputs and output gradients, one expert's directions at a time
    (``sensitivity.expert_forms``): no weight gradient of the experts and no direction of every expert at once."""
    for layer in reversed(range(src.n_layers)):
        loaded = src.layer(layer)
        _, H = _capture(loaded, clean[layer])
        W = measure.weights(loaded.tree)
        with sensitivity.FisherTaps(loaded.tree, stats, expert_activations=True) as taps:
            dirs = _directions(W, H, sorted(taps.linears), index, seed)
            kept = []
            for i, per_sample in enumerate(grads):
                for s in range(samples):
                    taps.record[0] = s == 0
                    kept.append(taps.start_keeping())
                    x = fisher[layer][i: i + 1].clone().requires_grad_(True)
                    loaded.run(x).backward(per_sample[s].to(src.device))
                    taps.take_grads(dirs)
                    per_sample[s] = x.grad
            del dirs
            for t, tap in enumerate(taps.taps):
                sensitivity.expert_forms(tap, [k[t] for k in kept], stats, _direction_of(W, H, index, seed))
        del loaded, W, H, kept
        prog.step(f"fisher: layer {layer}")


def _kl(head: Loaded, ref: list, hidden) -> float:
    """Mean KL(clean || stream) over the positions of every window but the last of each (inject.measure's sum)."""
    return inject.mean_kl(ref, lambda i: _log_probs(head, hidden[i: i + 1]).cpu())


def _perturbed(loaded: Loaded, names, direction, scale: float, run):
    """``run()`` with ``names`` of ``loaded`` moved by ``scale`` times their direction (``direction(name)``, made
    one linear at a time: a unit's directions are never all held; inject.measure's rounding), the weights restored
    after from a copy kept on the CPU."""
    W = measure.weights(loaded.tree)
    orig = {n: W[n].to("cpu", copy=True) for n in names}
    for n in names:
        E = direction(n)
        base = orig[n].to(E.device)
        measure.apply(loaded.tree, {n: (base.double() + scale * E).to(base.dtype)})
        del E, base
    try:
        return run()
    finally:
        measure.apply(loaded.tree, orig)


def _direction_of(W: dict, H: dict, index: dict, seed: int):
    return lambda n: error_model.direction(W[n], H[n], seed=measure.direction_seed(seed, index[n]))


def _injection_pass(src: Source, group: list, groups: dict, unit_layers: dict, clean: list, ref: list, H_head,
                    D: dict, ks: list, index: dict, seed: int, points: dict, prog) -> None:
    """Step 3 for one group of units (module docstring): their injected KLs into ``points``."""
    streams: dict = {}
    start = min(unit_layers[u] for u in group)
    for layer in range(start, src.n_layers):
        loaded = src.layer(layer)
        for key in streams:
            streams[key] = _rows(loaded, streams[key])
        mine = [u for u in group if unit_layers[u] == layer]
        if mine:
            _, H = _capture(loaded, clean[layer])
            W = measure.weights(loaded.tree)
            direction = _direction_of(W, H, index, seed)
            for u in mine:
                for K in ks:
                    streams[(u, K)] = _perturbed(loaded, groups[u], direction, math.sqrt(D[K]),
                                                 lambda: _rows(loaded, clean[layer]))
            del H, W, direction
        del loaded
        prog.step(f"injection: layer {layer} ({len(streams)} streams)")
    head = src.head()
    for u in group:
        if unit_layers[u] == src.n_layers:  # the head's own unit: perturbed at the head
            direction = _direction_of(measure.weights(head.tree), {"lm_head": H_head}, index, seed)
            for K in ks:
                points[u][K] = _perturbed(head, groups[u], direction, math.sqrt(D[K]),
                                          lambda: _kl(head, ref, clean[-1]))
        else:
            for K in ks:
                points[u][K] = _kl(head, ref, streams.pop((u, K)))
    prog.step("injection: head")


def unit_options(model_dir, windows, ks, codebook: str = "mul1", *, samples: int = 4, seed: int = 0,
                 stream_bytes: int = STREAM_BYTES, progress=None, device="cpu"):
    """``fq.allocation.measure.unit_options`` on the checkpoint at ``model_dir``, streamed (module docstring); the
    same results. ``progress(what, done, total)`` after every layer visit. ``device``: where the layers run (hidden
    states are kept on the CPU, moved a window at a time)."""
    sensitivity.check_samples(samples)
    rows, cols = windows.shape
    src = Source(model_dir, cols, device)
    shapes = src.shapes()
    names = sorted(shapes)
    index = {n: i for i, n in enumerate(names)}
    groups = units.group_units(names)
    unit_layers = {u: src.n_layers if units.unit_of(ns[0]).layer is None else units.unit_of(ns[0]).layer
                   for u, ns in groups.items()}
    inject_ks = [K for K in inject.INJECT_KS if K in ks]
    per_stream = rows * cols * src.hfc.hidden_size * 4
    passes = walk.plan(unit_layers, len(inject_ks), per_stream, stream_bytes)
    prog = _Progress(progress, walk.layer_reads(src.n_layers, passes, unit_layers))
    stats: dict = {}
    clean, fisher, ref, grads, eff_pairs, H_head = _forward(src, windows, set(measure.efficiency_names(names)),
                                                            samples, seed, index, stats, prog)
    eff = error_model.ldlq_efficiency([eff_pairs[n] for n in measure.efficiency_names(names)], ks, codebook,
                                      device=src.device, seed=seed)
    del eff_pairs
    _fisher(src, clean, fisher, grads, samples, seed, index, stats, prog)
    del fisher, grads
    sensitivity.normalize(stats, samples)
    sens = sensitivity.Sensitivity(positions=rows * (cols - 1), samples=samples,
                                   linears={n: stats[n] for n in sorted(stats)})
    D = {K: error_model.distortion(K, codebook) * eff[K] for K in ks}
    points = {u: {} for u in groups}
    for group in passes:
        _injection_pass(src, group, groups, unit_layers, clean, ref, H_head, D, inject_ks, index, seed, points, prog)
    points = {u: {K: points[u][K] for K in inject_ks} for u in groups}
    options, split = measure.options_of(points, D, measure.unit_bytes(shapes, ks), ks)
    fit = {"injected": points, "parts": split, "efficiency": eff, "distortion": D,
           "streamed": {"layer_reads": src.reads, "passes": len(passes)}}
    return options, sum(shapes[n].numel() for n in names), sens, fit
