"""A published one-base tree of a familykit checkpoint, written with fq's own writers and signers, without Snakemake.

The base node ``k2`` (K2 mul1) holds random but valid EXL3 tensor sets (``encode=True``: the codec's encodings of the
source's matrices) for every routed expert of the source (one block per MoE layer, named by the family's layout), the
source's skeleton shards verbatim (the tensors outside the routed experts, shard by shard, as the workflow's skeleton
jobs write them), ``source_config.json`` and the side files, and the derived files finalize writes
(``write_derived``: config.json, the tensor files the family needs, quantization_config.json); a signed base
manifest, the plan of the bare base and the publication statement (tests/kits/tree.py: fq's node digest and recipe
sha256 of the one-base recipe). A second or so on two cores (random sets): what a family's base looks like to every
consumer (verify, combine, the runtime) at the cost of no encode.

    publish(tmp, source_dir, layout=None, encode=False) -> Base(root, pub, plan, base_dir, derived, sets, layout, priv,
                                                                campaign)
    reference_tensors(base, source_dir) -> the source's float32 tensors with every routed expert the base's
                                           reconstruction (what fq's runtime must give transformers)

The sets are stored tensors: under a layout with stored scales (Laguna's routed up_proj times 2^-7) they reconstruct
the expert times 2^n, and the reference takes ``layout.source`` of each, as every consumer does. ``layout`` replaces
the family's (a base whose layout is not its family's, for a test that verify refuses it).
"""
from __future__ import annotations

import hashlib
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fq.model.source import PROJECTIONS, load_source
from fq.provenance.exl3config import SOURCE_CONFIG, write_derived
from fq.workflow.common import SIDE_FILES

from . import tree

NODE = {"node": "k2", "role": "base", "K": 2, "codebook": "mul1", "parent": None}
RECIPE = tree.recipe("bk", {"k2": NODE}, {"k2": ["k2"]})
SCALE = 0.02  # the sets' scale: reconstructed experts of about the source's magnitude (sign vectors +-sqrt)


@dataclass
class Base:
    root: Path
    pub: object
    plan: Path
    base_dir: Path
    derived: list
    sets: dict = field(default_factory=dict)  # (layer, expert, proj: gate/up/down) -> tensor set
    layout: object = None
    priv: object = None  # the signer's key (a test signs an export or an insider's manifest with it)
    campaign: dict = field(default_factory=dict)


def _encoded_sets(src, source_dir: Path, layer: int, layout) -> dict:
    """{(expert, layout projection): the codec's K2 mul1 weight-only encoding of the source's matrix}, stored as the
    layout stores it (one batched search per layer, seeded by position)."""
    from fq.codec import encode_batch
    from fq.workflow.encode import read_source

    refs = {str(e): {p: src.expert_source(layer, e, p, lambda s: str(source_dir / s)).to_json() for p in PROJECTIONS}
            for e in range(src.n_experts)}
    got = read_source(refs)
    keys = [(e, p) for e in range(src.n_experts) for p in PROJECTIONS]
    encoded = encode_batch([got[e][p] for e, p in keys], NODE["K"], NODE["codebook"], list(range(len(keys))), "cpu")
    return {(e, layout.projections[PROJECTIONS.index(p)]): layout.stored(layout.projections[PROJECTIONS.index(p)],
                                                                         enc.tensors)
            for (e, p), enc in zip(keys, encoded)}


def publish(tmp: Path, source_dir: Path, seed: int = 0, layout=None, encode: bool = False) -> Base:
    """``encode``: every set is the codec's K2 encoding of the source's expert (``_encoded_sets``, seconds per layer
    on two cores) rather than random, so the base's output is the source's within K2's error."""
    from safetensors import safe_open

    tmp, source_dir = Path(tmp), Path(source_dir)
    src = load_source(source_dir)
    layout = layout or src.family_entry.layout
    s = tree.signer(tmp / "signer")
    t = tree.Tree.create(tmp / "published", RECIPE, s, name="bk", repo="fq-test/kit", block_size=src.n_experts,
                         shards={sh: hashlib.sha256((source_dir / sh).read_bytes()).hexdigest() for sh in src.shards})
    root = t.root
    base = root / "base" / "k2"
    base.mkdir(parents=True)
    skeleton = set(src.skeleton_tensors)
    for shard in src.shards:
        with safe_open(str(source_dir / shard), "pt") as f:
            tensors = [(n, f.get_tensor(n)) for n in sorted(f.keys()) if n in skeleton]
        if tensors:
            t.skeleton("k2", shard, tensors)
    for side in SIDE_FILES:
        if (source_dir / side).is_file():
            shutil.copyfile(source_dir / side, base / (SOURCE_CONFIG if side == "config.json" else side))
    out = Base(root, s.pub, root / "assemblies" / "k2.assembly.intoto.jsonl", base, [], layout=layout, priv=s.priv,
               campaign=t.campaign)
    gen = torch.Generator().manual_seed(seed + 1)
    names = []
    for layer in src.moe_layers:
        experts = {}
        encoded = _encoded_sets(src, source_dir, layer, layout) if encode else {}
        for e in range(src.n_experts):
            experts[e] = {}
            for p, lp in zip(PROJECTIONS, layout.projections):
                o, i = src.expert_shape(p)
                tset = encoded[(e, lp)] if encode else tree.random_set(o, i, 2, "mul1", gen, sign=SCALE ** 0.5)
                experts[e][lp] = out.sets[(layer, e, p)] = tset
        scales = {"stored_scale_log2": layout.scales_json()} if layout.stored_scale_log2 else {}
        names.append(t.fragment("k2", layer, 0, experts, layout=layout, quant_args=scales))
    out.derived = write_derived(base, bits=2, codebook="mul1")
    t.manifest("k2", out.derived)
    t.plan("k2", ["k2"], names)
    t.publish()
    return out


def reference_tensors(base: Base, source_dir: Path) -> tuple[dict, dict]:
    """(config, tensors): the source checkpoint's, float32, with every routed expert replaced by the base's
    reconstruction of it under the family's per-expert names (transformers fuses them itself)."""
    from fq.codec import reconstruct_chain
    from fq.model.checkpoint_model import checkpoint_state

    config, tensors = checkpoint_state(source_dir)
    src = load_source(source_dir)
    for name in set(src.expert_names.values()):
        tensors.pop(name, None)
    for (layer, e, p), tset in base.sets.items():
        lp = base.layout.projections[PROJECTIONS.index(p)]
        name = base.layout.key(layer, e, lp, "weight")
        tensors[name] = reconstruct_chain([base.layout.source(lp, tset)], name)
    return config, tensors
