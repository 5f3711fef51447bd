"""A verified chain product in exllamav3 (CUDA): every routed-expert linear of a chained layer is the sum of the EXL3
GEMMs of its chain's stages, computed from the packed trellises; no dequantized weight is materialized.

The same verification as the CPU path (``fq.runtime.load.verify_product`` / ``verify_adapter_product``: the plan
under the pinned key, the whole base against its manifest, every stage byte against the plan) comes first. Then:

- The base reaches exllamav3 as the verified bytes only: every file its manifest lists is read once, its sha256
  compared with the manifest's, and that buffer written into a private directory (0700, removed on ``close``),
  from which exllamav3 loads. exllamav3 reads lazily, so loading the published directory itself would run
  whatever bytes sit there at load time, not the ones verified. The copy costs one base's worth of disk.
- Every stage's tensor set becomes one ``LinearEXL3`` (the runtime's own object: trellis int16, suh/svh fp16,
  the codebook marker), on the model's device.
- In each MoE layer that holds a chained expert, every expert linear is replaced by a ``ChainLinear`` whose forward
  is Σ_stage exl3_gemm(x, stage) in float32 (experts without stages: a chain of one, their base), and the layer is
  switched to exllamav3's per-expert path: its fused multi-expert kernels read one trellis per expert through
  pointer tables and cannot sum stages. Layers without chained experts keep every fast path.

    load_exl3_product(plan, key, device="cuda:0", ...) -> Exl3Product      # (a) a published tree's product
    load_exl3_adapter(base_dir, adapter, plan, key, device=..., ...)        # (b) base + ``fq combine`` adapter
    Exl3Product.forward(ids[1, T]) -> float32 logits; .close()

A product whose stages also correct non-expert linears (plan ``stage_linears``) is refused with a clear error (the
CPU path, ``fq.runtime.load``, sums them): summing attention's EXL3 GEMMs is not built here yet.

Needs CUDA and exllamav3 (imported lazily); tested against the CPU path's logits in tests/test_exl3_runtime.py.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fq.errors import FqError
from fq.runtime.load import (VerifiedChain, check_base_fragments, check_tensor_file, read_verified, verify_adapter_product,
                             verify_product)


def stage_base(vc: VerifiedChain, dest: Path) -> None:
    """Write every file of the verified base's manifest into ``dest`` from the bytes whose sha256 was just checked.
    Tensor files pass the same admission as the CPU path (attested; expert fragments are the plan's)."""
    files = vc.base.manifest.files
    for name in sorted(files):
        if name.endswith(".safetensors"):
            check_tensor_file(vc.base_dir, name, vc.base, vc.plan)
        _, data = read_verified(vc.base_dir, name, *files[name])
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
    check_base_fragments(vc.base_dir, vc.base, vc.plan)


class ChainLinear:
    """Stands in for a ``LinearEXL3`` (exllamav3 calls ``inner.forward(x, params, out_dtype)``): the float32 sum of
    one EXL3 GEMM per stage, in chain order, cast to the dtype the base linear would have produced."""

    def __init__(self, base, stages: list):
        self.base = base
        self.parts = [base] + stages
        self.in_features, self.out_features = base.in_features, base.out_features
        self.key = base.key
        self.bias = None
        for s in stages:
            if (s.in_features, s.out_features) != (self.in_features, self.out_features):
                raise FqError(f"{self.key}: a stage of shape {s.in_features}x{s.out_features} on a base of "
                              f"{self.in_features}x{self.out_features}")

    def forward(self, x, params, out_dtype=None):
        import torch

        x = (x if x.dtype == torch.half else x.half()).contiguous()  # the EXL3 GEMM reads fp16 rows
        y = self.parts[0].bc.run_alloc(x, self.out_features, True)
        for part in self.parts[1:]:
            y += part.bc.run_alloc(x, self.out_features, True)
        dtype = out_dtype or self.base.default_out_dtype
        return y if dtype == y.dtype else y.to(dtype)

    def unload(self):
        pass

    def get_tensors(self, key: str):
        raise FqError(f"{self.key}: a chain linear is not a single EXL3 tensor set (it cannot be re-saved)")


def _per_expert_path(mlp) -> None:
    """Route a BlockSparseMLP through exllamav3's per-expert torch path (each expert's Linear.forward), which is the
    only one that calls a replaced inner linear: the fused/batched/graph tiers read pointer tables of the base."""
    mlp.bc = None
    mlp.bc_sh_exp = False
    mlp.support_quant_paths = False
    mlp.support_bc_bszn = False
    mlp.fused_mode_buffers = None


def _stage_linear(config, tset: dict, in_features: int, out_features: int, device: str, key: str):
    from exllamav3.modules.quant.exl3 import LinearEXL3

    t = {s: v.to(device) for s, v in tset.items()}
    return LinearEXL3(config, in_features, out_features, suh=t["suh"].contiguous(), svh=t["svh"].contiguous(),
                      trellis=t["trellis"].contiguous(), mcg=tset.get("mcg"), mul1=tset.get("mul1"), key=key)


@dataclass
class Exl3Product:
    product: str
    chain: list[str]
    model: object
    config: object
    chained: dict = field(default_factory=dict)  # layer -> number of expert linears carrying stages
    linears: dict = field(default_factory=dict)  # checkpoint weight name -> ChainLinear (chained layers only)
    _tmp: tempfile.TemporaryDirectory | None = None

    def forward(self, ids, params: dict | None = None):
        """Float32 logits of one sequence ``ids`` [1, T] (no cache)."""
        out = self.model.forward(ids, dict(params or {"attn_mode": "flash_attn_nc"}))
        return out.float()

    def close(self) -> None:
        if self.model is not None:
            self.model.unload()
            self.model = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _build(vc: VerifiedChain, device: str, *, per_expert_everywhere: bool = False) -> Exl3Product:
    # stages' residuals on non-expert linears (attention, ...) are not summed on this path yet: refused, not dropped
    vc.product.refuse_stage_linears("fq.runtime.exl3 (exllamav3)")
    import exllamav3 as ex

    tmp = tempfile.TemporaryDirectory(prefix="fq-exl3-")
    try:
        os.chmod(tmp.name, 0o700)
        stage_base(vc, Path(tmp.name))
        config = ex.Config.from_directory(tmp.name)
        model = ex.Model.from_config(config)
        model.load(device)
        layout = vc.layout()
        plan = vc.plan
        by_layer: dict = {}
        for (layer, ex_, proj), sets in vc.stage_sets.items():
            by_layer.setdefault(layer, {})[(ex_, proj)] = sets
        chained: dict = {}
        linears: dict = {}
        for m in model:
            if not (hasattr(m, "ups") and hasattr(m, "downs") and hasattr(m, "fused_mode_buffers")):
                continue
            own = list(m.gates) + list(m.ups) + list(m.downs)
            layer = None
            for lin in own:
                try:
                    layer, _, _, _ = layout.parse(lin.key + ".weight")
                    break
                except FqError:
                    continue
            if layer is None or (layer not in by_layer and not per_expert_everywhere):
                continue
            mine = by_layer.get(layer, {})
            n = 0
            for lin in own:
                _, expert, proj, _ = layout.parse(lin.key + ".weight")
                if getattr(lin, "quant_type", None) != "exl3":
                    raise FqError(f"{lin.key}: not an EXL3 linear in the base as exllamav3 loaded it")
                stages = [_stage_linear(config, tset, lin.in_features, lin.out_features, device, f"{lin.key}.stage{i}")
                          for i, tset in mine.get((expert, proj), [])]
                lin.inner = linears[lin.key + ".weight"] = ChainLinear(lin.inner, stages)
                n += bool(stages)
            _per_expert_path(m)
            chained[layer] = n
        missing = sorted(set(by_layer) - set(chained))
        if missing:
            raise FqError(f"{vc.product.plan.path}: stages for layers {missing} whose MoE block exllamav3 did not build")
        return Exl3Product(plan["product"], [n["node"] for n in plan["chain"]], model, config, chained, linears,
                            tmp)
    except BaseException:
        tmp.cleanup()
        raise


def load_exl3_product(plan_path, public_key, *, device: str = "cuda:0", state=None,
                      per_expert_everywhere: bool = False, **kw) -> Exl3Product:
    """(a): a published tree's product. ``per_expert_everywhere``: every MoE layer takes the per-expert path (a
    chain of one where there are no stages): the path's own cost, measured apart from the stages'."""
    vc = verify_product(plan_path, public_key, state=state, **kw)
    out = _build(vc, device, per_expert_everywhere=per_expert_everywhere)
    vc.product.record(state)
    return out


def load_exl3_adapter(base_dir, adapter, plan_path, public_key, *, device: str = "cuda:0", state=None,
                      **kw) -> Exl3Product:
    """(b): a base checkpoint plus the adapter ``fq combine`` wrote (all experts or narrowed)."""
    vc = verify_adapter_product(base_dir, adapter, plan_path, public_key, state=state, **kw)
    out = _build(vc, device)
    vc.product.record(state)
    return out

