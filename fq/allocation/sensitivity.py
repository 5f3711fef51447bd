"""How much each linear's quantization error costs at the model's output: the Fisher of the SOURCE model's outputs.

The model (transformers, float32) runs calibration windows; at every position a label is sampled from the model's
own next-token distribution and the sum of those labels' log-probabilities, L_{b,s} for window b and sample s, is
back-propagated. E_y[grad grad^T] is the Fisher of the next-token distributions, so for a small error E on a linear
W, to second order

    E[KL(source || quantized)] = (1/2T) * sum_{b,s} <grad_W L_{b,s}, E>^2 / samples      (T: positions averaged over)

``measure(..., directions={linear: [E, ...]})`` accumulates those quadratic forms (``LinearStat.quad``): with E the
LDLQ-shaped direction of fq.allocation.error_model, this is the prediction ``fq allocate`` uses
(fq.allocation.measure.unit_options; docs/allocation.md).

Why the weight gradient and not per-token output gradients: one error E acts on every token at once, so its effect
at a position sums coherently over the earlier tokens attention mixes in; grad_W carries exactly that sum. Labels
sampled per position are independent and of zero mean given the forward, so the estimate is unbiased for any
grouping into windows; more ``samples`` per window lower its variance.

Also measured, as the isotropic diagnostic docs/allocation.md compares against (Spearman 0.78 where the quadratic
form reaches 0.97): the Fisher trace F_W = sum ||grad_W||^2 / samples and the energies sum ||x||^2, sum ||W x||^2
over the tokens the linear sees (every position, or an expert's routed positions), from which ``LinearStat.beta``
gives KL per unit of relative proxy error for an error with i.i.d. entries: r * F / (2 T m), r = sum ||Wx||^2 /
sum ||x||^2, m = out features.

Routed experts are transformers' fused 3-D parameters (``gate_up_proj`` [E, 2I, n], ``down_proj`` [E, n, I]); their
gradients are per expert already. Their energies and routed token counts need the per-expert activations, so the
experts module's forward is replaced for the measurement by the same computation (transformers' loop over hit
experts, GLU) that also sums them. Only gated experts of that layout are measured (every family fq calibrates but
gpt-oss).

Determinism: labels come from a seeded generator, windows in order, float64 sums; one machine and torch build give
the same numbers (CPU threads fixed by the caller).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from fq.allocation import inject
from fq.errors import FqError

FORMAT = "fq-sensitivity/1"
ROUTERS = {"gate", "router", "shared_expert_gate"}  # routing linears stay as published


@dataclass
class LinearStat:
    """What the measurement found for one linear (one expert's projection counts as one)."""

    out_features: int
    in_features: int
    fisher: float = 0.0   # sum over windows and samples of ||grad_W||^2
    x_energy: float = 0.0  # sum over the tokens it sees of ||x||^2
    y_energy: float = 0.0  # and of ||W x||^2
    tokens: int = 0
    # with error directions given: per direction, sum over windows and samples of <grad_W, E>^2
    quad: list = field(default_factory=list)

    def beta(self, positions: int) -> float:
        """KL per unit of relative proxy error for an i.i.d. error (the isotropic diagnostic: module docstring)."""
        if self.x_energy <= 0.0 or positions <= 0:
            return 0.0
        return (self.y_energy / self.x_energy) * self.fisher / (2.0 * positions * self.out_features)

    def to_json(self) -> dict:
        return {"out": self.out_features, "in": self.in_features, "fisher": self.fisher, "x_energy": self.x_energy,
                "y_energy": self.y_energy, "tokens": self.tokens}


@dataclass
class Sensitivity:
    positions: int
    samples: int
    linears: dict[str, LinearStat] = field(default_factory=dict)

    def beta(self, name: str) -> float:
        return self.linears[name].beta(self.positions)


def _is_fused_experts(module) -> bool:
    gu, d = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return gu is not None and d is not None and getattr(gu, "dim", lambda: 0)() == 3 and d.dim() == 3


def _expert_names(prefix: str, e: int) -> tuple[str, str, str]:
    return (f"{prefix}.{e}.gate_proj", f"{prefix}.{e}.up_proj", f"{prefix}.{e}.down_proj")


class _ExpertsTap:
    """Replaces a fused GLU experts module's forward by the same computation that also sums per-expert energies."""

    def __init__(self, name: str, module, stats: dict, record: list):
        import torch

        self.name, self.module, self.stats, self.record = name, module, stats, record
        E, I2, n = module.gate_up_proj.shape
        self.E, self.I = E, I2 // 2
        for e in range(E):
            g, u, d = _expert_names(name, e)
            stats[g] = LinearStat(self.I, n)
            stats[u] = LinearStat(self.I, n)
            stats[d] = LinearStat(n, self.I)
        self._orig = module.forward
        self._torch = torch
        self.acts = None  # a list: each forward's per-expert (x, a) and, after the backward, their output gradients

    def forward(self, hidden_states, top_k_index, top_k_weights):
        torch, m = self._torch, self.module
        out = torch.zeros_like(hidden_states)
        for e in range(self.E):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = hidden_states[tok]
            gu = torch.nn.functional.linear(x, m.gate_up_proj[e])
            gate, up = gu[..., :self.I], gu[..., self.I:]
            a = m.act_fn(gate) * up
            y = torch.nn.functional.linear(a, m.down_proj[e])
            if self.record[0]:
                self._sum(e, int(tok.numel()), x, gate, up, a, y)
            if self.acts is not None and gu.requires_grad:
                self._keep(e, x, gu, a, y)
            out.index_add_(0, tok, (y * top_k_weights[tok, pos, None]).to(out.dtype))
        return out

    def _keep(self, e: int, x, gu, a, y):
        """Expert e's inputs and (once the backward reaches them) its outputs' gradients: its weight gradients are
        d_guᵀ x and d_yᵀ a, so a direction's inner product with them needs no weight gradient (``expert_forms``)."""
        rec = {"e": e, "x": x.detach(), "a": a.detach()}
        gu.register_hook(lambda g: rec.__setitem__("d_gu", g.detach()))
        y.register_hook(lambda g: rec.__setitem__("d_y", g.detach()))
        self.acts.append(rec)

    def _sum(self, e: int, tokens: int, x, gate, up, a, y):
        torch = self._torch
        with torch.no_grad():
            g, u, d = _expert_names(self.name, e)
            xe = float(x.double().pow(2).sum())
            for nm, xen, yen in ((g, xe, float(gate.double().pow(2).sum())),
                                 (u, xe, float(up.double().pow(2).sum())),
                                 (d, float(a.double().pow(2).sum()), float(y.double().pow(2).sum()))):
                s = self.stats[nm]
                s.x_energy += xen
                s.y_energy += yen
                s.tokens += tokens

    def __enter__(self):
        self.module.forward = self.forward
        return self

    def __exit__(self, *exc):
        self.module.forward = self._orig


def quantizable_linears(model) -> dict[str, object]:
    """name -> nn.Linear of every 2-D linear fq may quantize: the decoder layers' linears but the routers, and the
    head. Fused experts are handled apart (``fused_experts``)."""
    import torch

    out = {}
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.Linear) and (".layers." in f".{name}" or name.endswith("lm_head")) \
                and name.rsplit(".", 1)[-1] not in ROUTERS:
            out[name] = mod
    return out


def fused_experts(model) -> dict[str, object]:
    return {name: mod for name, mod in model.named_modules() if _is_fused_experts(mod)}


def _add(stat: LinearStat, grad, dirs) -> None:
    grad = grad.double()
    stat.fisher += float(grad.pow(2).sum())
    if dirs:
        if not stat.quad:
            stat.quad = [0.0] * len(dirs)
        for i, E in enumerate(dirs):
            stat.quad[i] += float((grad * E.to(grad.device, grad.dtype)).sum()) ** 2


def _take_grads(linears: dict, experts: dict, stats: dict, directions: dict) -> None:
    """Add each linear's (each expert projection's) squared gradient norm to its Fisher sum (and its squared
    projections on the error directions), and clear the grads."""
    import torch

    with torch.no_grad():
        for n, m in linears.items():
            _add(stats[n], m.weight.grad, directions.get(n))
            m.weight.grad = None
        for n, m in experts.items():
            I = m.gate_up_proj.shape[1] // 2
            gu, dn = m.gate_up_proj.grad, m.down_proj.grad
            for e in range(gu.shape[0]):
                g, u, d = _expert_names(n, e)
                _add(stats[g], gu[e, :I], directions.get(g))
                _add(stats[u], gu[e, I:], directions.get(u))
                _add(stats[d], dn[e], directions.get(d))
            m.gate_up_proj.grad = None
            m.down_proj.grad = None


class FisherTaps:
    """What the Fisher measurement installs on a model (or on one decoder layer under its model path,
    fq.allocation.streamed): the stats of every quantizable linear and expert projection, the experts' computing
    forward (``_ExpertsTap``), the energy hooks (summed while ``record[0]``) and gradients on the linears' weights
    only. ``take_grads(directions)`` adds the current weight gradients to the stats and clears them."""

    def __init__(self, model, stats: dict | None = None, expert_activations: bool = False):
        self.linears = quantizable_linears(model)
        self.experts = fused_experts(model)
        self.expert_activations = expert_activations
        self.stats = {} if stats is None else stats
        self.stats.update({n: LinearStat(m.out_features, m.in_features) for n, m in self.linears.items()})
        self.record = [True]
        self.taps = [_ExpertsTap(n, m, self.stats, self.record) for n, m in self.experts.items()]
        self.model, self.handles = model, []
        self.params = {n: m.weight for n, m in self.linears.items()}
        for n, m in self.experts.items():
            if expert_activations:  # no weight gradients: the experts' inputs and output gradients instead
                continue
            self.params[f"{n}.gate_up_proj"] = m.gate_up_proj
            self.params[f"{n}.down_proj"] = m.down_proj

    def _hook(self, name):
        import torch

        def fn(mod, args, out):
            if not self.record[0]:
                return
            with torch.no_grad():
                s = self.stats[name]
                x = args[0]
                s.x_energy += float(x.double().pow(2).sum())
                s.y_energy += float(out.double().pow(2).sum())
                s.tokens += int(x.numel() // x.shape[-1])
        return fn

    def __enter__(self):
        for p in self.model.parameters():
            p.requires_grad_(False)
        for p in self.params.values():
            p.requires_grad_(True)
        self.handles = [m.register_forward_hook(self._hook(n)) for n, m in self.linears.items()]
        for t in self.taps:
            t.__enter__()
        return self

    def __exit__(self, *exc):
        for t in self.taps:
            t.__exit__()
        for h in self.handles:
            h.remove()
        for p in self.params.values():
            p.requires_grad_(False)
        self.handles = []

    def take_grads(self, directions: dict) -> None:
        _take_grads(self.linears, {} if self.expert_activations else self.experts, self.stats, directions)

    def start_keeping(self) -> list:
        """With ``expert_activations``: a list per experts module (in ``taps`` order) of what the next forward and
        backward keep (``_ExpertsTap._keep``)."""
        kept = []
        for t in self.taps:
            t.acts = []
            kept.append(t.acts)
        return kept


def expert_forms(tap: "_ExpertsTap", kept: list, stats: dict, direction) -> None:
    """Add to ``stats`` each of the tap's experts' Fisher trace and quadratic form per kept forward (``kept``: one
    list per window and sample, in order, of ``_ExpertsTap._keep`` records), one expert at a time: its directions
    ``direction(name)`` (float64, as its weight) are made once for all the records. The gradient of a weight is
    d_outᵀ x over the tokens, so <grad, E> = sum(d_out * (x Eᵀ)) and ||grad||² = sum((d_out d_outᵀ) * (x xᵀ)),
    in float64 (the weight-gradient path rounds the gradient to float32 first: equal to float tolerance)."""
    import torch

    I = tap.I
    by_expert = [{r["e"]: r for r in recs} for recs in kept]
    with torch.no_grad():
        for e in range(tap.E):
            g, u, d = _expert_names(tap.name, e)
            dirs = {n: direction(n) for n in (g, u, d)}
            for recs in by_expert:
                r = recs.get(e)
                for n, x, dout in ((g, "x", slice(0, I)), (u, "x", slice(I, 2 * I)), (d, "a", None)):
                    stat = stats[n]
                    if not stat.quad:
                        stat.quad = [0.0]
                    if r is None:  # no token routed to it here: a zero gradient
                        continue
                    xs = r[x].double()
                    dy = (r["d_gu"][:, dout] if dout is not None else r["d_y"]).double()
                    E = dirs[n].to(xs.device, torch.float64)
                    stat.quad[0] += float((dy * (xs @ E.T)).sum()) ** 2
                    stat.fisher += float(((dy @ dy.T) * (xs @ xs.T)).sum())


def normalize(stats: dict, samples: int) -> None:
    """Sums over label samples -> means per sample (in place)."""
    for v in stats.values():
        v.fisher /= samples
        v.quad = [q / samples for q in v.quad]


def check_samples(samples: int) -> None:
    if samples < 1:
        raise FqError(f"sensitivity: samples {samples}: need at least 1 label sample per window")


def measure(model, windows, *, samples: int = 2, seed: int = 0, progress=None,
            directions: dict | None = None) -> Sensitivity:
    """The Fisher quadratic forms in ``directions`` (linear -> [E, ...]), traces and energies of every quantizable
    linear of ``model`` (transformers, float32) on ``windows`` [n, seq] token ids (module docstring).
    ``progress``: called with (done, total) after each window."""
    import torch

    check_samples(samples)
    gen = torch.Generator().manual_seed(seed)
    positions = 0
    model.eval()
    with FisherTaps(model) as taps:
        for i in range(windows.shape[0]):
            ids = windows[i: i + 1]
            for s in range(samples):
                taps.record[0] = s == 0  # energies once per window
                logp = inject.log_probs(model(input_ids=ids).logits)
                logp = logp.reshape(-1, logp.shape[-1])
                y = draw_labels(logp, gen)
                logp.gather(1, y).sum().backward()
                taps.take_grads(directions or {})
            positions += ids.shape[1] - 1
            if progress is not None:
                progress(i + 1, windows.shape[0])
    normalize(taps.stats, samples)
    return Sensitivity(positions=positions, samples=samples, linears=taps.stats)


def draw_labels(logp, gen):
    """One label per position from the model's own distribution (CPU draws: one random stream on any device)."""
    import torch

    with torch.no_grad():
        return torch.multinomial(logp.exp().cpu(), 1, generator=gen).to(logp.device)
