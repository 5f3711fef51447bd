"""A campaign as the workflow sees it: the validated config, the source model, the recipe, the plan,
and the path of every file target. Built at Snakefile parse time from metadata only (config.json and
the shard index), so ``snakemake -n`` lists every job before a byte of payload is fetched.

``Campaign`` holds what every job shares (identity, paths, the plan's blocks and fragments, the encode jobs and
whether each still needs its source, the skeleton, the committed files); each further concern's targets are one
object of its own module, reached through the campaign:

    C.calib     fq.workflow.campaign_calibration.CalibrationTargets   the calibration chain and its Hessians
    C.alloc     fq.workflow.campaign_allocation.AllocationTargets     budgeted bases: sensitivity and allocate
    C.linears   fq.workflow.campaign_linears.LinearTargets            whole-model bases: linear jobs, skeleton variants
    C.compare   fq.workflow.campaign_comparisons.Comparisons          natives and weight-only twins (for fq eval)
    C.evals     fq.workflow.campaign_eval.EvalTargets                 fq eval of every product
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fq.core import canonical, kbits
from fq.core.units import is_decimal
from fq.errors import FqError
from fq.model import families
from fq.model.experts import ExpertLayout
from fq.model.source import PROJECTIONS, SourceModel, load_source, parse_source
from fq.model.usage import ExpertUsage, load_usage, parse_usage
from fq.planning.plan import Block, Fragment, CampaignPlan, make_plan
from fq.planning.recipe import Recipe, load_recipe
from fq.provenance.fragments import attestation_name, fragment_filename
from fq.workflow.campaign_allocation import ALLOCATION_FILE, SENSITIVITY_FILE, AllocationTargets
from fq.workflow.campaign_calibration import CALIB_COLUMNS, CALIB_ROWS, CalibrationTargets, check_weighting
from fq.workflow.campaign_comparisons import Comparisons
from fq.workflow.campaign_eval import EvalTargets
from fq.workflow.campaign_linears import LinearTargets
from fq.workflow.specs import AncestorRef, BlockSpec, EncodeSpec, ShareSpec

SOURCE_KINDS = ("demo", "local", "hub")
__all__ = ["ALLOCATION_FILE", "CALIB_COLUMNS", "CALIB_ROWS", "SENSITIVITY_FILE", "SOURCE_KINDS", "USAGE_FILE",
           "Campaign", "LayerRule", "attested_node_digest", "campaign_plan", "is_encode_rule", "load_campaign",
           "load_campaign_json", "normalize_config"]


def is_encode_rule(name: str) -> bool:
    """Whether a Snakemake rule name is one of the encode rules (``encode``, or ``encode_layer``...: per_job)."""
    return name == "encode" or name == "encode_layer" or name.startswith("encode_layer_")


@dataclass(frozen=True)
class LayerRule:
    """One Snakemake rule of layer jobs: every (node, layer) in nodes x layers encodes exactly ``blocks``."""
    name: str
    nodes: tuple[str, ...]
    layers: tuple[int, ...]
    blocks: tuple[int, ...]


@dataclass(eq=False)
class Campaign:
    config: dict
    out: Path
    source: SourceModel
    recipe: Recipe
    usage: ExpertUsage | None
    plan: CampaignPlan
    # budgeted bases (recipe ``bits``): the fq-allocation/1 document they were resolved with; None with
    # ``allocation_pending`` while the campaign's own sensitivity/allocate jobs have not written it (the DAG's
    # targets are then the allocation alone: fq.planning.budget.resolve_budgets' provisional plan is never encoded)
    allocation: dict | None = None
    allocation_pending: bool = False

    # -- each concern's targets ------------------------------------------------------------------------------
    @cached_property
    def calib(self) -> CalibrationTargets:
        return CalibrationTargets(self)

    @cached_property
    def alloc(self) -> AllocationTargets:
        return AllocationTargets(self)

    @cached_property
    def linears(self) -> LinearTargets:
        return LinearTargets(self)

    @cached_property
    def compare(self) -> Comparisons:
        return Comparisons(self)

    @cached_property
    def evals(self) -> EvalTargets:
        return EvalTargets(self)

    # -- identity -----------------------------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.config["campaign"]

    @property
    def source_kind(self) -> str:
        return self.config["source"]["kind"]

    @property
    def source_dir(self) -> Path:
        """Where source shards are read from (demo: written by the demo_model rule; local: the checkpoint)."""
        if self.source_kind == "demo":
            return self.out / "demo-model"
        if self.source_kind == "local":
            return Path(self.config["source"]["path"])
        return self.out / "meta"

    @property
    def usage_file(self) -> str | None:
        """The expert-usage file this workflow measures (rule usage): the demo's, unless config names one."""
        if self.source_kind == "demo" and not self.config.get("usage"):
            return self.p(USAGE_FILE)
        return None

    def reads_usage(self, node: str) -> bool:
        """Whether ``node`` selects its experts from the usage statistics (a hot stage)."""
        return self.recipe.node(node).experts.mode == "hot"

    @property
    def source_repo(self) -> str:
        src = self.config["source"]
        if self.source_kind == "demo":
            return "fq-demo"
        return str(src.get("repo") or src["path"]) if self.source_kind == "local" else src["repo"]

    @cached_property
    def layout(self) -> ExpertLayout:
        return self.source.family_entry.layout

    # -- paths (relative to the working directory, as Snakemake wants them) --------------------------
    def p(self, *parts) -> str:
        return str(self.out.joinpath(*map(str, parts)))

    @property
    def campaign_json(self) -> str:
        return self.p("campaign.json")

    @property
    def plan_json(self) -> str:
        return self.p("plan.json")

    def staged(self, shard: str) -> str:
        return self.p("staging", shard)

    def staged_index(self, shard: str) -> str:
        """The staged shard's range index (fq.model.shard_index), written by its stage job."""
        return self.staged(shard) + ".ranges.json"

    def skeleton(self, shard: str) -> str:
        return self.p("skeleton", shard)

    def fragment(self, node: str, block: Block) -> str:
        return self.p("fragments", node, fragment_filename(node, block.layer, self.block_index(block)))

    def attestation(self, path: str) -> str:
        return str(Path(path).with_name(attestation_name(Path(path).name)))

    def metrics(self, node: str, block: Block) -> str:
        return self.p("metrics", node, f"{node}-layer{block.layer:03d}-block{self.block_index(block):03d}.json")

    # -- the OpenSSF model signature of each published base (fq.provenance.model_sig) ----------------------------
    @property
    def model_signing_key(self) -> str | None:
        """The ECDSA private key finalize signs each base's model.sig with: config model_signing_key (a path; false:
        none); null: the campaign's own (keys/model-signing.key, generated) when it generates its signer key too
        (signer_key null: the demo), none when the operator names the signer key."""
        value = self.config.get("model_signing_key")
        if value is False:
            return None
        if value:
            return str(value)
        return None if self.config.get("signer_key") else self.p("keys", "model-signing.key")

    def retired(self, window: int) -> str:
        return self.p("windows", f"window-{window}.retired")

    # -- plan lookups -------------------------------------------------------------------------------
    def block_index(self, block: Block) -> int:
        return block.first_expert // self.plan.block_size

    def block(self, layer: int, index: int) -> Block:
        for b in self.plan.blocks:
            if b.layer == layer and self.block_index(b) == index:
                return b
        raise FqError(f"campaign {self.name}: no block {index} in layer {layer}")

    @cached_property
    def fragments(self) -> tuple[Fragment, ...]:
        return self.plan.fragments()

    # -- bases sharing another base's expert encoding (recipe Node.experts_from) --------------------------------
    @cached_property
    def encoded_fragments(self) -> tuple[Fragment, ...]:
        """The fragments an encode job writes: all but those of bases that publish another base's encoding."""
        return tuple(f for f in self.fragments if not self.recipe.node(f.node).experts_from)

    @cached_property
    def shared_fragments(self) -> tuple[Fragment, ...]:
        """The fragments a share job writes (fq.workflow.share): a copy of the owner base's fragment of the block."""
        return tuple(f for f in self.fragments if self.recipe.node(f.node).experts_from)

    @property
    def shared_nodes(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.recipe.nodes if n.experts_from)

    @property
    def encoding_nodes(self) -> tuple[str, ...]:
        return tuple(n.name for n in self.recipe.encoding_nodes)

    def share_spec(self, node: str, layer: int, index: int) -> ShareSpec:
        """A share job's params: the base, the owner base whose committed fragment it copies, and the paths."""
        block = self.block(layer, index)
        owner = self.recipe.expert_owner(node)
        return ShareSpec(node=node, node_digest=self.recipe.node_digest(node), owner=owner,
                         owner_digest=self.recipe.node_digest(owner), layer=layer, block=index,
                         owner_fragment=self.fragment(owner, block), owner_metrics=self.metrics(owner, block),
                         layout=self.layout.to_json())

    def encode_spec(self, node: str, layer: int, fragment_paths) -> EncodeSpec:
        """What an encode job encodes: ``node``'s fragments of ``layer`` whose paths are among ``fragment_paths``
        (the job's outputs: one block, or the whole layer), each with its experts, sources and ancestors."""
        recipe_node = self.recipe.node(node)
        mine = {str(Path(p)) for p in fragment_paths}
        frags = [f for f in self.layer_fragments(node, layer) if str(Path(self.fragment(node, f.block))) in mine]
        blocks = tuple(BlockSpec(block=self.block_index(f.block), experts=tuple(f.experts),
                                 sources=self.expert_sources(f.block.layer, f.experts),
                                 ancestors=tuple(AncestorRef(node=a, codebook=self.recipe.node(a).codebook,
                                                             path=self.fragment(a, f.block),
                                                             digest=self.recipe.node_digest(a))
                                                 for a in self.ancestors(node)))
                       for f in frags)
        return EncodeSpec(node=node, role="base" if recipe_node.is_base else "stage",
                          K=kbits.to_json(recipe_node.K_at(layer)),  # per projection for a budgeted base
                          codebook=recipe_node.codebook, node_digest=self.recipe.node_digest(node), layer=layer,
                          blocks=blocks, layout=self.layout.to_json(), hessian=self.calib.hessian_ref(layer))

    def expert_inputs(self, node: str) -> tuple[str, ...]:
        """The nodes whose committed fragments ``node``'s fragment of a block is made from: its chain up to its
        parent, or the base whose encoding it publishes."""
        owner = self.recipe.node(node).experts_from
        return (owner,) if owner else self.ancestors(node)

    def fragment_of(self, node: str, layer: int, index: int) -> Fragment:
        for f in self.fragments:
            if f.node == node and f.block.layer == layer and self.block_index(f.block) == index:
                return f
        raise FqError(f"campaign {self.name}: node {node} has no fragment for layer {layer} block {index}")

    # -- layer jobs (encode.per_job: layer) ------------------------------------------------------------
    @property
    def per_job(self) -> str:
        return self.config.get("encode", {}).get("per_job") or "block"

    def layer_fragments(self, node: str, layer: int) -> tuple[Fragment, ...]:
        """``node``'s fragments in ``layer``, in block order: what one layer job encodes."""
        return self._layer_fragments.get((node, layer), ())

    @cached_property
    def _layer_fragments(self) -> dict[tuple[str, int], tuple[Fragment, ...]]:
        out: dict[tuple[str, int], list[Fragment]] = {}
        for f in self.encoded_fragments:
            out.setdefault((f.node, f.block.layer), []).append(f)
        return {k: tuple(sorted(v, key=lambda f: f.block.first_expert)) for k, v in out.items()}

    @cached_property
    def layer_rules(self) -> tuple[LayerRule, ...]:
        """The layer jobs, partitioned into the fewest Snakemake rules whose outputs can be written as patterns.

        A rule's outputs are fixed patterns in its wildcards ({node}, {layer}), so one rule can only serve
        (node, layer) pairs with the same block indices, and wildcard constraints are per wildcard, so the
        pairs it serves must be a full product nodes x layers. Nodes encoding every expert have every block
        of every layer: one rule, ``encode_layer``. A hot stage whose experts miss a block in some layer gets
        further rules (``encode_layer_2``, ...), one per (block set, layers) it has."""
        by_blocks: dict[tuple[int, ...], dict[str, list[int]]] = {}
        for (node, layer), frags in self._layer_fragments.items():
            blocks = tuple(self.block_index(f.block) for f in frags)
            by_blocks.setdefault(blocks, {}).setdefault(node, []).append(layer)
        order = {n["name"]: i for i, n in enumerate(self.plan.nodes)}  # topological
        rects = []
        for blocks, nodes in by_blocks.items():
            by_layers: dict[tuple[int, ...], list[str]] = {}
            for node, layers in nodes.items():
                by_layers.setdefault(tuple(sorted(layers)), []).append(node)
            for layers, ns in by_layers.items():
                rects.append((tuple(sorted(ns, key=lambda n: (order.get(n, 0), n))), layers, blocks))
        rects.sort(key=lambda r: (-len(r[0]) * len(r[1]), r[2], r[1], r[0]))
        return tuple(LayerRule("encode_layer" if i == 0 else f"encode_layer_{i + 1}", nodes, layers, blocks)
                     for i, (nodes, layers, blocks) in enumerate(rects))

    def layer_needs_source(self, node: str, layer: int) -> bool:
        """Whether the layer job of (node, layer) will encode, so it must ask for its staged shards: one of its
        blocks needs its source (fragment_needs_source), or Snakemake will rerun the job because an ancestor's
        fragment of any block of the layer is newer than the job's oldest output (its mtime trigger; a campaign
        begun with per_job: block can have a stage's block committed before its parent's next block)."""
        frags = self.layer_fragments(node, layer)
        memo: dict = {}
        if any(self.fragment_needs_source(node, f.block, memo) for f in frags):
            return True
        outs = [p for f in frags for p in (self.fragment(node, f.block), self.attestation(self.fragment(node, f.block)),
                                           self.metrics(node, f.block))]
        oldest = min(Path(p).stat().st_mtime for p in outs)
        return any(Path(self.fragment(a, f.block)).stat().st_mtime > oldest
                   for f in frags for a in self.ancestors(node))

    def ancestors(self, node: str) -> tuple[str, ...]:
        """The chain from the base to ``node``'s parent."""
        return tuple(self.recipe.chain(node)[:-1])

    def shard_window(self, shard: str) -> int:
        for w in self.plan.windows:
            if shard in w.stage:
                return w.index
        raise FqError(f"campaign {self.name}: shard {shard} is staged by no window")

    def shard_consumers_window(self, window: int) -> list[str]:
        """Every output that reads a shard staged or kept in ``window``: what its retirement waits for."""
        w = self.plan.windows[window]
        outs = [self.skeleton(s) for s in w.stage if s in self.skeleton_shards]
        outs += [self.fragment(f.node, f.block) for f in self.encoded_fragments if f.block.window == window]
        cmp = self.compare
        outs += [cmp.native_metrics(K, cb, b) for (K, cb), blocks in cmp.native_jobs.items() for b in blocks
                 if b.window == window]
        outs += [cmp.weight_only_metrics(f.node, f.block) for f in cmp.weight_only_jobs if f.block.window == window]
        if self.calib.settings:  # the chain's jobs that read a shard this window deletes
            outs += [self.calib.outputs(l)[-1] for l, ws in self.calib.windows.items() if window in ws]
        return outs

    @cached_property
    def skeleton_tensors(self) -> dict[str, tuple[str, ...]]:
        """Source shard -> its non-expert tensors (copied verbatim into the skeleton)."""
        out: dict[str, list[str]] = {}
        for t in self.source.skeleton_tensors:
            out.setdefault(self.source.weight_map[t], []).append(t)
        return {s: tuple(sorted(ts)) for s, ts in sorted(out.items())}

    @property
    def skeleton_shards(self) -> tuple[str, ...]:
        """Source shards that hold at least one non-expert tensor."""
        return tuple(self.skeleton_tensors)

    def expert_sources(self, layer: int, experts) -> dict:
        """{expert: {proj: fq.model.formats.ExpertSource as JSON}} (staged paths) for the encode job's params."""
        return {str(e): {p: self.source.expert_source(layer, e, p, self.staged).to_json() for p in PROJECTIONS}
                for e in experts}

    # -- does a job still need its source? ------------------------------------------------------------
    def fragment_needs_source(self, node: str, block: Block, _memo=None) -> bool:
        """True when this fragment will be (re)encoded: missing, or any of its three outputs (fragment,
        attestation, metrics) missing -- a job killed between two commits leaves the block incomplete, and
        Snakemake redoes it whole --, attested for another definition of its node, older than an
        ancestor's fragment, or an ancestor will be re-encoded. The encode rule asks for the staged shards
        only then, so deleting one fragment re-stages its shards without re-running the other jobs that
        read them (Snakemake would rerun every consumer of a re-created temp file otherwise)."""
        return self._chain_needs(node, block, self._fragment_stale, self.fragment, {} if _memo is None else _memo)

    def _fragment_stale(self, node: str, block: Block) -> bool:
        path = Path(self.fragment(node, block))
        att = Path(self.attestation(str(path)))
        return (not path.is_file() or not att.is_file() or not Path(self.metrics(node, block)).is_file()
                or attested_node_digest(att) != self.recipe.node_digest(node))

    def _chain_needs(self, node: str, block: Block, stale, tensors, memo: dict) -> bool:
        """Whether (node, block) will be (re)encoded: ``stale(node, block)`` (its own outputs missing or of another
        definition), or an ancestor will be, or an ancestor's ``tensors(node, block)`` file is newer than its own.
        Memoized per (node, layer, first expert) in ``memo``, shared along the recursion."""
        key = (node, block.layer, block.first_expert)
        if key in memo:
            return memo[key]
        needs = stale(node, block)
        if not needs:
            mtime = Path(tensors(node, block)).stat().st_mtime
            needs = any(self._chain_needs(anc, block, stale, tensors, memo)
                        or Path(tensors(anc, block)).stat().st_mtime > mtime for anc in self.expert_inputs(node))
        memo[key] = needs
        return needs

    def committed_files(self) -> list[str]:
        """Every fragment (with its attestation and metrics) and skeleton shard (with its attestation) the plan
        commits before finalize."""
        out = []
        for f in self.fragments:
            p = self.fragment(f.node, f.block)
            out += [p, self.attestation(p), self.metrics(f.node, f.block)]
        for s in self.skeleton_shards:
            out += [self.skeleton(s), self.attestation(self.skeleton(s))]
        return out + self.linears.files() + self.linears.variant_files()

    def missing_committed(self) -> list[str]:
        """Planned outputs that are absent although the campaign was finalized: deleted by hand, or lost.
        Snakemake does not rerun a finished job because an intermediate file vanished, so the Snakefile
        turns a non-empty list into a fresh input of finalize (a repair marker), which re-runs the jobs
        that produce the missing files, their descendants, and finalize itself."""
        expected = self.committed_files()
        cmp = self.compare
        for (K, cb), blocks in cmp.native_jobs.items():
            expected += [cmp.native_metrics(K, cb, b) for b in blocks] + [cmp.native_tensors(K, cb, b) for b in blocks]
        for f in cmp.weight_only_jobs:
            expected += [cmp.weight_only_tensors(f.node, f.block), cmp.weight_only_metrics(f.node, f.block)]
        expected += [self.p("published", "base", b.name, "fq-manifest.intoto.jsonl") for b in self.recipe.bases]
        return sorted(p for p in expected if not Path(p).is_file())


def attested_node_digest(att_path: Path) -> str | None:
    """The node digest an attestation line claims (unverified: used only to decide whether to redo work)."""
    try:
        env = json.loads(att_path.read_bytes())
        predicate = json.loads(base64.b64decode(env["payload"]))["predicate"]
        return predicate.get("node_digest")
    except (OSError, ValueError, KeyError, TypeError):
        return None


USAGE_FILE = "usage/expert_usage.json"  # the demo campaign's measured expert usage, under OUT (rule usage)


def _demo_source(out: Path) -> tuple[SourceModel, ExpertUsage]:
    """The demo checkpoint's metadata, and the expert usage its hot stages select from: what the usage rule
    measured (OUT/usage/expert_usage.json) once it has run; before that -- the DAG is planned before any job
    runs -- the usage recorded with the model (fq/data/demo/usage.json, measured the same way), which the usage
    rule checks its measurement against (fq.model.usage.measure_job: the same ranking of experts in every layer)."""
    from fq.model import demo_model

    config, index, sizes = demo_model.metadata()
    src = parse_source(config, index, sizes, origin="fq-demo", config_bytes=demo_model.files()["config.json"],
                       index_bytes=demo_model.files()["model.safetensors.index.json"])
    measured = out / USAGE_FILE
    if measured.is_file():
        return src, load_usage(measured)
    return src, parse_usage(demo_model.usage(), "expert usage recorded with the demo model (fq/data/demo/usage.json)")


def normalize_config(config: dict) -> dict:
    """Snakemake's --config passes nested values as strings ('encode={devices: [0]}' gives ['0']); turn
    digit strings back into the integers the schema asks for, before it is validated. In place."""
    def fix(v):
        return int(v) if is_decimal(v) else v

    enc = config.get("encode")
    if isinstance(enc, dict):
        for k in ("threads", "seed"):
            if k in enc:
                enc[k] = fix(enc[k])
        if isinstance(enc.get("devices"), list):
            enc["devices"] = [fix(d) for d in enc["devices"]]
    for k in ("block_size", "windows_on_disk", "disk_budget"):
        if k in config:
            config[k] = fix(config[k])
    if isinstance(config.get("eval"), dict):
        for k in ("tokens", "seq_len"):
            if k in config["eval"]:
                config["eval"][k] = fix(config["eval"][k])
    for k in ("calibration", "eval"):  # --config calibration=null arrives as the string 'null'
        if config.get(k) in ("null", "None", "none", ""):
            config[k] = None
    if isinstance(config.get("calibration"), dict):
        for k in ("rows", "columns"):
            if k in config["calibration"]:
                config["calibration"][k] = fix(config["calibration"][k])
    if isinstance(config.get("assembly"), dict) and "version" in config["assembly"]:
        config["assembly"]["version"] = fix(config["assembly"]["version"])
    return config


def load_campaign(config: dict) -> Campaign:
    """The campaign a (schema-validated) config describes. Pure but for reading metadata files."""
    src_cfg = config["source"]
    kind = src_cfg["kind"]
    usage = None
    if kind == "demo":
        source, usage = _demo_source(Path(config["out"]))
    elif kind == "local":
        source = load_source(src_cfg["path"], revision=src_cfg.get("revision"))
    elif kind == "hub":
        from fq.workflow.hub import load_persisted

        # the metadata init stored in the campaign for this repo@revision, else the hub (first run)
        source = (load_persisted(Path(config["out"]) / "meta", src_cfg["repo"], src_cfg.get("revision"))
                  or load_source(src_cfg["repo"], revision=src_cfg.get("revision")))
    else:
        raise FqError(f"config: source.kind: {kind!r}, expected one of {', '.join(SOURCE_KINDS)}")
    if config.get("usage"):
        usage = load_usage(config["usage"])
    if config.get("calibration"):  # refused when the config is read, not at the calib_embed job
        where = f"config calibration ({source.origin}/config.json)"
        families.check_calibration(source.family_entry, where)
        check_weighting(config["calibration"], source.family_entry, where)
    recipe = load_recipe(config["recipe"])
    recipe, allocation, pending = _budgets(config, recipe, source)
    plan = campaign_plan(config, recipe, source, usage, allocation)
    return Campaign(config, Path(config["out"]), source, recipe, usage, plan, allocation, pending)


def _budgets(config: dict, recipe, source):
    """(recipe resolved, the allocation document or None, whether it is pending): a budgeted base takes its K per unit
    from allocation.file, or from the campaign's own allocate job's output once it exists (until then: pending, a
    provisional resolution that plans the DAG's measurement phase)."""
    if not recipe.needs_allocation:
        return recipe, None, False
    from fq.allocation import document
    from fq.planning.budget import check_source, resolve_budgets

    given = (config.get("allocation") or {}).get("file")
    cal = config.get("calibration") or {}
    if not given and not cal.get("text") and config["source"]["kind"] != "demo":
        raise FqError(f"config calibration.text: recipe {recipe.source} has budgeted bases (bits), whose allocation the "
                      "campaign measures on the calibration text: name it (or an allocation.file made by fq allocate)")
    path = Path(given or Path(config["out"]) / ALLOCATION_FILE)
    if not path.is_file():
        if given:
            raise FqError(f"config allocation.file: {path} not found (an fq-allocation/1 file made by fq allocate)")
        if cal.get("tokens"):
            raise FqError("config allocation.file: the campaign's sensitivity job reads calibration text, and this "
                          "campaign names calibration.tokens: measure the allocation with fq allocate on the text "
                          "and name the file")
        if config["source"]["kind"] == "hub":
            raise FqError(f"config allocation.file: recipe {recipe.source} has budgeted bases; a hub source is not "
                          "on local disk for the campaign's sensitivity job: measure it with fq allocate where the "
                          "model is, and name the file")
        _check_streamable(recipe, source)
        return resolve_budgets(recipe, source, None), None, True
    doc = document.load(path)
    check_source(doc, source, str(path))
    return resolve_budgets(recipe, source, doc, str(path)), doc, False


def _check_streamable(recipe, source) -> None:
    """The sensitivity job streams the source one decoder layer at a time through the calibration chain's layer
    (fq.allocation.streamed): a family without a chain is refused at parse time, not at the job."""
    from fq.model import families

    family = families.by_name(source.family)
    if family.calibration is None:
        raise FqError(f"config allocation.file: recipe {recipe.source} has budgeted bases, whose sensitivity the "
                      f"campaign measures one decoder layer at a time with the calibration chain's layer, and "
                      f"{family.architectures[0]} ({family.title}) has no calibration chain: measure it in memory "
                      "with fq allocate and name the file")


def campaign_plan(config: dict, recipe, source, usage=None, allocation: dict | None = None):
    """The plan of a config's campaign. A ``disk_budget`` is shared, in a calibrated campaign, with the Hessians
    and the hidden states (fq.planning.calibration_cost.windows_budget, as fq plan and fq price count it)."""
    budget, cal = config.get("disk_budget"), config.get("calibration")
    if budget is not None and cal:
        from fq.planning.calibration_cost import price_calibration, windows_budget

        need = price_calibration(source, int(cal.get("rows", CALIB_ROWS)), int(cal.get("columns", CALIB_COLUMNS)),
                                 weighting=cal.get("weighting", "none"))
        budget = windows_budget(budget, need, "config disk_budget")
    from fq.allocation import document

    return make_plan(recipe, source, usage=usage, block_size=config["block_size"], windows=config.get("windows"),
                     disk_budget=budget, windows_on_disk=config["windows_on_disk"],
                     allow_unloadable=bool(config.get("allow_unloadable", False)),
                     allocation_sha256=document.sha256(allocation) if allocation is not None else None)


def load_campaign_json(path: str | os.PathLike) -> dict:
    return canonical.load(path)
