"""``fq allocate``'s measurement on a model that fits in memory: Hessians, LDLQ-shaped error directions, the Fisher
quadratic forms, and each unit's predicted KL and bytes at every candidate K (docs/allocation.md).

    hessians(model, windows, device) -> {linear: H}            (routed experts: the campaign's all-experts capture)
    weights(model) -> {linear: W}                              (experts split out of transformers' fused parameters)
    apply(model, {linear: W_hat})                              (in place; the inverse of weights)
    unit_bytes(W, ks) -> {unit: {K: bytes}}                    (exllamav3's storage; no measurement)
    unit_options(model, windows, ks, codebook, samples, seed) -> (options, weights count, Sensitivity, fit)
"""
from __future__ import annotations

import torch

from fq.allocation import error_model, inject, sensitivity, solve, units


class HessianCapture:
    """Hooks on ``model``'s quantizable linears (and its fused experts: every token through every expert, the
    campaign's all-experts capture) that sum x^T x in float64 over every forward while installed; ``result()`` is
    name -> H = sum / count, one tensor for every routed expert's gate and up (they read the same tokens: the sum
    each would have, without a copy per expert). Works on a whole model or on one decoder layer
    under its model path (fq.allocation.streamed): the same sums in the same order."""

    def __init__(self, model):
        self.model, self.sums, self.handles, self.origs, self.n_experts = model, {}, [], {}, {}

    def add(self, name, x):
        x = x.reshape(-1, x.shape[-1]).double()
        s = self.sums.setdefault(name, [torch.zeros(x.shape[1], x.shape[1], dtype=torch.float64, device=x.device), 0])
        s[0] += x.T @ x
        s[1] += x.shape[0]

    def __enter__(self):
        add = self.add
        self.handles = [m.register_forward_pre_hook(lambda mod, args, n=n: add(n, args[0]))
                        for n, m in sensitivity.quantizable_linears(self.model).items()]
        for name, mod in sensitivity.fused_experts(self.model).items():
            def fwd(hidden_states, top_k_index, top_k_weights, mod=mod, name=name, orig=mod.forward):
                I = mod.gate_up_proj.shape[1] // 2
                add(f"{name}.gate_up", hidden_states)  # every expert's gate and up read every token: one sum
                for e in range(mod.gate_up_proj.shape[0]):
                    gu = torch.nn.functional.linear(hidden_states, mod.gate_up_proj[e])
                    a = mod.act_fn(gu[..., :I]) * gu[..., I:]
                    add(f"{name}.{e}.down_proj", a)
                return orig(hidden_states, top_k_index, top_k_weights)
            self.origs[name] = (mod, mod.forward)
            self.n_experts[name] = int(mod.gate_up_proj.shape[0])
            mod.forward = fwd
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        for mod, f in self.origs.values():
            mod.forward = f
        self.handles, self.origs = [], {}

    def result(self) -> dict[str, torch.Tensor]:
        out = {n: (s / c) for n, (s, c) in self.sums.items()}
        for name, n_exp in self.n_experts.items():  # one tensor shared by every expert's gate and up
            H = out.pop(f"{name}.gate_up")
            out.update({f"{name}.{e}.{p}": H for e in range(n_exp) for p in ("gate_proj", "up_proj")})
        return out


def hessians(model, windows, device) -> dict[str, torch.Tensor]:
    """name -> H = sum x x^T / count (float64) over the calibration windows, for every quantizable linear."""
    with HessianCapture(model) as cap, torch.no_grad():
        for i in range(windows.shape[0]):
            model(input_ids=windows[i: i + 1].to(device))
    return cap.result()


def weights(model) -> dict[str, torch.Tensor]:
    """name -> the float32 weight of every quantizable linear (experts split out of the fused parameters)."""
    out = {n: m.weight.detach() for n, m in sensitivity.quantizable_linears(model).items()}
    for name, mod in sensitivity.fused_experts(model).items():
        I = mod.gate_up_proj.shape[1] // 2
        for e in range(mod.gate_up_proj.shape[0]):
            out[f"{name}.{e}.gate_proj"] = mod.gate_up_proj[e, :I].detach()
            out[f"{name}.{e}.up_proj"] = mod.gate_up_proj[e, I:].detach()
            out[f"{name}.{e}.down_proj"] = mod.down_proj[e].detach()
    return out


def apply(model, tensors: dict[str, torch.Tensor]) -> None:
    """Write W_hat tensors (names as ``weights``) into the model in place."""
    lin = sensitivity.quantizable_linears(model)
    exp = sensitivity.fused_experts(model)
    with torch.no_grad():
        for n, t in tensors.items():
            if n in lin:
                lin[n].weight.copy_(t)
                continue
            prefix, e, proj = n.rsplit(".", 2)
            mod, e = exp[prefix], int(e)
            I = mod.gate_up_proj.shape[1] // 2
            if proj == "gate_proj":
                mod.gate_up_proj[e, :I].copy_(t)
            elif proj == "up_proj":
                mod.gate_up_proj[e, I:].copy_(t)
            else:
                mod.down_proj[e].copy_(t)


def unit_bytes(W: dict, ks) -> dict:
    """unit -> {K: stored bytes of its linears at K}, for weights ``W`` (as ``weights`` returns them)."""
    return {u: {K: sum(solve.linear_bytes(*W[n].shape, K) for n in ns) for K in ks}
            for u, ns in units.group_units(W).items()}


def efficiency_names(names) -> list[str]:
    """One linear per unit kind (attention, dense, shared, routed gate/up, routed down; not the head: the largest
    matrix), from the middle of the layers that have that kind: the encodes fq.allocation.error_model.ldlq_efficiency
    measures the encoder on, in the order it takes them."""
    by_kind: dict = {}
    for u, ns in units.group_units(sorted(names)).items():
        kind = units.unit_of(ns[0])
        if kind.kind != "head":
            by_kind.setdefault(kind.kind, []).append(ns)
    return [lists[len(lists) // 2][0] for _, lists in sorted(by_kind.items())]


def efficiency_samples(W: dict, H: dict) -> list:
    """(W, H) of every ``efficiency_names`` linear."""
    return [(W[n], H[n]) for n in efficiency_names(W)]


def direction_seed(seed: int, index: int) -> int:
    """The seed of the error direction of the ``index``-th linear in sorted name order."""
    return seed * 1_000_003 + index


def options_of(points: dict, D: dict, sizes: dict, ks) -> tuple[dict, dict]:
    """(unit -> {K: (predicted KL, bytes)}, unit -> {K: (second-order, first-order KL)}) from the injected points."""
    split, options = {}, {}
    for u in points:
        split[u] = inject.parts(points[u], D)
        options[u] = {K: (sum(split[u][K]), sizes[u][K]) for K in ks}
    return options, split


def unit_options(model, windows, ks, codebook: str = "mul1", *, samples: int = 4, seed: int = 0, progress=None):
    """unit -> {K: (predicted KL, bytes)} for every allocation unit of ``model`` measured on calibration ``windows``:
    the unit's LDLQ-shaped error (fq.allocation.error_model) injected at ``inject.INJECT_KS`` with the encoder's
    real distortion D(K) = d(K) c(K) (``error_model.ldlq_efficiency`` on a few of the model's linears), the output's
    KL measured and the curve a D + b sqrt(D) fitted through it (fq.allocation.inject.parts). Also the
    allocated weight count, the Fisher measurement in the same directions (each linear's quadratic form: what a
    budgeted stage ranks experts by) and the fit: {"injected": unit -> {K: KL}, "parts": unit -> {K: (second-order,
    first-order KL)}, "efficiency": K -> c, "distortion": K -> D}. ``progress(done, total)``: windows of the Fisher pass, then
    injected points."""
    W = weights(model)
    H = hessians(model, windows, windows.device)
    names = sorted(W)
    dirs = {n: [error_model.direction(W[n], H[n], seed=direction_seed(seed, i))] for i, n in enumerate(names)}
    eff = error_model.ldlq_efficiency(efficiency_samples(W, H), ks, codebook, device=windows.device, seed=seed)
    del H
    sens = sensitivity.measure(model, windows, samples=samples, seed=seed, directions=dirs, progress=progress)
    groups = units.group_units(names)
    D = {K: error_model.distortion(K, codebook) * eff[K] for K in ks}
    points = inject.measure(model, windows, {n: d[0] for n, d in dirs.items()}, groups, D, W, apply,
                            progress=progress)
    options, split = options_of(points, D, unit_bytes(W, ks), ks)
    fit = {"injected": points, "parts": split, "efficiency": eff, "distortion": D}
    return options, sum(W[n].numel() for n in names), sens, fit
