"""A published campaign of a real (tiny, random-init) transformers ``Glm4MoeForCausalLM``, for runtime tests.

The model is ../shared/EXL3-RUNTIME.md's tiny GLM-4-MoE config (vocab 512, hidden 256, 3 layers, layer 0 dense,
layers 1-2 MoE with 8 routed experts of 128, a shared expert), built by transformers from a seed. Nodes: base
``k2`` (K2 mul1), stage ``r1`` on k2 (K1 mul1, every expert), stage ``h2`` on r1 (K2 mcg, hot experts 1, 2, 5 of
each layer); products ``k2``, ``k2.r1``, ``k2.r1.h2``. The tensor sets are random valid EXL3 sets (encoding 96
linears would cost a minute), and the SOURCE checkpoint's routed experts are set to the full chain's sum
(``reconstruct_chain``), so the product ``k2.r1.h2`` is the source exactly and every shorter chain is an
approximation of it whose error shrinks with each stage.

``build(tmp, K={node: node spec})`` gives nodes other K (``fq.core.kbits`` node specs as JSON: K per layer and
projection, a budgeted base's or a stage's); the nodes' digests follow (fq's ``Recipe.node_digest`` of the kit's
recipe with those K: tests/kits/tree.py).

    ROOT/base/k2/{model.safetensors (skeleton), config.json, k2-layer00L-block00B.safetensors, fq-manifest...}
    ROOT/stages/{r1,h2}/..., ROOT/assemblies/*.assembly.intoto.jsonl, ROOT/publication.intoto.jsonl
    SOURCE/{config.json, model.safetensors (float32), tokenizer.json (byte-level BPE, 512 ids)}
    NATIVE/K5-mul1/layer00L-block00B.safetensors   (a one-pass comparison encode of h2's experts, random sets)
    TEXT/heldout.txt
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fq.codec import reconstruct_chain
from fq.core import kbits
from fq.model.experts import STANDARD
from fq.planning.recipe import Recipe
from fq.provenance.exl3config import SOURCE_CONFIG, specs as derived_specs, write_derived
from fq.provenance.fragments import fragment_filename, write_fragment

from . import tree

CONFIG = dict(vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128, num_hidden_layers=3,
              first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, head_dim=64,
              partial_rotary_factor=0.5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=1,
              topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0, num_nextn_predict_layers=0,
              hidden_act="silu", rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.1)
LAYERS = (1, 2)
N_EXPERTS = 8
BLOCK = 4
INTER = 128
DIMS = {"gate_proj": (INTER, 256), "up_proj": (INTER, 256), "down_proj": (256, INTER)}  # torch (out, in)
HOT = (1, 2, 5)
NODES = {
    "k2": {"node": "k2", "role": "base", "K": 2, "codebook": "mul1", "parent": None, "scale": 0.06},
    "r1": {"node": "r1", "role": "stage", "K": 1, "codebook": "mul1", "parent": "k2", "scale": 0.03},
    "h2": {"node": "h2", "role": "stage", "K": 2, "codebook": "mcg", "parent": "r1", "scale": 0.015},
}
PRODUCTS = {"k2": ["k2"], "k2.r1": ["k2", "r1"], "k2.r1.h2": ["k2", "r1", "h2"]}
SKELETON = "model.safetensors"


def recipe(nodes: dict | None = None) -> Recipe:
    """The kit's recipe (fq's own: tests/kits/tree.py); a node of ``nodes`` whose K differs from NODES' has it set
    after parsing, as a resolved budget's (the recipe's sha256 stays RECIPE_SHA256)."""
    K = {n: d["K"] for n, d in (nodes or {}).items() if d["K"] != NODES[n]["K"]}
    return tree.recipe("rt", NODES, PRODUCTS, experts={"h2": {layer: list(HOT) for layer in LAYERS}}, K=K)


RECIPE_SHA256 = recipe().sha256


def node_digest(node: str, nodes: dict | None = None) -> str:
    return recipe(nodes).node_digest(node)


def chain_entry(node: str, nodes: dict | None = None) -> dict:
    """A plan's chain entry for ``node`` (finalize's), under ``nodes`` (NODES with other K)."""
    return tree.chain_entry(recipe(nodes), node)


def k_at(K, layer: int, proj: str) -> int:
    """The K a node spec (JSON) gives one linear: its layer's, for its projection (STANDARD's names)."""
    return kbits.proj(kbits.node_at(K, layer), dict(zip(STANDARD.projections, kbits.PROJECTIONS))[proj])


def experts_of(node: str, block: int) -> list[int]:
    return [e for e in range(block * BLOCK, (block + 1) * BLOCK) if node != "h2" or e in HOT]


def node_dir(node: str) -> str:
    return f"base/{node}" if NODES[node]["role"] == "base" else f"stages/{node}"


def random_set(out_f: int, in_f: int, K: int, codebook: str, scale: float, gen: torch.Generator) -> dict:
    """tree.random_set whose reconstruction is of about ``scale`` times the codebook's (sign vectors +-sqrt)."""
    return tree.random_set(out_f, in_f, K, codebook, gen, sign=scale ** 0.5)


def model_config() -> dict:
    """config.json of the tiny model, as transformers 5.x writes it."""
    from transformers import Glm4MoeConfig

    cfg = Glm4MoeConfig(**CONFIG)
    cfg.architectures = ["Glm4MoeForCausalLM"]
    return json.loads(cfg.to_json_string())


def texts() -> tuple[str, str]:
    """(training text of the tokenizer, held-out text): Python's own sources, always there."""
    import inspect
    import json as j
    import textwrap

    return inspect.getsource(j.decoder) + inspect.getsource(j.encoder), inspect.getsource(textwrap)


def tokenizer_json() -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=CONFIG["vocab_size"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator([texts()[0]], trainer)
    return tok.to_str()


@dataclass
class Kit:
    root: Path
    source: Path
    pub_path: Path
    priv: object
    pub: object
    campaign: dict
    sets: dict = field(default_factory=dict)  # (node, layer, expert, proj) -> tensor set
    source_tensors: dict = field(default_factory=dict)
    native: Path | None = None
    native_sets: dict = field(default_factory=dict)  # (layer, expert, proj) -> K5 mul1 tensor set
    heldout: Path | None = None

    def plan(self, product: str) -> Path:
        return self.root / "assemblies" / f"{product}.assembly.intoto.jsonl"

    def frag(self, node: str, layer: int, block: int) -> str:
        return f"{node_dir(node)}/{fragment_filename(node, layer, block)}"

    @property
    def base_dir(self) -> Path:
        return self.root / "base" / "k2"

    def chain_sets(self, chain: list[str], layer: int, expert: int, proj: str) -> list[dict]:
        return [self.sets[(n, layer, expert, proj)] for n in chain if (n, layer, expert, proj) in self.sets]

    def chain_weight(self, chain: list[str], layer: int, expert: int, proj: str) -> torch.Tensor:
        """The product's weight of one linear, from the kit's own tensor sets (not from any file)."""
        return reconstruct_chain(self.chain_sets(chain, layer, expert, proj))


def _source_tensors(seed: int) -> dict:
    from transformers import Glm4MoeConfig, Glm4MoeForCausalLM
    from transformers.core_model_loading import revert_weight_conversion

    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(Glm4MoeConfig(**CONFIG))
    with torch.no_grad():
        return {k: v.detach().clone().contiguous() for k, v in revert_weight_conversion(model, model.state_dict()).items()}


def build(tmp: Path, seed: int = 0, K: dict | None = None) -> Kit:
    """``K``: {node: node spec as JSON} in place of NODES' K (the base's derived config takes its spec as bits)."""
    from safetensors.torch import save_file

    nodes = {n: {**d, "K": (K or {}).get(n, d["K"])} for n, d in NODES.items()}
    tmp = Path(tmp)
    s = tree.signer(tmp / "signer")
    t = tree.Tree.create(tmp / "campaign", recipe(nodes), s, name="rt", repo="fq-test/tiny-glm4moe",
                         block_size=BLOCK, shards={SKELETON: "2" * 64})
    kit = Kit(t.root, tmp / "source", s.pub_path, s.priv, s.pub, t.campaign)
    gen = torch.Generator().manual_seed(seed + 1)
    for node in NODES:
        for layer in LAYERS:
            for e in range(N_EXPERTS):
                if e not in experts_of(node, e // BLOCK):
                    continue
                for proj, (o, i) in DIMS.items():
                    n = nodes[node]
                    kit.sets[(node, layer, e, proj)] = random_set(o, i, k_at(n["K"], layer, proj), n["codebook"],
                                                                  n["scale"], gen)
    # the source: the transformers model's own tensors, its routed experts replaced by the full chain's sum
    tensors = _source_tensors(seed)
    for layer in LAYERS:
        for e in range(N_EXPERTS):
            for proj in DIMS:
                tensors[STANDARD.key(layer, e, proj, "weight")] = kit.chain_weight(list(NODES), layer, e, proj)
    kit.source_tensors = tensors
    kit.source.mkdir(parents=True)
    config = model_config()
    (kit.source / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(kit.source / "model.safetensors"), metadata={"format": "pt"})
    (kit.source / "tokenizer.json").write_text(tokenizer_json())
    kit.heldout = tmp / "text" / "heldout.txt"
    kit.heldout.parent.mkdir()
    kit.heldout.write_text(texts()[1])
    # the one-pass comparison of k2.r1.h2 (5 bits on h2's experts), as the campaign's native jobs write it
    kit.native = tmp / "native"
    for layer in LAYERS:
        for b in range(N_EXPERTS // BLOCK):
            experts = {}
            for e in experts_of("h2", b):
                experts[e] = {}
                for proj, (o, i) in DIMS.items():
                    kit.native_sets[(layer, e, proj)] = experts[e][proj] = random_set(o, i, 5, "mul1", 0.06, gen)
            write_fragment(kit.native / "K5-mul1" / f"layer{layer:03d}-block{b:03d}.safetensors", layout=STANDARD,
                           node="native-K5-mul1", role="base", layer=layer, block=b, K=5, codebook="mul1",
                           experts=experts)

    base = kit.base_dir
    t.skeleton("k2", SKELETON, [(k, v) for k, v in sorted(tensors.items()) if not STANDARD.is_routed_weight(k)])
    # config.json is derived from it (fq.provenance.exl3config)
    (base / SOURCE_CONFIG).write_text(json.dumps(config, indent=2))
    for node in nodes:
        for layer in LAYERS:
            for b in range(N_EXPERTS // BLOCK):
                t.fragment(node, layer, b, {e: {proj: kit.sets[(node, layer, e, proj)] for proj in DIMS}
                                            for e in experts_of(node, b)})
    write_derived(base, bits=nodes["k2"]["K"], codebook="mul1")
    t.manifest("k2", derived_specs(nodes["k2"]["K"], "mul1"))
    for product, chain in PRODUCTS.items():
        t.plan(product, chain, [kit.frag(n, layer, b) for n in chain for layer in LAYERS
                                for b in range(N_EXPERTS // BLOCK)])
    t.publish()
    return kit
