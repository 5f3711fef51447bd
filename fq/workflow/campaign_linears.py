"""A campaign's whole-model targets: the linear jobs of whole-model bases (and stages' residuals on non-expert
classes), their fragments, and the skeleton variants a whole-model base publishes without the linears it replaces
(docs/whole_model.md). ``Campaign.linears``."""
from __future__ import annotations

from functools import cached_property
from pathlib import Path

from fq.errors import FqError
from fq.provenance.fragments import linear_filename
from fq.workflow.specs import AncestorRef, LinearSpec


class LinearTargets:
    def __init__(self, campaign):
        self.c = campaign  # fq.workflow.campaign.Campaign: what every job shares

    @property
    def jobs(self) -> tuple[tuple[str, int | None], ...]:
        """(linear node, layer) of every linear fragment (None: the head): one job each."""
        return self.c.plan.linear_jobs()

    def fragment(self, node: str, layer: int | None) -> str:
        return self.c.p("linears", node, linear_filename(node, layer))

    def metrics(self, node: str, layer: int | None) -> str:
        return self.c.p("metrics", "linears", Path(linear_filename(node, layer)).stem + ".json")

    def names(self, node: str, layer: int | None) -> tuple[str, ...]:
        """The linears (tensor prefixes) of one linear job."""
        return tuple(self.c.plan.linear(node)["layers"]["head" if layer is None else str(layer)])

    def sources(self, node: str, layer: int | None) -> dict:
        """{linear: fq.model.formats.ExpertSource as JSON} read from the committed skeleton shards (verbatim copies of
        the source, attested): a linear job needs no staged shard, so it never holds a window open."""
        from fq.model.formats import SCALE_SUFFIX, ExpertSource

        out = {}
        for name in self.names(node, layer):
            weight, scale = f"{name}.weight", f"{name}.{SCALE_SUFFIX}"
            shard = self.c.skeleton(self.c.source.weight_map[weight])
            if scale in self.c.source.weight_map:
                src = ExpertSource(shard, weight, None, self.c.skeleton(self.c.source.weight_map[scale]), scale,
                                   self.c.source.source_format.block)
            else:
                src = ExpertSource(shard, weight)
            out[name] = src.to_json()
        return out

    def skeletons(self, node: str, layer: int | None) -> list[str]:
        """The committed skeleton shards a linear job reads."""
        refs = self.sources(node, layer).values()
        return sorted({ref["shard"] for ref in refs} | {ref["scale_shard"] for ref in refs if "scale_shard" in ref})

    def files(self) -> list[str]:
        """Every linear fragment with its attestation and metrics."""
        out = []
        for node, layer in self.jobs:
            p = self.fragment(node, layer)
            out += [p, self.c.attestation(p), self.metrics(node, layer)]
        return out

    @staticmethod
    def variant_name(classes) -> str:
        """The skeleton variant of a base quantizing ``classes``: ``without-attention+head``."""
        return "without-" + "+".join(classes)

    def base_variant(self, base: str) -> str | None:
        """The skeleton variant a base publishes (None: the whole skeleton, as copied)."""
        node = self.c.recipe.node(base)
        return self.variant_name([c for c, _ in node.skeleton]) if node.skeleton else None

    @cached_property
    def variants(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """variant -> {source shard: the skeleton tensors it keeps} (shards left with nothing are omitted): the
        skeleton without the tensors a whole-model base replaces by its linear fragments."""
        from fq.model.linears import removed_tensors

        out = {}
        for base in self.c.recipe.bases:
            v = self.base_variant(base.name)
            if v is None or v in out:
                continue
            gone, have = set(), set(self.c.source.skeleton_tensors)
            for _, ln, layers in self.c.recipe.linear_assignments(base.name):
                for layer, names in self.c.plan.linear(ln.name)["layers"].items():
                    if layers is None or (None if layer == "head" else int(layer)) in layers:
                        for name in names:
                            gone.update(removed_tensors(name, have))
            out[v] = {s: kept for s, ts in self.c.skeleton_tensors.items()
                      if (kept := tuple(t for t in ts if t not in gone))}
        return out

    def variant_skeleton(self, variant: str, shard: str) -> str:
        return self.c.p("skeleton", variant, shard)

    def base_skeletons(self, base: str) -> list[str]:
        """The committed skeleton shards a base publishes: the whole skeleton, or its variant's."""
        v = self.base_variant(base)
        if v is None:
            return [self.c.skeleton(s) for s in self.c.skeleton_shards]
        return [self.variant_skeleton(v, s) for s in self.variants[v]]

    def base_fragments(self, base: str) -> list[str]:
        """The linear fragments a whole-model base publishes (none for an experts-only base)."""
        if not self.c.recipe.node(base).is_base:
            raise FqError(f"recipe {self.c.recipe.source}: {base!r} is a stage, not a base")
        return self.node_fragments(base)

    def node_fragments(self, node: str) -> list[str]:
        """The linear fragments a node publishes: a whole-model base's quantized linears, or a stage's residuals on
        non-expert classes (recipe ``skeleton`` on a stage: published in its stage directory)."""
        out = []
        for _, ln, layers in self.c.recipe.linear_assignments(node):
            out += [self.fragment(ln.name, layer) for n, layer in self.jobs
                    if n == ln.name and (layers is None or layer in layers)]
        return out

    def ancestors(self, node: str, layer: int | None) -> list[dict]:
        """The committed linear fragments a stage's residual on a class corrects, as its job reads them (base first):
        [{node, codebook, digest, path}]; empty for a base's linear node."""
        out, entry = [], self.c.plan.linear(node)
        while "parent" in entry:
            entry = self.c.plan.linear(entry["parent"])
            out.append({"node": entry["name"], "codebook": entry["codebook"], "digest": entry["digest"],
                        "path": self.fragment(entry["name"], layer)})
        return out[::-1]

    def variant_files(self) -> list[str]:
        return [p for v, shards in self.variants.items() for s in shards
                for p in (self.variant_skeleton(v, s), self.c.attestation(self.variant_skeleton(v, s)))]

    def spec(self, node: str, layer: int | None) -> LinearSpec:
        """A linear job: ``node``'s linears of ``layer`` (None: the head), read from the committed skeleton, with
        its Hessian in a calibrated campaign and, for a stage's residual, the fragments it corrects."""
        ln = self.c.plan.linear(node)
        return LinearSpec(node=node, cls=ln["class"], K=ln["K"], codebook=ln["codebook"], node_digest=ln["digest"],
                          layer=layer, sources=self.sources(node, layer),
                          hessian=self.c.calib.linear_hessian_ref(layer),
                          ancestors=tuple(AncestorRef.from_json(a) for a in self.ancestors(node, layer)))
