"""A campaign's comparison material for fq eval and the report, never published: the one-pass "native" encodes a
chain is compared with, and the weight-only twin of every calibrated fragment (calibration.compare_weight_only).
``Campaign.compare``."""
from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path

from fq.planning import native
from fq.planning.plan import Block, Fragment
from fq.core import kbits
from fq.errors import FqError
from fq.provenance.fragments import fragment_filename
from fq.workflow.specs import AncestorRef, NativeSpec, WeightOnlySpec


class Comparisons:
    def __init__(self, campaign):
        self.c = campaign  # fq.workflow.campaign.Campaign: what every job shares

    def native_metrics(self, K: int, codebook: str, block: Block) -> str:
        return self.c.p("native", f"K{K}-{codebook}", f"{self._block_name(block)}.json")

    def native_tensors(self, K: int, codebook: str, block: Block) -> str:
        """The one-pass encode's tensor sets (an unsigned fragment of node ``native_node(K, codebook)``), for
        fq eval."""
        return self.c.p("native", f"K{K}-{codebook}", f"{self._block_name(block)}.safetensors")

    def _block_name(self, block: Block) -> str:
        return f"layer{block.layer:03d}-block{self.c.block_index(block):03d}"

    @property
    def weight_only_jobs(self) -> tuple[Fragment, ...]:
        """The fragments that get a weight-only twin, in a calibrated campaign with calibration.compare_weight_only
        (comparison material for fq eval, like the natives: unsigned, never published): every one with ``true``,
        those of ``weight_only_nodes`` with a list; none otherwise."""
        nodes = self.weight_only_nodes  # a base sharing another's experts has that base's twin (twin_aliases)
        return tuple(f for f in self.c.encoded_fragments if nodes is None or f.node in nodes)

    @cached_property
    def weight_only_nodes(self) -> frozenset[str] | None:
        """The expert-encoding nodes whose fragments get twins: None for all (``true``), none for ``false``; for a list,
        each named node's chain (a stage's twin is taken against its ancestors' twins), through the base whose
        experts a base publishes (``Node.experts_from``)."""
        want = self.c.calib.settings and self.c.calib.settings["compare_weight_only"]
        if not want:
            return frozenset()
        if want is True:
            return None
        recipe = self.c.recipe
        names = [n.name for n in recipe.nodes]
        for name in want:
            if name not in names:
                raise FqError(f"calibration.compare_weight_only: no node {name!r} in recipe {recipe.name} (its nodes: "
                              f"{', '.join(names)})")
        return frozenset(recipe.expert_owner(n) for name in want for n in recipe.chain(name))

    @property
    def twin_aliases(self) -> dict[str, str]:
        """base -> the base whose weight-only twins are its own (it publishes that base's expert encoding)."""
        return {n.name: n.experts_from for n in self.c.recipe.nodes if n.experts_from}

    def weight_only_tensors(self, node: str, block: Block) -> str:
        """The twin's tensor sets: an unsigned fragment of node ``node`` (same layout and metadata as the real one);
        a base sharing another base's experts has that base's twin."""
        node = self.c.recipe.expert_owner(node)
        return self.c.p("weight-only", node, fragment_filename(node, block.layer, self.c.block_index(block)))

    def weight_only_metrics(self, node: str, block: Block) -> str:
        """The twin's metrics (written last: the job is done)."""
        node = self.c.recipe.expert_owner(node)
        return self.c.p("weight-only", node, f"{node}-layer{block.layer:03d}-block{self.c.block_index(block):03d}.json")

    def weight_only_needs_source(self, node: str, block: Block, _memo=None) -> bool:
        """True when this twin will be (re)encoded: an output missing, its metrics recording another definition of
        its node, older than an ancestor's twin, or an ancestor's twin will be re-encoded (as
        fragment_needs_source: the rule asks for the staged shards only then)."""
        return self.c._chain_needs(node, block, self._weight_only_stale, self.weight_only_tensors,
                                 {} if _memo is None else _memo)

    def _weight_only_stale(self, node: str, block: Block) -> bool:
        path, metrics = Path(self.weight_only_tensors(node, block)), Path(self.weight_only_metrics(node, block))
        if not path.is_file() or not metrics.is_file():
            return True
        try:
            return json.loads(metrics.read_bytes()).get("node_digest") != \
                self.c.recipe.node_digest(self.c.recipe.expert_owner(node))
        except (OSError, ValueError, AttributeError):
            return True

    @cached_property
    def native_bases(self) -> dict[str, str]:
        """product -> the published base it is compared with (``fq.planning.native``: the same bits, codebook and
        linear nodes, the chain's last node on every expert), for each chain that has one."""
        return native.native_bases(native.recipe_likes(self.c.recipe, self.c.plan.selections))

    @cached_property
    def native_jobs(self) -> dict[tuple[int, str], dict[Block, tuple[int, ...]]]:
        """One-pass encodes at each multi-node product's bits, over the experts its last node encodes,
        unless the recipe publishes a base it is compared with (``native_bases``: like with like):
        (K, codebook) -> {block: experts}. Only with compare_native; K above 8 has no one-pass counterpart."""
        if not self.c.config.get("compare_native"):
            return {}
        paired = self.native_bases
        want: dict[tuple[int, str], dict[Block, set[int]]] = {}
        for prod in self.c.recipe.products:
            chain = [self.c.recipe.node(n) for n in prod.chain]
            if len(chain) == 1 or prod.name in paired or any(not isinstance(n.K, int) for n in chain):
                continue  # a budgeted chain's K varies per unit: no one-pass counterpart
            bits, cb = sum(n.K for n in chain), chain[0].codebook
            if bits > 8:
                continue
            for f in self.c.fragments:
                if f.node == prod.chain[-1]:
                    want.setdefault((bits, cb), {}).setdefault(f.block, set()).update(f.experts)
        return {k: {b: tuple(sorted(e)) for b, e in sorted(v.items(), key=lambda kv: (kv[0].layer, kv[0].first_expert))}
                for k, v in sorted(want.items())}

    def native_spec(self, K: int, codebook: str, block: Block) -> NativeSpec:
        """A native job: the one-pass encode at ``K`` of the experts the compared chain's last node encodes."""
        c = self.c
        experts = tuple(self.native_jobs[(K, codebook)][block])
        return NativeSpec(K=K, codebook=codebook, layer=block.layer, block=c.block_index(block), experts=experts,
                          sources=c.expert_sources(block.layer, experts), layout=c.layout.to_json(),
                          hessian=c.calib.hessian_ref(block.layer))

    def weight_only_spec(self, node: str, block: Block) -> WeightOnlySpec:
        """A twin job: ``node``'s fragment of ``block`` encoded without its Hessian, against its ancestors' twins."""
        c = self.c
        f = c.fragment_of(node, block.layer, c.block_index(block))
        n = c.recipe.node(node)
        return WeightOnlySpec(node=node, role="base" if n.is_base else "stage", K=kbits.to_json(n.K_at(block.layer)),
                              codebook=n.codebook, node_digest=c.recipe.node_digest(node), layer=block.layer,
                              block=c.block_index(block), experts=tuple(f.experts),
                              sources=c.expert_sources(block.layer, f.experts),
                              ancestors=tuple(AncestorRef(node=a, codebook=c.recipe.node(a).codebook, digest=None,
                                                          path=self.weight_only_tensors(a, block))
                                              for a in c.ancestors(node)),
                              layout=c.layout.to_json())
