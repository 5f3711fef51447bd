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
- In each MoE layer that holds a chained expert, the routed experts run grouped on exllamav3's multi-expert EXL3 GEMM,
  one launch per projection and stage, stages summed in float32 (fq.runtime.exl3_chain_moe). Where that path does not
  apply (``moe_paths`` says why), every expert linear is replaced by a ``ChainLinear`` whose forward is
  Σ_stage exl3_gemm(x, stage) in float32 (experts without stages: a chain of one) and the layer takes exllamav3's
  per-expert path. Layers without chained experts keep every fast path.
- A stage's residuals on non-expert linears (plan ``stage_linears``: attention, shared experts, dense MLPs, the head)
  are summed the same way: the linear's inner becomes a ``ChainLinear``, and the module that owns it drops the bundles
  that read its trellis through pointers (attention's sliced/pairwise q/k/v bundles, an MLP's bound class and
  gate/up bundle; an MoE block whose shared expert is chained loses its fused tiers: its routed sum stays grouped
  where the block has routed stages, else it takes the per-expert path).

    load_exl3_product(plan, key, device="cuda:0", cache_tokens=None, ...) -> Exl3Product   # (a) a published tree's
    load_exl3_adapter(base_dir, adapter, plan, key, device=..., ...)        # (b) base + ``fq combine`` adapter
    Exl3Product.forward(ids[1, T]) -> float32 logits; .close()
    Exl3Product.generate(prompts, max_new_tokens) -> greedy completions through exllamav3's own Generator and KV
        cache (the serving path TabbyAPI uses); needs ``cache_tokens`` at load (the cache is allocated by the load)

Needs CUDA and exllamav3 (imported lazily); tested against the CPU path's logits in tests/test_exl3_runtime.py.
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fq.core.targets import EXLLAMAV3
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
        self.default_out_dtype = base.default_out_dtype
        # no bound class: exllamav3's fused paths test ``inner.bc`` and fall back to calling ``forward``
        self.bc = None
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

    cache: object = None
    tokenizer: object = None
    _generator: object = None
    _text_tok: object = None
    moe_paths: dict = field(default_factory=dict)  # chained layer -> "grouped", or why it takes the per-expert path

    def forward(self, ids, params: dict | None = None):
        """Float32 logits of one sequence ``ids`` [1, T] (no cache)."""
        out = self.model.forward(ids, dict(params or {"attn_mode": "flash_attn_nc"}))
        return out.float()

    def generate(self, prompts: list[list[int]], max_new_tokens: int, *, logits: bool = False) -> list[dict]:
        """Greedy (argmax) completions of token-id prompts, all enqueued at once so exllamav3's Generator batches them
        over its paged KV cache. One dict per prompt, in order: ``tokens`` (the new ids), and with ``logits`` the
        float32 logits each was chosen from [n, vocab] (to show whether a divergence is a near-tie)."""
        import torch
        import exllamav3 as ex

        if self.cache is None:
            raise FqError(f"{self.product}: loaded without a KV cache: load it with cache_tokens=N to generate")
        if self._generator is None:
            self._generator = ex.Generator(model=self.model, cache=self.cache, tokenizer=self.tokenizer,
                                           max_batch_size=max(8, len(prompts)))
        gen = self._generator
        jobs = [ex.Job(input_ids=torch.tensor([p], dtype=torch.long), max_new_tokens=max_new_tokens,
                       sampler=ex.ArgmaxSampler(), stop_conditions=[], return_logits=logits, identifier=i)
                for i, p in enumerate(prompts)]
        gen.enqueue(jobs)
        out = [{"tokens": [], "logits": []} if logits else {"tokens": []} for _ in prompts]
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") != "streaming":
                    continue
                o = out[r["identifier"]]
                if r.get("token_ids") is not None:
                    o["tokens"].extend(int(t) for t in r["token_ids"].flatten().tolist())
                if logits and r.get("logits") is not None:
                    o["logits"].append(r["logits"].float().reshape(-1, r["logits"].shape[-1]).cpu())
        if logits:
            for o in out:
                o["logits"] = torch.cat(o["logits"]) if o["logits"] else None
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the verified base's own tokenizer.json (no special tokens added)."""
        return self._text_tokenizer().encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._text_tokenizer().decode(ids)

    def _text_tokenizer(self):
        """The verified base's tokenizer.json, read once."""
        if self._text_tok is None:
            from tokenizers import Tokenizer

            path = Path(self._tmp.name) / "tokenizer.json" if self._tmp is not None else None
            if path is None or not path.is_file():
                raise FqError(f"{self.product}: the base has no tokenizer.json (token ids only)")
            self._text_tok = Tokenizer.from_file(str(path))
        return self._text_tok

    def close(self) -> None:
        self._generator = None
        if self.model is not None:
            self.model.unload()
            self.model = None
        self.cache = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _unbundle(module) -> None:
    """Drop the bundles of ``module`` (an exllamav3 module owning a chained non-expert linear) that read its linears'
    trellises through pointer tables, so every projection runs through its own ``Linear.forward`` (the inner that
    sums the stages). An MoE block whose shared expert is chained loses its fused tiers (its fused decode kernel
    reads the shared expert's pointers too); a block already on the grouped path keeps it (exllamav3 takes the
    routed-sum seam before any tier)."""
    for attr in ("multi_qkv", "multi_kv", "multi_qg", "bc"):
        if getattr(module, attr, None) is not None:
            setattr(module, attr, None)
    if getattr(module, "multi_gu", None) is not None:
        module.multi_gu = [None] * len(module.multi_gu)


def _chain_linears(model, config, vc: VerifiedChain, device: str, linears: dict) -> None:
    """Every non-expert linear a stage corrects (``vc.stage_linears``) becomes a ChainLinear of the base's EXL3 linear
    and the stages' residuals. A residual whose linear exllamav3 did not build as its own EXL3
    linear is refused, never dropped."""
    if not vc.stage_linears:
        return
    owners, found = {}, {}
    for m in model:
        for child in getattr(m, "modules", ()):
            owners[id(child)] = m
        key = getattr(m, "key", None)
        if key is not None and f"{key}.weight" in vc.stage_linears and hasattr(m, "inner"):
            found[f"{key}.weight"] = m
    missing = sorted(set(vc.stage_linears) - set(found))
    if missing:
        raise FqError(f"{vc.product.plan.path}: stage residuals on {missing[:3]}, which exllamav3 did not build as "
                      f"linears of their own")
    for name, lin in sorted(found.items()):
        if getattr(lin, "quant_type", None) != "exl3":
            raise FqError(f"{lin.key}: a stage residual on a linear the base keeps unquantized")
        stages = [_stage_linear(config, tset, lin.in_features, lin.out_features, device, f"{lin.key}.stage{i}")
                  for i, tset in vc.stage_linears[name]]
        lin.inner = linears[name] = ChainLinear(lin.inner, stages)
        owner = owners.get(id(lin))
        while owner is not None:  # the attention / MLP holding it, and an MoE block holding that MLP
            _unbundle(owner)
            if hasattr(owner, "fused_mode_buffers"):
                _per_expert_path(owner)
            owner = owners.get(id(owner))


def _runtime():
    """exllamav3, once the product is verified: a clear error where there is no CUDA device or no exllamav3."""
    import torch

    if not torch.cuda.is_available():
        raise FqError("exllamav3 runs on CUDA: no CUDA device here (the product verified; fq eval and "
                      "fq.runtime.load run it on the CPU)")
    try:
        import exllamav3 as ex
    except ImportError as e:
        raise FqError(f"exllamav3 is not installed ({e}): pip install exllamav3=={EXLLAMAV3}") from e
    return ex


def _build(vc: VerifiedChain, device: str, *, per_expert_everywhere: bool = False,
           cache_tokens: int | None = None, moe_path: str = "grouped") -> Exl3Product:
    ex = _runtime()
    from fq.runtime.exl3_chain_moe import attach as attach_chain_moe

    if moe_path not in ("grouped", "per-expert"):
        raise FqError(f"moe_path: {moe_path!r}; expected 'grouped' or 'per-expert'")

    tmp = tempfile.TemporaryDirectory(prefix="fq-exl3-")
    try:
        os.chmod(tmp.name, 0o700)
        stage_base(vc, Path(tmp.name))
        config = ex.Config.from_directory(tmp.name)
        model = ex.Model.from_config(config)
        # exllamav3 allocates a cache's tensors in the model's load: it must exist before
        cache = ex.Cache(model, max_num_tokens=cache_tokens) if cache_tokens else None
        model.load(device)
        tokenizer = ex.Tokenizer.from_config(config) if cache_tokens else None
        layout = vc.layout()
        plan = vc.plan
        by_layer: dict = {}
        for (layer, ex_, proj), sets in vc.stage_sets.items():
            by_layer.setdefault(layer, {})[(ex_, proj)] = sets
        chained: dict = {}
        linears: dict = {}
        paths: dict = {}
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
            base = {"gate": [], "up": [], "down": []}
            staged: dict = {}
            for role, lins in (("gate", m.gates), ("up", m.ups), ("down", m.downs)):
                for e, lin in enumerate(lins):
                    _, expert, proj, _ = layout.parse(lin.key + ".weight")
                    if getattr(lin, "quant_type", None) != "exl3":
                        raise FqError(f"{lin.key}: not an EXL3 linear in the base as exllamav3 loaded it")
                    stages = [(i, _stage_linear(config, tset, lin.in_features, lin.out_features, device,
                                                f"{lin.key}.stage{i}"))
                              for i, tset in mine.get((expert, proj), [])]
                    base[role].append(lin.inner)
                    if stages:
                        staged[(e, role)] = stages
                    lin.inner = linears[lin.key + ".weight"] = ChainLinear(lin.inner, [s for _, s in stages])
                    n += bool(stages)
            why = "per-expert path asked for" if per_expert_everywhere or moe_path == "per-expert" else \
                attach_chain_moe(m, base, staged)
            if why:
                _per_expert_path(m)
            chained[layer] = n
            paths[layer] = why or "grouped"
        missing = sorted(set(by_layer) - set(chained))
        if missing:
            raise FqError(f"{vc.product.plan.path}: stages for layers {missing} whose MoE block exllamav3 did not build")
        _chain_linears(model, config, vc, device, linears)
        return Exl3Product(plan["product"], [n["node"] for n in plan["chain"]], model, config, chained, linears,
                            tmp, cache, tokenizer, moe_paths=paths)
    except BaseException:
        tmp.cleanup()
        raise


def load_exl3_product(plan_path, public_key, *, device: str = "cuda:0", state=None,
                      per_expert_everywhere: bool = False, cache_tokens: int | None = None,
                      moe_path: str = "grouped", **kw) -> Exl3Product:
    """(a): a published tree's product. ``per_expert_everywhere``: every MoE layer takes the per-expert path (a
    chain of one where there are no stages): the path's own cost, measured apart from the stages'. ``cache_tokens``:
    a KV cache of that many tokens (a multiple of 256) for ``generate``."""
    vc = verify_product(plan_path, public_key, state=state, **kw)
    out = _build(vc, device, per_expert_everywhere=per_expert_everywhere, cache_tokens=cache_tokens,
                 moe_path=moe_path)
    vc.product.record(state)
    return out


def load_exl3_adapter(base_dir, adapter, plan_path, public_key, *, device: str = "cuda:0", state=None,
                      cache_tokens: int | None = None, moe_path: str = "grouped", **kw) -> Exl3Product:
    """(b): a base checkpoint plus the adapter ``fq combine`` wrote (all experts or narrowed)."""
    vc = verify_adapter_product(base_dir, adapter, plan_path, public_key, state=state, **kw)
    out = _build(vc, device, cache_tokens=cache_tokens, moe_path=moe_path)
    vc.product.record(state)
    return out

