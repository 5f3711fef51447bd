"""exllamav3 against fq's reference forward, for the GPU tests (tests/test_exl3_runtime.py, tests/test_exl3_families.py).

    exllamav3_or_skip() -> the exllamav3 module (the test skips without it)
    logit_agreement(ref, got) -> the dict below, for any two logit tensors of one shape
    base_agreement(ex, root, product, key, ids) -> {max_abs_logit_diff, logit_abs_max, kl_ref_exl3, top1_agreement,
                                                   positions, positions_over_0.05}

``product``: the publication's entry of a bare base; the reference is fq's own forward (the verified product loaded by
fq.runtime into transformers, float32, routed experts = fq's reconstruction) and exllamav3 loads
``root/base/<node>/`` and runs ``attn_mode: flash_attn_nc`` per row of ``ids``, on the same GPU.

    MoeTap(model), forward_routing_forced(p, tap, ids): the reference's routing recorded, then forced on exllamav3's
    MoE blocks, so a routing flip at a near-tie and the arithmetic are told apart
"""
from __future__ import annotations

import pytest
import torch


def exllamav3_or_skip():
    try:
        import exllamav3  # noqa: F401  (JIT-builds its extension at first import: minutes)
    except Exception as e:  # noqa: BLE001  a missing wheel, or an extension that does not build
        pytest.skip(f"exllamav3 unavailable: {type(e).__name__}: {e}")
    return exllamav3


def base_agreement(ex, root, product: dict, key, ids: torch.Tensor, exl3_dir=None) -> dict:
    """``exl3_dir``: the directory exllamav3 loads instead of the published base (a control: the base with a file
    removed)."""
    from fq.runtime.load import load_product

    ref_model = load_product(root / product["file"], key, state=None).model.to("cuda:0")
    with torch.no_grad():
        ref = ref_model(ids.to("cuda:0")).logits.float()
    del ref_model
    model = ex.Model.from_config(ex.Config.from_directory(str(exl3_dir or root / "base" / product["chain"][0])))
    model.load("cuda:0")
    try:
        got = torch.cat([model.forward(w[None], {"attn_mode": "flash_attn_nc"}).float().to("cuda:0") for w in ids])
    finally:
        model.unload()
    return logit_agreement(ref, got)


def logit_agreement(ref: torch.Tensor, got: torch.Tensor) -> dict:
    """How far ``got`` (exllamav3's logits) is from ``ref`` (the reference's), position by position on the last dim."""
    assert got.shape == ref.shape, (got.shape, ref.shape)
    lp_ref, lp_got = torch.log_softmax(ref, -1), torch.log_softmax(got, -1)
    return {"max_abs_logit_diff": (got - ref).abs().max().item(), "logit_abs_max": ref.abs().max().item(),
            "kl_ref_exl3": (lp_ref.exp() * (lp_ref - lp_got)).sum(-1).mean().item(),
            "top1_agreement": (got.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "positions": ref.shape[:-1].numel(),
            # a handful of positions far off (a near-tie routed the other way in fp16) or all of them (a misread)
            "positions_over_0.05": int(((got - ref).abs().amax(-1) > 0.05).sum().item())}


class MoeTap:
    """Forward hooks on a transformers model's MoE blocks: each block's input, output and routing (router logits, top-k
    indices and weights), as rows in call order (a batch [B, T] gives B*T rows, window after window); ``gates``: each
    block's router module, by layer."""

    def __init__(self, model):
        self.records: dict = {}
        self.handles = []
        self.gates: dict = {}
        for i, layer in enumerate(model.model.layers):
            mlp = layer.mlp
            if not hasattr(mlp, "gate") or not hasattr(mlp, "experts"):
                continue
            self.gates[i] = mlp.gate
            self.handles.append(mlp.register_forward_hook(self._mlp_hook(i)))
            self.handles.append(mlp.gate.register_forward_hook(self._gate_hook(i)))

    def _record(self, i) -> dict:
        return self.records.setdefault(i, {"x": [], "y": [], "logits": [], "sel": [], "w": []})

    def _mlp_hook(self, i):
        def hook(mod, args, out):
            r = self._record(i)
            r["x"].append(args[0].detach().reshape(-1, args[0].shape[-1]))
            r["y"].append((out[0] if isinstance(out, tuple) else out).detach().reshape(-1, args[0].shape[-1]))
        return hook

    def _gate_hook(self, i):
        def hook(mod, args, out):
            logits, w, sel = out  # transformers' MoE routers return (logits, top-k weights, top-k indices)
            r = self._record(i)
            r["logits"].append(logits.detach().reshape(-1, logits.shape[-1]).float())
            r["sel"].append(sel.detach().reshape(-1, sel.shape[-1]))
            r["w"].append(w.detach().reshape(-1, w.shape[-1]).float())
        return hook

    def close(self):
        for h in self.handles:
            h.remove()

    def layer(self, i) -> dict:
        return {k: torch.cat(v) for k, v in self.records[i].items()}


def moe_modules(model) -> dict:
    """exllamav3's MoE blocks of a loaded model, by layer index."""
    out = {}
    for m in model:
        if hasattr(m, "ups") and hasattr(m, "downs") and hasattr(m, "routing_fn"):
            out[int(m.key.split(".")[2])] = m
    return out


def forward_routing_forced(p, tap: MoeTap, ids: torch.Tensor) -> torch.Tensor:
    """``p.forward`` (an fq.runtime.exl3 product) per row of ``ids`` [W, T] with every MoE block's routing replaced by
    the one ``tap`` recorded from the reference on the same windows: what departs from the reference once routing
    flips at near-ties are taken out is the arithmetic alone."""
    seq = ids.shape[-1]
    mods = {i: m for i, m in moe_modules(p.model).items() if i in tap.records}
    routes = {i: tap.layer(i) for i in mods}
    saved = {i: m.routing_fn for i, m in mods.items()}

    def fixed(sel, w):
        return lambda bsz, cfg, z, params: (sel.to(torch.long).contiguous(), w.half().contiguous())

    out = []
    try:
        for j, w in enumerate(ids):
            rows = slice(j * seq, (j + 1) * seq)
            for i, m in mods.items():
                m.routing_fn = fixed(routes[i]["sel"][rows], routes[i]["w"][rows])
            out.append(p.forward(w[None]).to("cuda:0"))
    finally:
        for i, m in mods.items():
            m.routing_fn = saved[i]
    return torch.cat(out)
