"""Load a chain product into a transformers model on the CPU, after verifying everything under the pinned key.

Two ways in, one set of checks (``fq combine``'s: ``fq.provenance.combine``, ``.product``, ``.manifest``):

(a) ``product_state(plan)``: a published tree and one of its signed plans. The plan is opened as every consumer
    opens it (``open_product``: signature, schema, chain, edges, expiry, file name, version state, the publication
    statement beside ROOT); the base directory the plan pins is verified whole (``verify_base``: its manifest's
    digest is the plan's, every file listed and re-hashed, attested shards against their attestations); every
    fragment passes ``verify_fragments`` (attestation, header, ranges hashed against the plan, K/codebook
    re-derived, finite scales, geometry along the chain).
(b) ``adapter_state(base_dir, adapter, plan)``: a base checkpoint, the adapter ``fq combine`` wrote from that plan
    (all experts, or narrowed to some) and the plan itself (a few kB: the adapter is the holder's own copy, and
    what vouches for its bytes is the plan). The plan and the base as in (a); the adapter by
    ``fq.provenance.combine.verify_adapter`` (every stage's bytes of every expert it holds equal the plan's digest of that
    fragment range; an expert carries all of the chain's stages that cover it, or is absent and keeps its base).

A product whose stages also correct non-expert linears (plan ``stage_linears``: recipe ``skeleton`` on a stage) has
each such residual fragment verified against the plan (``stage_linear_sets``), and each quantized linear is the sum of
the base's reconstruction and its stages' residuals, in chain order, as a routed expert is; (b) refuses such a
product (an adapter carries routed-expert stages only).

Then, from the verified bytes only (each base file is read once into memory and its sha256 compared with the
manifest's before it is parsed): the skeleton tensors verbatim (upcast to float32, exact), and per routed-expert
linear the float32 sum of its chain's reconstructions (``reconstruct_chain``: base, then the stages in chain
order; each stored set first as it reconstructs the source's matrix, ``ExpertLayout.source``: Laguna's routed up_proj
is stored times 2^-7, as exllamav3 reads it), trimmed to the matrix's own (out, in) from the model config
(``fq.model.source.config_expert_shapes``): a matrix whose dims are not multiples of 128 is stored zero-padded
(``fq.codec.shape``), its stored dims must be those padded dims (anything else is refused), and the padded rows and
columns, which exllamav3 never lets reach the output (it zero-extends the input, trims the down projection's output,
and a gate/up output column it keeps is zero: fq's encoder gives the padded channels zero scales), are dropped.
``build_model`` hands that state to transformers
(``from_pretrained(None, state_dict=...)``: its own weight conversion fuses per-expert linears into 3-D parameters
where the architecture does), refuses missing, unexpected or mismatched keys, and reads the loaded model back through transformers' reverse conversion to check every
tensor equals the one handed over. The model config is the base's ``source_config.json`` (the source's, verbatim)
when it has one, else its ``config.json``; a ``quantization_config`` is dropped either way: the weights are dense.

    product_state(plan_path, public_key, *, root=None, now=None, state=None, min_version=None) -> ProductState
    adapter_state(base_dir, adapter, plan_path, public_key, *, root=None, now=None, state=None,
                  min_version=None) -> ProductState
    load_product(...) / load_adapter(...) -> LoadedProduct   # the same, built into a model
    build_model(config, tensors) -> transformers model (float32, eval mode)
    checkpoint_state(directory, sha256=None) -> (config, tensors)   # a source checkpoint (the reference)
"""
from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.provenance.assembly import PlanState, campaign_root
from fq.provenance.attest.fragment import verify_shard
from fq.core.canonical import loads
from fq.provenance.combine import Verified, narrow, verify_adapter, verify_fragments
from fq.errors import FqError
from fq.model.experts import ExpertLayout, suffixes
from fq.model.checkpoint_model import build_model, checkpoint_state, load_checkpoint, tensor_from  # noqa: F401
from fq.model import families
from fq.model.formats import dense_state, fuse_experts
from fq.provenance.manifest import VerifiedBase, read_verified  # noqa: F401  (fq.runtime.exl3 imports it from here)
from fq.provenance.product import VerifiedProduct, open_product
from fq.provenance.selection import parse_selection

if TYPE_CHECKING:
    import torch

CONFIG = "config.json"
SOURCE_CONFIG = "source_config.json"  # fq.provenance.exl3config: the source's config.json, verbatim; config.json adds quantization_config


@dataclass
class ProductState:
    """A verified product as tensors: what ``build_model`` loads."""

    product: str
    plan_sha256: str
    plan: dict  # the verified plan's predicate
    chain: list[str]
    config: dict
    tensors: dict  # name -> float32 tensor (skeleton verbatim, routed experts the chain's sum)
    layout: ExpertLayout
    stages: dict = field(default_factory=dict)  # (layer, expert) -> chain indices summed (0 = base)

    def expert_key(self, layer: int, expert: int, proj: str) -> str:
        return self.layout.key(layer, expert, proj, "weight")


@dataclass
class LoadedProduct:
    model: object
    state: ProductState


def check_tensor_file(base_dir: Path, name: str, base: VerifiedBase, plan: dict) -> str:
    """The kind ("skeleton", "expert" or "derived") of one tensor file of a verified base, which a runtime may load
    only if it is an attested shard and, for expert fragments, one of the plan's base fragments with the plan's
    digest, or a file the manifest declares derived (recomputed by ``verify_base``: gpt-oss's per-expert biases,
    which exllamav3 reads and fq's own runtime, holding the fused ones, does not)."""
    if any(d["name"] == name for d in base.manifest.derived):
        return "derived"
    att = base.shards.get(name)
    if att is None:
        raise FqError(f"{base_dir}/{name}: a tensor file without an attestation; a runtime loads attested shards only")
    if att.info.kind == "skeleton":
        return "skeleton"
    base_rel = plan["base"]["dir"] + "/"
    if att.info.kind == "linear":
        linears = {f["name"][len(base_rel):]: f["sha256"] for f in plan.get("linears", ())}
        if linears.get(name) != base.manifest.files[name][0]:
            raise FqError(f"{base_dir}/{name}: a linear fragment the plan does not name for its base")
        return "linear"
    want = {f["name"][len(base_rel):]: f["sha256"] for f in plan["fragments"] if f["node"] == plan["base"]["node"]}
    if want.get(name) != base.manifest.files[name][0]:
        raise FqError(f"{base_dir}/{name}: an expert fragment the plan does not name as a base fragment")
    return "expert"


def check_base_fragments(base_dir: Path, base: VerifiedBase, plan: dict) -> None:
    base_rel = plan["base"]["dir"] + "/"
    want = {f["name"][len(base_rel):] for f in plan["fragments"] if f["node"] == plan["base"]["node"]}
    want |= {f["name"][len(base_rel):] for f in plan.get("linears", ())}
    missing = sorted(want - set(base.manifest.files))
    if missing:
        raise FqError(f"{base_dir}: base fragments {missing} of the plan are not in the base")


def _base_tensors(base_dir: Path, base: VerifiedBase, plan: dict, layout: ExpertLayout) -> tuple[dict, dict, dict, dict]:
    """(config, skeleton tensors by name, base tensor sets by (layer, expert, proj), linear tensor sets by name ->
    (set, attested (out, in))) of a verified base. Every tensor file of the base must be an attested shard; its
    expert fragments must be the plan's base fragments, its linear fragments (a whole-model base) the plan's."""
    files = base.manifest.files
    name = SOURCE_CONFIG if SOURCE_CONFIG in files else CONFIG  # the source's own, verbatim, when the base keeps it
    if name not in files:
        raise FqError(f"{base_dir}: no {CONFIG} in its manifest; a base a runtime loads carries its model config")
    _, raw = read_verified(base_dir, name, *files[name])
    config = loads(raw, f"{base_dir}/{name}")
    if not isinstance(config, dict):
        raise FqError(f"{base_dir}/{name}: not a JSON object")
    skeleton: dict = {}
    sets: dict = {}
    linears: dict = {}
    for name in sorted(n for n in files if n.endswith(".safetensors")):
        kind = check_tensor_file(base_dir, name, base, plan)
        if kind == "derived":
            continue  # the skeleton's fused biases are what this runtime (transformers' module) reads
        header, data = read_verified(base_dir, name, *files[name])
        if kind == "linear":  # each linear's own (out, in): the shape its attestation names for the source weight
            shapes = {t["tensor"]: tuple(t["shape"]) for t in base.shards[name].predicate["source"].get("tensors", ())}
            for e in header.entries:  # every linear once, in the fragment of its class and layer: checked
                lin, _, suffix = e.name.rpartition(".")  # with the base as a model (fq.provenance.complete)
                if f"{lin}.weight" not in shapes:
                    raise FqError(f"{base_dir}/{name}: its attestation names no source weight {lin}.weight")
                entry = linears.setdefault(f"{lin}.weight", ({}, shapes[f"{lin}.weight"]))
                entry[0][suffix] = tensor_from(e.dtype, e.shape, data[e.start:e.end])
            continue
        if kind == "skeleton":
            for e in header.entries:  # each tensor once, no routed weight: fq.provenance.complete
                skeleton[e.name] = tensor_from(e.dtype, e.shape, data[e.start:e.end])
            continue
        for e in header.entries:
            layer, expert, proj, suffix = layout.parse(e.name)
            sets.setdefault((layer, expert, proj), {})[suffix] = tensor_from(e.dtype, e.shape, data[e.start:e.end])
    check_base_fragments(base_dir, base, plan)
    return config, skeleton, sets, linears


def stage_sets(v: Verified, chain: list[dict]) -> dict:
    """(layer, expert, proj) -> [(chain index, tensor set)] of the verified stage tensors, in chain order."""
    out: dict = {}
    for (layer, ex, i, proj, s), r in v.residual.items():
        out.setdefault((layer, ex, proj), {}).setdefault(i, {})[s] = tensor_from(r.dtype, r.shape, r.data)
    for (layer, ex, proj), by_index in out.items():
        for i, tset in by_index.items():
            if set(tset) != set(suffixes(chain[i]["codebook"])):
                raise FqError(f"layer {layer} expert {ex} {proj} stage {i}: incomplete tensor set")
    return {k: sorted(d.items()) for k, d in out.items()}


def stage_linear_sets(product: VerifiedProduct, public_key: Ed25519PublicKey) -> dict:
    """weight name (``{linear}.weight``) -> [(chain index, tensor set)] of the product's stages' residuals on
    non-expert linears (plan ``stage_linears``), in chain order: each fragment verified (attestation against the plan
    entry: bytes, node digest, parent edge) and its bytes read once, their sha256 the plan's."""
    plan, root = product.predicate, product.root
    index = {n["node"]: i for i, n in enumerate(plan["chain"])}
    out: dict = {}
    for f in plan.get("stage_linears", ()):
        where = f"{root / f['name']}"
        att = verify_shard(root, f["name"], public_key, plan["campaign"])
        product.check_stage_linear(att, f, where)
        header, data = read_verified(root, f["name"], f["sha256"], f["size"])
        product.check_header(att, header, f, where)
        sets: dict = {}
        for e in header.entries:
            lin, _, suffix = e.name.rpartition(".")
            sets.setdefault(f"{lin}.weight", {})[suffix] = tensor_from(e.dtype, e.shape, data[e.start:e.end])
        for name, tset in sets.items():
            if set(tset) != set(suffixes(f["codebook"])):
                raise FqError(f"{where}: {name[:-len('.weight')]}: incomplete tensor set {sorted(tset)}")
            out.setdefault(name, []).append((index[f["stage"]], tset))
    return out


def _state(product: VerifiedProduct, base_dir: Path, base: VerifiedBase, stage_sets: dict,
           stage_linears: dict | None = None) -> ProductState:
    from fq.codec import reconstruct_chain

    plan = product.predicate
    layout = ExpertLayout.from_json(plan["layout"], f"{product.plan.path}: layout")
    config, skeleton, base_sets, linears = _base_tensors(base_dir, base, plan, layout)
    tensors = dense_state(skeleton, f"{base_dir}: skeleton")  # FP8 tensors a base keeps verbatim, dequantized
    stage_linears = stage_linears or {}
    stray = sorted(set(stage_linears) - set(linears))
    if stray:
        raise FqError(f"{product.plan.path}: stage residuals on linears the base does not quantize: {stray[:3]}")
    for name, (tset, shape) in sorted(linears.items()):  # a whole-model base's quantized non-expert linears, plus
        # the chain's stage residuals on them (chain order): the sum, as for the routed experts
        tensors[name] = reconstruct_chain([tset] + [s for _, s in stage_linears.get(name, ())], name, shape)
    shapes = expert_shapes(config, layout, f"{base_dir}: the model config")
    stages: dict = {}
    for (layer, ex, proj), base_set in sorted(base_sets.items()):
        chain_sets = stage_sets.get((layer, ex, proj), [])
        name = layout.key(layer, ex, proj, "weight")
        chain = [layout.source(proj, s) for s in [base_set] + [s for _, s in chain_sets]]  # the source's units
        tensors[name] = reconstruct_chain(chain, name, shapes[proj])
        stages[(layer, ex)] = [0] + [i for i, _ in chain_sets]
    stray = sorted(set(stage_sets) - set(base_sets))
    if stray:
        raise FqError(f"stage tensors for linears the base does not have: {stray[:3]}")
    tensors = as_transformers_loads(tensors, config, layout, str(base_dir))
    return ProductState(plan["product"], product.plan.sha256, plan, [n["node"] for n in plan["chain"]], config, tensors,
                        layout, stages)


def as_transformers_loads(tensors: dict, config: dict, layout: ExpertLayout, where: str) -> dict:
    """A dense state whose routed experts are one matrix per expert (``layout``), as the family's transformers model
    loads it: the checkpoint's own fused tensors where its modeling reads only those (gpt-oss); else unchanged
    (Qwen3.5's per-expert names are fused by transformers' own conversion mapping on load)."""
    family = families.for_config(config, f"{where}/config.json")
    if family.fused_experts and family.fused_experts.runtime_fused:
        return fuse_experts(tensors, layout, family.fused_experts, where)
    return tensors


def expert_shapes(config: dict, layout: ExpertLayout, where: str) -> dict[str, tuple[int, int]]:
    """{the layout's projection name: the matrix's own (out, in)} of a routed expert, from the model config."""
    from fq.model.source import PROJECTIONS, config_expert_shapes

    own = config_expert_shapes(config, where)
    return {lp: own[p] for lp, p in zip(layout.projections, PROJECTIONS)}


def _all(plan: dict) -> tuple[list, list]:
    return narrow(plan, parse_selection("all"))


@dataclass
class VerifiedChain:
    """A product whose plan, whole base and every stage byte were verified: what a runtime builds from."""

    product: VerifiedProduct
    base_dir: Path
    base: VerifiedBase
    stage_sets: dict  # (layer, expert, proj) -> [(chain index, tensor set)], chain order
    stage_linears: dict = field(default_factory=dict)  # linear weight name -> [(chain index, tensor set)], chain order

    @property
    def plan(self) -> dict:
        return self.product.predicate

    def layout(self) -> ExpertLayout:
        return ExpertLayout.from_json(self.plan["layout"], f"{self.product.plan.path}: layout")


def verify_product(plan_path: str | os.PathLike, public_key: Ed25519PublicKey, *, root: str | os.PathLike | None = None,
                   now: dt.datetime | None = None, state: PlanState | None = None,
                   min_version: int | None = None) -> VerifiedChain:
    """(a): a published tree's product, every fragment and the whole base verified. The caller records the plan
    in ``state`` (``.product.record``) once it has used it."""
    product = open_product(plan_path, public_key, root=root, now=now, state=state, min_version=min_version)
    plan = product.predicate
    base_dir = product.root / plan["base"]["dir"]
    work, chosen = _all(plan)
    v = verify_fragments(product, public_key, work, chosen, base_dir=base_dir)
    return VerifiedChain(product, base_dir, v.base, stage_sets(v, plan["chain"]), stage_linear_sets(product, public_key))


def verify_adapter_product(base_dir: str | os.PathLike, adapter: str | os.PathLike, plan_path: str | os.PathLike,
                           public_key: Ed25519PublicKey, *, root: str | os.PathLike | None = None,
                           now: dt.datetime | None = None, state: PlanState | None = None,
                           min_version: int | None = None) -> VerifiedChain:
    """(b): a base checkpoint plus the adapter ``fq combine`` wrote from ``plan_path``; the plan, the whole base
    and every byte of the adapter verified. ``root``: where the plan's publication statement is looked for
    (default: the tree holding ``assemblies/``, or the plan's own directory when it is not in one)."""
    if root is None:
        try:
            root = campaign_root(plan_path)
        except FqError:
            root = Path(plan_path).parent
    product = open_product(plan_path, public_key, root=root, now=now, state=state, min_version=min_version)
    product.refuse_stage_linears("an fq combine adapter")
    plan = product.predicate
    work, chosen = _all(plan)
    base_node = plan["base"]["node"]
    v = verify_fragments(product, public_key, [(f, rs) for f, rs in work if f["node"] == base_node], chosen,
                         base_dir=base_dir)
    a = verify_adapter(adapter, product, v.geometry)
    return VerifiedChain(product, Path(base_dir), v.base, stage_sets(a, plan["chain"]))


def product_state(plan_path: str | os.PathLike, public_key: Ed25519PublicKey, *, state: PlanState | None = None,
                  **kw) -> ProductState:
    """(a), as dense float32 tensors."""
    vc = verify_product(plan_path, public_key, state=state, **kw)
    result = _state(vc.product, vc.base_dir, vc.base, vc.stage_sets, vc.stage_linears)
    vc.product.record(state)
    return result


def adapter_state(base_dir: str | os.PathLike, adapter: str | os.PathLike, plan_path: str | os.PathLike,
                  public_key: Ed25519PublicKey, *, state: PlanState | None = None, **kw) -> ProductState:
    """(b), as dense float32 tensors."""
    vc = verify_adapter_product(base_dir, adapter, plan_path, public_key, state=state, **kw)
    result = _state(vc.product, vc.base_dir, vc.base, vc.stage_sets)
    vc.product.record(state)
    return result


def load_product(plan_path, public_key, **kw) -> LoadedProduct:
    s = product_state(plan_path, public_key, **kw)
    return LoadedProduct(build_model(s.config, s.tensors), s)


def load_adapter(base_dir, adapter, plan_path, public_key, **kw) -> LoadedProduct:
    s = adapter_state(base_dir, adapter, plan_path, public_key, **kw)
    return LoadedProduct(build_model(s.config, s.tensors), s)
