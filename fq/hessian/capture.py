"""The calibration chain: calibration tokens embedded and advanced through the SOURCE model one decoder layer at a
time, summing each MoE layer's routed-expert input Hessians on the way.

- ``embed``: the embedding rows of the tokens (``model.embed_tokens.weight`` only), float32 [rows, cols, hidden],
  times the factor the model's forward scales them by where the family has one (``Calibration.embed_scale``: AFMoE's
  muP).
- ``advance``: one layer. transformers' own decoder layer (``fq.hessian.layer``: built from that layer's tensors
  only, float32, the attention (sdpa; eager for gpt-oss) and grouped_mm experts as ``from_pretrained`` picks them
  on the CPU, position embeddings from the model's rotary module (none for Kimi-Linear's NoPE layers), the layer's
  mask from ``transformers.masking_utils`` as the model's forward makes it for that layer's attention type: causal,
  sliding-window or, for a linear-attention layer, none) runs the hidden states in fixed batches of ``row_batch``
  rows; each row is its own sequence, positions 0..cols-1. Forward hooks only read: the MoE block's input x and the
  router's top-k choice (the family's MoE block and router modules, ``layer.Arch``); the layer's output is the
  unchanged forward, with the model's true routing. At an MoE layer, per row, in row order:

      input    += xᵀx                                   (every token; float64)
      down[e]  += aᵀa,  a = act(x·gate_eᵀ)·(x·up_eᵀ)    (e ascending; every token, or with ``routed_only`` the
                                                       tokens whose top-k includes e)

  With ``weighting`` (config calibration.weighting, ``fq.hessian.affinity``) each token's term of ``down[e]`` is
  multiplied by the router's score c_te of expert e (every token, all-experts), their sum kept per expert; with
  ``affinity`` also ``input[e] += Σ c_te x_tᵀx_t`` per expert, beside the unweighted ``input``.

  a is computed from the layer's own fused ``gate_up_proj`` exactly as transformers' expert forward computes it
  (float32; ``layer.ExpertsModule.act_inputs``: gpt-oss adds its bias and applies its clamped swiglu to interleaved
  gate/up), then upcast. Dense layers (layer 0 of the demo) advance the hidden states and sum nothing.
- ``save_hidden`` / ``load_hidden``: the hidden states between layers as safetensors (``hidden`` F32
  [rows, cols, hidden], metadata: format, next layer, calibration digest, source config digest), written
  atomically (fq.model.shards.write_shard: temp, fsync, rename).
- ``capture_embed`` / ``capture_layer``: what one workflow job runs (a Snakemake script calls them): read the
  previous hidden file, read this layer's tensors from the shards, advance, write the next hidden file and, for an
  MoE layer, the Hessian file (``fq.hessian.store``). ``capture_all`` chains them (tests, the demo).

Determinism, and its scope: the sums are float64, accumulated in a fixed sequence (rows in order; within a row the
input, then experts ascending), the forward runs in fixed row batches, and on the CPU torch runs ``threads``
intra-op threads (1 by default, restored after). With the same inputs and settings (rows, cols, ``row_batch``,
``routed_only``, device) the same machine and torch build write byte-identical Hessian files
(tests/test_hessian.py checks it). Across machines it is not promised: BLAS kernels chosen for another instruction
set or build (or a GPU) may round the last bits of a forward or a sum differently. What binds an encode to its
Hessians is the Hessian file's sha256 (``store.read_hessians(path, expect_sha256)``): a campaign records the digest
of the file it captured and every encode names it, so one campaign never mixes Hessians; that binding is the
guarantee, not bit equality across machines.

Differences from exllamav3's converter, on purpose: every layer here sees the SOURCE model's activations (the
converter advances through each layer after quantizing it); tokens are the calibration text only (its mix adds
random ids); sums are float64 (its are float32). Whole-model bases: ``advance_linears`` / ``capture_layer(...,
linears=, out_linears=)`` also sum the input Hessians of the layer's non-expert linears (forward pre-hooks; linears
whose inputs are identical tensors share one group), and ``capture_head`` the head's (the last layer's output through
the final norm): ``fq.hessian.linear_store``. Not captured: next-token-prediction layers (layers past
``num_hidden_layers``: their input is not the chain's; their experts keep the weight-only encode).

Memory: one layer's tensors (float32) plus hidden [rows, cols, hidden] float32 in and out (GLM-5 at 250 × 2048:
12.6 GB each), the sums (float64: hidden² + n_experts · intermediate², 8.9 GB for GLM-5) and one row batch's
activations; with ``weighting: affinity`` also n_experts · hidden² float64 of per-expert input sums (77 GB for GLM-5:
fq price states it).

    embed(source, tokens, sha256=None) -> hidden0
    advance(layer, hidden, layer_tensors, config, *, routed_only=False, row_batch=4, device="cpu", threads=1)
        -> (hidden_next, LayerSums | None)
    save_hidden(path, hidden, *, next_layer, calibration, config_sha256); load_hidden(path, ...) -> (hidden, meta)
    capture_embed(source_dir, calibration, out_hidden, *, sha256=None) -> sha256 of out_hidden
    capture_layer(source_dir, layer, hidden_in, out_hidden, out_hessian=None, *, sha256=None, routed_only=False,
                  row_batch=4, device="cpu", threads=1) -> CaptureResult
    capture_all(source_dir, tokens, out_dir, ...) -> {"hidden": [...], "hessians": {layer: path}, "digests": {...}}
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Mapping

from fq.core import canonical
from fq.core.threads import torch_threads
from fq.errors import FqError
from fq.hessian import layer as layer_mod

if TYPE_CHECKING:
    import torch

HIDDEN_FORMAT = "fq-hidden/1"
HIDDEN = "hidden"
ROW_BATCH = 4
EMBED_FILE = "hidden-embed.safetensors"


def hidden_file(layer: int) -> str:
    """The hidden states after ``layer`` (what layer + 1 consumes)."""
    return f"hidden-layer{layer:03d}.safetensors"


@dataclass(eq=False)
class LayerSums:
    """One MoE layer's Hessian sums in float64 (not divided by the counts): what ``store.write_hessians`` packs.
    Weighted (``fq.hessian.affinity``): ``down`` holds Σ c·aᵀa, ``down_mass`` the Σ c per expert; with ``affinity``
    also ``inputs`` [n_experts, hidden, hidden] Σ c·xᵀx and ``input_mass``."""

    layer: int
    mode: str  # "all-experts" | "routed-only"
    input: "torch.Tensor"  # [hidden, hidden] float64
    input_count: int
    down: "torch.Tensor"  # [n_experts, intermediate, intermediate] float64
    down_counts: list[int]
    rows: int
    cols: int
    weighting: str = "none"  # fq.hessian.affinity.WEIGHTINGS
    down_mass: "torch.Tensor | None" = None  # [n_experts] float64
    inputs: "torch.Tensor | None" = None  # [n_experts, hidden, hidden] float64 (affinity)
    input_mass: "torch.Tensor | None" = None  # [n_experts] float64 (affinity)

    @property
    def hidden_size(self) -> int:
        return int(self.input.shape[0])

    @property
    def intermediate_size(self) -> int:
        return int(self.down.shape[1])

    @property
    def n_experts(self) -> int:
        return int(self.down.shape[0])

    @property
    def tokens(self) -> int:
        return self.rows * self.cols


def _checkpoint(source) -> layer_mod.Checkpoint:
    return source if isinstance(source, layer_mod.Checkpoint) else layer_mod.read_checkpoint(source)


def _check_tokens(tokens, vocab: int | None):
    import torch

    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise FqError(f"calibration tokens: expected an integer [rows, cols] tensor, got "
                      f"{getattr(tokens, 'dtype', type(tokens).__name__)} {list(getattr(tokens, 'shape', []))}")
    if tokens.numel() and (int(tokens.min()) < 0 or (vocab is not None and int(tokens.max()) >= vocab)):
        raise FqError(f"calibration tokens: ids {int(tokens.min())}..{int(tokens.max())} outside the model's "
                      f"vocabulary 0..{vocab - 1 if vocab else '?'}")
    return tokens.long()


def embed(source, tokens: "torch.Tensor", sha256: Mapping[str, str] | None = None) -> "torch.Tensor":
    """Embedding rows of ``tokens`` [rows, cols]: float32 [rows, cols, hidden]. ``source``: a checkpoint directory
    (only the embedding tensor is read), a ``layer.Checkpoint``, or ``(config, tensors)`` as
    ``fq.runtime.load.checkpoint_state`` returns them."""
    import torch

    if isinstance(source, tuple):
        config, tensors = source
        arch = layer_mod.architecture(config)
        if arch.embed not in tensors:
            raise FqError(f"no tensor {arch.embed} among the source tensors")
        weight = tensors[arch.embed].float()
    else:
        ckpt = _checkpoint(source)
        config = ckpt.config
        arch = layer_mod.architecture(config, f"{ckpt.dir}/config.json")
        weight = layer_mod.read_tensors(ckpt, [arch.embed], sha256)[0][arch.embed]
    tokens = _check_tokens(tokens, int(weight.shape[0]))
    hidden = torch.nn.functional.embedding(tokens, weight)
    if arch.embed_scale is not None:  # what the model's forward multiplies the embeddings by (AFMoE's muP)
        hidden = hidden * arch.embed_scale(layer_mod.hf_config(config))
    return hidden.contiguous()


def _act_inputs(arch: layer_mod.Arch, experts, x: "torch.Tensor", e: int) -> "torch.Tensor":
    """Expert e's down-projection input for tokens x, as transformers' expert forward computes it."""
    return arch.experts.act_inputs(experts, x, e)


def _hooks(module, arch: layer_mod.Arch, weighted: bool = False):
    """Forward hooks that record the MoE block's input and the router's top-k indices of the current batch (with
    ``weighted``, also its logits and the top-k weights it applies: ``fq.hessian.affinity``)."""
    from fq.hessian import affinity

    seen: dict = {}
    moe = getattr(module, arch.moe_block)

    def pre(_mod, args, kwargs):
        seen["x"] = (args[0] if args else kwargs["hidden_states"]).detach()

    def router(_mod, _inp, out):
        seen["topk"] = arch.router_topk(out).detach()
        if weighted:
            seen["logits"], seen["weights"] = affinity.router_outputs(out)

    handles = [moe.register_forward_pre_hook(pre, with_kwargs=True),
               getattr(moe, arch.router).register_forward_hook(router)]
    return seen, handles


def _mask_function(arch: layer_mod.Arch, hfc, layer: int):
    """The mask function the model's forward uses for ``layer`` (masking_utils' function for its attention type)."""
    from transformers import masking_utils

    kind = arch.mask_type(hfc, layer)
    fn = masking_utils.LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING.get(kind)
    if not callable(fn):
        raise FqError(f"layer {layer}: attention type {kind!r} has no mask function in transformers.masking_utils")
    return fn


def layer_call(arch: layer_mod.Arch, hfc, layer: int, rot, cols: int, device="cpu"):
    """fn(module, h [b, cols, hidden]) -> decoder layer ``layer``'s output, with the mask and position embeddings the
    model's forward hands that layer (positions 0..cols-1, each row its own sequence)."""
    import torch

    mask_kwargs = {"allow_is_causal_skip": False} if arch.materialized_mask else {}
    make_mask = _mask_function(arch, hfc, layer)
    position_ids = torch.arange(cols, device=device).unsqueeze(0)

    def call(module, h):
        pos_emb = {} if rot is None else {
            "position_embeddings": layer_mod.position_embeddings(rot, hfc, arch, layer, h, position_ids)}
        mask = make_mask(config=hfc, inputs_embeds=h, attention_mask=None, cache=None, position_ids=position_ids,
                         **mask_kwargs)
        y = module(h, attention_mask=mask, position_ids=position_ids, **pos_emb)
        return y[0] if isinstance(y, tuple) else y
    return call


def check_layer(arch: layer_mod.Arch, hfc, layer: int) -> None:
    """Refuse a layer the chain cannot run one layer at a time (before its tensors are read)."""
    if arch.shared_indexer is not None and arch.shared_indexer(hfc, layer):
        raise FqError(f"layer {layer}: its attention reuses the previous layer's top-k token selection (indexer_types: "
                      f"{hfc.indexer_types[layer]!r}); the calibration chain runs one layer per job and does not carry "
                      "that selection yet")


def check_built(arch: layer_mod.Arch, config: dict, layer: int, module) -> None:
    """Refuse a block transformers built unlike the config (MoE or dense)."""
    moe = hasattr(getattr(module, arch.moe_block), "experts")
    if moe != arch.is_moe(config, layer):
        raise FqError(f"layer {layer}: transformers built a {'MoE' if moe else 'dense'} block where {arch.name}'s "
                      "config says otherwise")


def advance(layer: int, hidden: "torch.Tensor", layer_tensors: Mapping[str, "torch.Tensor"], config: dict, *,
            routed_only: bool = False, row_batch: int = ROW_BATCH, device: str = "cpu", threads: int | None = 1,
            capture: bool = True, weighting: str = "none") -> tuple["torch.Tensor", LayerSums | None]:
    """Run ``hidden`` [rows, cols, hidden] through decoder layer ``layer`` (its checkpoint tensors, float32):
    (the layer's output, float32 on the CPU; the layer's Hessian sums for an MoE layer with ``capture``, else None)."""
    out, sums, _ = advance_linears(layer, hidden, layer_tensors, config, routed_only=routed_only,
                                   row_batch=row_batch, device=device, threads=threads, capture=capture,
                                   weighting=weighting)
    return out, sums


def _linear_hooks(module, arch: layer_mod.Arch, layer: int, names):
    """Forward pre-hooks on the layer's linears ``names`` (checkpoint tensor prefixes) recording their inputs."""
    prefix = arch.prefix.format(layer=layer)
    seen: dict = {n: [] for n in names}
    handles = []
    for n in names:
        if not n.startswith(prefix):
            raise FqError(f"layer {layer}: linear {n} is not one of the layer's ({prefix}*)")
        rel = arch.module_name(n[len(prefix):] + ".weight").removesuffix(".weight")
        try:
            sub = module.get_submodule(rel)
        except AttributeError:
            raise FqError(f"layer {layer}: transformers' {arch.layer_class} has no module {rel} (linear {n})") from None

        def pre(_mod, args, n=n):
            seen[n].append(args[0].detach())

        handles.append(sub.register_forward_pre_hook(pre))
    return seen, handles


def _linear_inputs(seen: dict, b: int, cols: int, layer) -> dict:
    """name -> its batch's input [b, cols, in] (tokens in row order), the hooks' records cleared."""
    out = {}
    for n, xs in seen.items():
        if len(xs) != 1:
            raise FqError(f"layer {layer}: linear {n} ran {len(xs)} times in one forward; its input Hessian expects "
                          "one call per batch")
        x = xs.pop()
        if x.numel() != b * cols * x.shape[-1]:
            raise FqError(f"layer {layer}: linear {n} saw input {list(x.shape)}, expected every one of the batch's "
                          f"{b * cols} tokens")
        out[n] = x.reshape(b, cols, x.shape[-1])
    return out


def _group(inputs: dict, groups: list | None, layer) -> list:
    """Groups of linears reading one identical input: fixed from the first batch; later batches must agree."""
    names = sorted(inputs)
    if groups is None:
        groups = []
        for n in names:
            for g in groups:
                if _same(inputs[g[0]], inputs[n]):
                    g.append(n)
                    break
            else:
                groups.append([n])
        return groups
    for g in groups:
        for n in g[1:]:
            if not _same(inputs[g[0]], inputs[n]):
                raise FqError(f"layer {layer}: linears {g[0]} and {n} read the same input in the first batch but not "
                              "in a later one")
    return groups


def _same(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


def advance_linears(layer: int, hidden: "torch.Tensor", layer_tensors: Mapping[str, "torch.Tensor"], config: dict, *,
                    routed_only: bool = False, row_batch: int = ROW_BATCH, device: str = "cpu",
                    threads: int | None = 1, capture: bool = True, linears=(), weighting: str = "none"):
    """``advance``, also summing the input Hessians of the layer's non-expert ``linears`` (checkpoint tensor
    prefixes): (output, LayerSums | None, linear_store.LinearSums | None). Per row, in row order, per group (the
    linears reading one identical input, sorted by name): H += xᵀx in float64. ``weighting`` (fq.hessian.affinity):
    each token's term of expert e's down (and, with ``affinity``, its own input) Hessian times the router's score c_te."""
    import torch

    from fq.hessian import affinity

    arch = layer_mod.architecture(config)
    affinity.check_weighting(arch.family, weighting, f"layer {layer}")
    if weighting != "none" and routed_only:
        raise FqError(f"layer {layer}: calibration.weighting {weighting} weights every token by its router score; it "
                      "takes capture all-experts, not routed-only")
    if not isinstance(row_batch, int) or isinstance(row_batch, bool) or row_batch < 1:
        raise FqError(f"capture: row_batch must be a positive integer, got {row_batch!r}")
    if hidden.dim() != 3 or hidden.dtype != torch.float32:
        raise FqError(f"layer {layer}: hidden states must be float32 [rows, cols, hidden], got {hidden.dtype} "
                      f"{list(hidden.shape)}")
    n_layers = arch.n_layers(config)
    if not 0 <= layer < n_layers:
        raise FqError(f"layer {layer}: the chain covers layers 0..{n_layers - 1} (num_hidden_layers); "
                      "next-token-prediction layers are not captured")
    hfc = layer_mod.hf_config(config)
    if hidden.shape[-1] != hfc.hidden_size:
        raise FqError(f"layer {layer}: hidden states of width {hidden.shape[-1]}, the model's hidden_size is "
                      f"{hfc.hidden_size}")
    check_layer(arch, hfc, layer)
    module = layer_mod.build_layer(hfc, arch, layer, layer_tensors).to(device)
    check_built(arch, config, layer, module)
    rot = layer_mod.rotary(hfc, arch)
    rot = None if rot is None else rot.to(device)
    moe = hasattr(getattr(module, arch.moe_block), "experts")
    call = layer_call(arch, hfc, layer, rot, hidden.shape[1], device)
    rows, cols, width = hidden.shape
    sums = None
    handles = []
    if moe and capture:
        experts = getattr(module, arch.moe_block).experts
        n_exp = int(experts.gate_up_proj.shape[0])
        inter = int(arch.experts.intermediate(experts))
        h_in = torch.zeros(width, width, dtype=torch.float64, device=device)
        h_down = torch.zeros(n_exp, inter, inter, dtype=torch.float64, device=device)
        counts = [0] * n_exp
        weighted = weighting != "none"
        if weighted:
            down_mass = torch.zeros(n_exp, dtype=torch.float64, device=device)
        if weighting == "affinity":  # one input Hessian per expert: n_exp · hidden² float64 while capturing
            h_inputs = torch.zeros(n_exp, width, width, dtype=torch.float64, device=device)
            input_mass = torch.zeros(n_exp, dtype=torch.float64, device=device)
        seen, handles = _hooks(module, arch, weighted)
    linears = tuple(sorted(set(linears)))
    lin_seen, groups, lin_sums = None, None, None
    if linears:
        lin_seen, lin_handles = _linear_hooks(module, arch, layer, linears)
        handles += lin_handles
    out = torch.empty_like(hidden)
    try:
        with torch.no_grad(), torch_threads(threads if str(device) == "cpu" else None):
            for lo in range(0, rows, row_batch):
                h = hidden[lo: lo + row_batch].to(device)
                y = call(module, h)
                out[lo: lo + row_batch] = y.to("cpu", torch.float32)
                if linears:
                    inputs = _linear_inputs(lin_seen, h.shape[0], cols, layer)
                    groups = _group(inputs, groups, layer)
                    if lin_sums is None:
                        lin_sums = [torch.zeros(inputs[g[0]].shape[-1], inputs[g[0]].shape[-1], dtype=torch.float64,
                                                device=device) for g in groups]
                    for r in range(h.shape[0]):
                        for i, g in enumerate(groups):
                            xd = inputs[g[0]][r].double()
                            lin_sums[i] += xd.T @ xd
                    del inputs
                if not (moe and capture):
                    continue
                x = seen.pop("x").reshape(h.shape[0], cols, width).float()
                topk = seen.pop("topk")
                if weighted:  # c [rows, cols, n_exp]: the router's score of each expert for each token
                    c = affinity.scores(seen.pop("logits"), seen.pop("weights"), topk, arch.cal.router_score,
                                        f"layer {layer} ({arch.name})").reshape(h.shape[0], cols, n_exp)
                topk = topk.reshape(h.shape[0], cols, -1)
                for r in range(h.shape[0]):
                    xr = x[r]
                    xd = xr.double()
                    h_in += xd.T @ xd
                    if weighting == "affinity":
                        for e in range(n_exp):
                            h_inputs[e] += (xd * c[r, :, e, None]).T @ xd
                            input_mass[e] += c[r, :, e].sum()
                    for e in range(n_exp):
                        a = _act_inputs(arch, experts, xr, e)
                        if routed_only:
                            a = a[(topk[r] == e).any(dim=-1)]
                        counts[e] += int(a.shape[0])
                        ad = a.double()
                        if weighted:
                            h_down[e] += (ad * c[r, :, e, None]).T @ ad
                            down_mass[e] += c[r, :, e].sum()
                        else:
                            h_down[e] += ad.T @ ad
    finally:
        for hd in handles:
            hd.remove()
    if moe and capture:
        sums = LayerSums(layer, "routed-only" if routed_only else "all-experts", h_in.cpu(), rows * cols, h_down.cpu(),
                         counts, rows, cols)
        if weighted:
            sums.weighting, sums.down_mass = weighting, down_mass.cpu()
        if weighting == "affinity":
            sums.inputs, sums.input_mass = h_inputs.cpu(), input_mass.cpu()
    lin = None
    if linears:
        from fq.hessian.linear_store import LinearSums

        lin = LinearSums(layer, tuple(tuple(g) for g in groups), tuple(t.cpu() for t in lin_sums),
                         tuple(rows * cols for _ in groups), rows, cols)
    return out, sums, lin


# -- hidden-state files ----------------------------------------------------------------------------------------------
HIDDEN_META = ("calibration", "cols", "config_sha256", "format", "hidden_size", "next_layer", "rows")


def save_hidden(path: str | os.PathLike, hidden: "torch.Tensor", *, next_layer: int, calibration: str,
                config_sha256: str) -> str:
    """Hidden states [rows, cols, hidden] float32 as safetensors, atomically; returns the file's sha256."""
    import torch

    from fq.model.shards import RawTensor, write_shard

    if hidden.dim() != 3 or hidden.dtype != torch.float32:
        raise FqError(f"{path}: hidden states must be float32 [rows, cols, hidden], got {hidden.dtype} "
                      f"{list(hidden.shape)}")
    rows, cols, width = hidden.shape
    meta = {"format": HIDDEN_FORMAT, "next_layer": str(next_layer), "calibration": calibration,
            "config_sha256": config_sha256, "rows": str(rows), "cols": str(cols), "hidden_size": str(width)}
    return write_shard(path, [RawTensor.of(HIDDEN, hidden.contiguous())], dict(sorted(meta.items())))


def load_hidden(path: str | os.PathLike, *, next_layer: int | None = None, calibration: str | None = None,
                config_sha256: str | None = None) -> tuple["torch.Tensor", dict]:
    """(hidden float32 [rows, cols, hidden], metadata with ``sha256`` of the file) of a hidden-state file; refuses
    one made for another layer, calibration or source config when those are given."""
    from fq.model.shards import read_into_tensors

    where = str(path)
    header, tensors, sha256 = read_into_tensors(path, "the hidden-state file")
    meta = dict(header.metadata)
    if sorted(meta) != sorted(HIDDEN_META) or meta["format"] != HIDDEN_FORMAT:
        raise FqError(f"{where}: not an {HIDDEN_FORMAT} file (metadata fields {sorted(meta)}, format "
                      f"{meta.get('format')!r})")
    names = [e.name for e in header.entries]
    e = header.entries[0] if names == [HIDDEN] else None
    if e is None or e.dtype != "F32" or len(e.shape) != 3 or \
            [str(d) for d in e.shape] != [meta["rows"], meta["cols"], meta["hidden_size"]]:
        raise FqError(f"{where}: expected one tensor {HIDDEN!r} F32 [rows, cols, hidden_size] as the metadata says, "
                      f"got {[(x.name, x.dtype, list(x.shape)) for x in header.entries]}")
    for key, want in (("next_layer", None if next_layer is None else str(next_layer)), ("calibration", calibration),
                      ("config_sha256", config_sha256)):
        if want is not None and meta[key] != want:
            raise FqError(f"{where}: metadata field {key} is {meta[key]!r}, expected {want!r}")
    meta["sha256"] = sha256
    return tensors[HIDDEN], meta


# -- jobs ------------------------------------------------------------------------------------------------------------
def _device(device) -> str:
    """A device string, or a callable that claims one (``fq.workflow.devices.claim``): called once the job's inputs
    are read, so that a job waiting for its inputs (12.6 GB of hidden states at GLM-5's width) holds no GPU."""
    return device() if callable(device) else device


@dataclass
class CaptureResult:
    layer: int
    moe: bool
    hidden_sha256: str
    hessian_sha256: str | None = None
    source_shards: dict = field(default_factory=dict)
    linears_sha256: str | None = None


def _versions() -> dict:
    import torch
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__}


def capture_embed(source_dir, calibration, out_hidden: str | os.PathLike, *,
                  sha256: Mapping[str, str] | None = None) -> str:
    """The chain's first file: the calibration tokens' embeddings (``calibration``: a ``CalibrationTokens``)."""
    ckpt = _checkpoint(source_dir)
    hidden = embed(ckpt, calibration.tokens, sha256)
    return save_hidden(out_hidden, hidden, next_layer=0, calibration=calibration.digest,
                       config_sha256=ckpt.config_sha256)


def capture_layer(source_dir, layer: int, hidden_in: str | os.PathLike, out_hidden: str | os.PathLike,
                  out_hessian: str | os.PathLike | None = None, *, sha256: Mapping[str, str] | None = None,
                  routed_only: bool = False, row_batch: int = ROW_BATCH, device: str | Callable[[], str] = "cpu",
                  threads: int | None = 1, linears=(), out_linears: str | os.PathLike | None = None,
                  weighting: str = "none") -> CaptureResult:
    """One job: ``hidden_in`` (made for ``layer``, from this source's config) through ``layer``; writes
    ``out_hidden`` and, for an MoE layer, ``out_hessian`` (required there; refused for a dense layer).
    ``linears`` (checkpoint tensor prefixes of the layer's non-expert linears a whole-model base quantizes): their
    input Hessians go to ``out_linears`` (``fq.hessian.linear_store``; both or neither).
    ``sha256``: shard -> digest the campaign recorded (shards that differ are refused). ``weighting``: the expert
    Hessians' router-affinity weighting (fq.hessian.affinity; none: every token at weight 1)."""
    ckpt = _checkpoint(source_dir)
    arch = layer_mod.architecture(ckpt.config, f"{ckpt.dir}/config.json")
    n_layers = arch.n_layers(ckpt.config, f"{ckpt.dir}/config.json")
    if not isinstance(layer, int) or not 0 <= layer < n_layers:
        raise FqError(f"{ckpt.dir}: layer {layer!r}: the calibration chain covers layers 0..{n_layers - 1}")
    moe = arch.is_moe(ckpt.config, layer)
    if moe and out_hessian is None:
        raise FqError(f"layer {layer} is an MoE layer: capture_layer needs out_hessian")
    if not moe and out_hessian is not None:
        raise FqError(f"layer {layer} is dense: it has no routed experts and no Hessian file ({out_hessian})")
    if bool(linears) != (out_linears is not None):
        raise FqError(f"layer {layer}: capture_layer takes linears and out_linears together")
    hidden, meta = load_hidden(hidden_in, next_layer=layer, config_sha256=ckpt.config_sha256)
    tensors, shards = layer_mod.layer_tensors(ckpt, layer, sha256)
    device = _device(device)
    out, sums, lin = advance_linears(layer, hidden, tensors, ckpt.config, routed_only=routed_only,
                                     row_batch=row_batch, device=device, threads=threads, linears=linears,
                                     weighting=weighting)
    del tensors, hidden
    result = CaptureResult(layer, moe, "", None, shards)
    if lin is not None:
        from fq.hessian import linear_store

        result.linears_sha256 = linear_store.write_linear_hessians(out_linears, lin, {
            "architecture": arch.name, "calibration": meta["calibration"], "config_sha256": ckpt.config_sha256,
            "source_shards": shards, "hidden_in": meta["sha256"], "row_batch": row_batch, "rows": lin.rows,
            "cols": lin.cols, **_versions()})
    if sums is not None:
        from fq.hessian import store

        result.hessian_sha256 = store.write_hessians(out_hessian, sums, {
            "architecture": arch.name, "calibration": meta["calibration"], "config_sha256": ckpt.config_sha256,
            "source_shards": shards, "hidden_in": meta["sha256"], "row_batch": row_batch, "rows": sums.rows,
            "cols": sums.cols, **_versions()})
    result.hidden_sha256 = save_hidden(out_hidden, out, next_layer=layer + 1, calibration=meta["calibration"],
                                       config_sha256=ckpt.config_sha256)
    return result


def final_norm(ckpt: layer_mod.Checkpoint, sha256: Mapping[str, str] | None = None):
    """The model's final norm (``{layers prefix minus 'layers.'}norm.weight``; LFM2-MoE's ``embedding_norm``:
    ``Calibration.final_norm``) as transformers builds it: a decoder-layer norm's class and epsilon
    (``input_layernorm``, LFM2-MoE's ``operator_norm``; every registered family builds both alike), float32."""
    import copy

    import torch

    arch = layer_mod.architecture(ckpt.config, f"{ckpt.dir}/config.json")
    hfc = layer_mod.hf_config(ckpt.config)
    norm_name, layer_norm = arch.cal.final_norm
    name = arch.family.layout.layers.removesuffix("layers.") + norm_name + ".weight"
    if name not in ckpt.weight_map:
        raise FqError(f"{ckpt.dir}: no final norm {name} in the weight map; the head's Hessian needs it")
    layer_cls, _ = arch.classes()
    with torch.device("meta"):
        norm = copy.deepcopy(layer_cls(hfc, 0).get_submodule(layer_norm))
    tensors, shards = layer_mod.read_tensors(ckpt, [name], sha256)
    norm.load_state_dict({"weight": tensors[name].float()}, strict=True, assign=True)
    return norm.eval(), shards


def capture_head(source_dir, hidden_in: str | os.PathLike, out_linears: str | os.PathLike, *,
                 sha256: Mapping[str, str] | None = None, row_batch: int = ROW_BATCH,
                 device: str | Callable[[], str] = "cpu", threads: int | None = 1) -> str:
    """The head's input Hessian: the last decoder layer's output (``hidden_in``) through the final norm, Σ xᵀx per
    row in row order (float64), written as ``linear_store`` file ``layer: head`` with one group ``[lm_head]``;
    returns its sha256."""
    import torch

    from fq.hessian import linear_store

    ckpt = _checkpoint(source_dir)
    arch = layer_mod.architecture(ckpt.config, f"{ckpt.dir}/config.json")
    n_layers = arch.n_layers(ckpt.config, f"{ckpt.dir}/config.json")
    hidden, meta = load_hidden(hidden_in, next_layer=n_layers, config_sha256=ckpt.config_sha256)
    norm, shards = final_norm(ckpt, sha256)
    device = _device(device)
    norm = norm.to(device)
    rows, cols, width = hidden.shape
    total = torch.zeros(width, width, dtype=torch.float64, device=device)
    with torch.no_grad(), torch_threads(threads if str(device) == "cpu" else None):
        for lo in range(0, rows, row_batch):
            x = norm(hidden[lo: lo + row_batch].to(device)).float()
            for r in range(x.shape[0]):
                xd = x[r].double()
                total += xd.T @ xd
    sums = linear_store.LinearSums(None, (("lm_head",),), (total.cpu(),), (rows * cols,), rows, cols)
    return linear_store.write_linear_hessians(out_linears, sums, {
        "architecture": arch.name, "calibration": meta["calibration"], "config_sha256": ckpt.config_sha256,
        "source_shards": shards, "hidden_in": meta["sha256"], "row_batch": row_batch, "rows": rows, "cols": cols,
        **_versions()})


def capture_all(source_dir, tokens, out_dir: str | os.PathLike, *, sha256: Mapping[str, str] | None = None,
                routed_only: bool = False, row_batch: int = ROW_BATCH, device: str = "cpu",
                threads: int | None = 1, keep_hidden: bool = True, weighting: str = "none") -> dict:
    """The whole chain into ``out_dir``: ``hidden-embed.safetensors``, ``hidden-layer{L:03d}.safetensors`` after each
    layer (all but the last removed unless ``keep_hidden``) and ``hessian-layer{L:03d}.safetensors`` per MoE layer.
    ``tokens``: a ``CalibrationTokens`` or an int64 [rows, cols] tensor (its digest computed here)."""
    from fq.hessian import store
    from fq.hessian.calibration import CalibrationTokens, token_digest

    if not isinstance(tokens, CalibrationTokens):
        tokens = CalibrationTokens(_check_tokens(tokens, None), token_digest(tokens), {"kind": "tensor"})
    ckpt = _checkpoint(source_dir)
    arch = layer_mod.architecture(ckpt.config, f"{ckpt.dir}/config.json")
    out = Path(out_dir)
    prev = out / EMBED_FILE
    digests = {EMBED_FILE: capture_embed(ckpt, tokens, prev, sha256=sha256)}
    hidden, hessians = [prev], {}
    for L in range(arch.n_layers(ckpt.config, f"{ckpt.dir}/config.json")):
        nxt = out / hidden_file(L)
        hess = out / store.file_name(L) if arch.is_moe(ckpt.config, L) else None
        r = capture_layer(ckpt, L, prev, nxt, hess, sha256=sha256, routed_only=routed_only, row_batch=row_batch,
                          device=device, threads=threads, weighting=weighting)
        digests[nxt.name] = r.hidden_sha256
        if hess is not None:
            hessians[L] = hess
            digests[hess.name] = r.hessian_sha256
        if not keep_hidden:
            prev.unlink()
        hidden.append(nxt)
        prev = nxt
    if not keep_hidden:
        hidden = [prev]
    return {"hidden": hidden, "hessians": hessians, "digests": digests, "calibration": tokens.digest}
