"""A campaign as the workflow sees it: the validated config, the source model, the recipe, the plan,
and the path of every file target. Built at Snakefile parse time from metadata only (config.json and
the shard index), so ``snakemake -n`` lists every job before a byte of payload is fetched.
"""
from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from fq.core import canonical
from fq.core.units import is_decimal
from fq.errors import FqError
from fq.hessian import store
from fq.model import families
from fq.model.experts import ExpertLayout
from fq.model.source import PROJECTIONS, SourceModel, load_source, parse_source
from fq.model.usage import ExpertUsage, load_usage, parse_usage
from fq.planning import native
from fq.planning.plan import Block, Fragment, Plan, make_plan
from fq.planning.recipe import Recipe, load_recipe
from fq.provenance.fragments import attestation_name, fragment_filename, linear_filename

SOURCE_KINDS = ("demo", "local", "hub")
CALIB_ROWS, CALIB_COLUMNS = 250, 2048  # calibration tokens per campaign by default (as exllamav3's converter)


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
    plan: Plan
    # budgeted bases (recipe ``bits``): the fq-allocation/1 document they were resolved with; None with
    # ``allocation_pending`` while the campaign's own sensitivity/allocate jobs have not written it (the DAG's
    # targets are then the allocation alone: fq.planning.budget.resolve_budgets' provisional plan is never encoded)
    allocation: dict | None = None
    allocation_pending: bool = False

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

    def skeleton(self, shard: str) -> str:
        return self.p("skeleton", shard)

    def fragment(self, node: str, block: Block) -> str:
        return self.p("fragments", node, fragment_filename(node, block.layer, self.block_index(block)))

    def attestation(self, path: str) -> str:
        return str(Path(path).with_name(attestation_name(Path(path).name)))

    def metrics(self, node: str, block: Block) -> str:
        return self.p("metrics", node, f"{node}-layer{block.layer:03d}-block{self.block_index(block):03d}.json")

    def native_metrics(self, K: int, codebook: str, block: Block) -> str:
        return self.p("native", f"K{K}-{codebook}", f"layer{block.layer:03d}-block{self.block_index(block):03d}.json")

    def native_tensors(self, K: int, codebook: str, block: Block) -> str:
        """The one-pass encode's tensor sets (an unsigned fragment of node ``native_node(K, codebook)``), for fq eval."""
        return self.p("native", f"K{K}-{codebook}", f"layer{block.layer:03d}-block{self.block_index(block):03d}.safetensors")

    # -- weight-only twins (calibration.compare_weight_only): each fragment encoded without its Hessian ----------
    @property
    def weight_only_jobs(self) -> tuple[Fragment, ...]:
        """The fragments that get a weight-only twin: every one, in a calibrated campaign with
        calibration.compare_weight_only (comparison material for fq eval, like the natives: unsigned, never
        published); none otherwise."""
        if not (self.calibration and self.calibration["compare_weight_only"]):
            return ()
        return self.encoded_fragments  # a base sharing another's experts has that base's twin (twin_aliases)

    @property
    def twin_aliases(self) -> dict[str, str]:
        """base -> the base whose weight-only twins are its own (it publishes that base's expert encoding)."""
        return {n.name: n.experts_from for n in self.recipe.nodes if n.experts_from}

    def weight_only_tensors(self, node: str, block: Block) -> str:
        """The twin's tensor sets: an unsigned fragment of node ``node`` (same layout and metadata as the real one);
        a base sharing another base's experts has that base's twin."""
        node = self.recipe.expert_owner(node)
        return self.p("weight-only", node, fragment_filename(node, block.layer, self.block_index(block)))

    def weight_only_metrics(self, node: str, block: Block) -> str:
        """The twin's metrics (written last: the job is done)."""
        node = self.recipe.expert_owner(node)
        return self.p("weight-only", node, f"{node}-layer{block.layer:03d}-block{self.block_index(block):03d}.json")

    def weight_only_needs_source(self, node: str, block: Block, _memo=None) -> bool:
        """True when this twin will be (re)encoded: an output missing, its metrics recording another definition of
        its node, older than an ancestor's twin, or an ancestor's twin will be re-encoded (as
        fragment_needs_source: the rule asks for the staged shards only then)."""
        return self._chain_needs(node, block, self._weight_only_stale, self.weight_only_tensors,
                                 {} if _memo is None else _memo)

    def _weight_only_stale(self, node: str, block: Block) -> bool:
        path, metrics = Path(self.weight_only_tensors(node, block)), Path(self.weight_only_metrics(node, block))
        if not path.is_file() or not metrics.is_file():
            return True
        try:
            return json.loads(metrics.read_bytes()).get("node_digest") != \
                self.recipe.node_digest(self.recipe.expert_owner(node))
        except (OSError, ValueError, AttributeError):
            return True

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

    # -- output-level evaluation (fq eval) -----------------------------------------------------------
    @property
    def eval_config(self) -> dict | None:
        """``eval:`` of the config (None: no eval job). It needs the source checkpoint on disk, and text."""
        cfg = self.config.get("eval")
        if not cfg:
            return None
        if self.source_kind == "hub":
            raise FqError("eval: needs the source checkpoint on local disk (source.kind demo or local); a hub source's "
                          "shards are staged per window and deleted: set eval: null, or run fq eval where it fits")
        if not cfg.get("text") and self.source_kind != "demo":
            raise FqError("eval.text: name a held-out text file (only the demo source brings its own)")
        return {"tokens": cfg.get("tokens", 4096), "seq_len": cfg.get("seq_len", 256), "text": cfg.get("text")}

    @property
    def eval_text(self) -> str:
        """The held-out text fq eval measures on: eval.text, or the demo's held-out split."""
        cfg = self.eval_config
        return cfg["text"] or self.p("demo-text", "heldout.txt")

    def eval_files(self) -> list[str]:
        return [self.p("eval", "eval.json"), self.p("eval", "eval.tsv")] if self.eval_config else []

    # -- calibration (issue 18): tokens -> embed -> layer by layer through the source, Hessians per MoE layer ----
    @cached_property
    def calibration(self) -> dict | None:
        """``calibration:`` of the config with its defaults (None: weight-only encoding, the attestations say so)."""
        cfg = self.config.get("calibration")
        if not cfg:
            return None
        text, tokens = cfg.get("text"), cfg.get("tokens")
        if text and tokens:
            raise FqError("calibration: name text or tokens, not both")
        if (text or tokens) and not cfg.get("sha256"):
            raise FqError(f"calibration.sha256: required with calibration.{'text' if text else 'tokens'} (the file's "
                          "sha256: the Hessians, and every fragment encoded against them, are bound to those bytes)")
        if not (text or tokens) and self.source_kind != "demo":
            raise FqError("calibration.text: name a calibration text (or calibration.tokens); only the demo source "
                          "brings its own")
        if text and self.source_kind == "hub":
            raise FqError("calibration.text: a hub source's tokenizer is not on disk; give calibration.tokens "
                          "(fq.hessian.calibration.save_tokens) instead")
        return {"text": text, "tokens": tokens, "sha256": cfg.get("sha256"), "rows": int(cfg.get("rows", CALIB_ROWS)),
                "columns": int(cfg.get("columns", CALIB_COLUMNS)), "capture": cfg.get("capture", "all-experts"),
                "compare_weight_only": bool(cfg.get("compare_weight_only", False))}

    # -- budgeted bases: the sensitivity and allocate jobs -------------------------------------------------------
    @property
    def allocation_config(self) -> dict:
        from fq.allocation.document import SENSITIVITY

        cfg = self.config.get("allocation") or {}
        return {"file": cfg.get("file"), **{k: int(cfg.get(k, v)) for k, v in SENSITIVITY.items()},
                "ks": self._allocation_ks(cfg.get("ks"))}

    def _allocation_ks(self, ks) -> list | None:
        """allocation.ks checked against the budgeted nodes' codebook (None: every K of it)."""
        if ks is None:
            return None
        from fq.allocation.error_model import candidate_ks

        cbs = {n.codebook for n in self.recipe.nodes if n.is_budgeted} or {"mul1"}
        have = set.intersection(*(set(candidate_ks(cb)) for cb in cbs)) | {16}
        out = sorted({int(k) if float(k).is_integer() else float(k) for k in ks})
        bad = [k for k in out if k not in have]
        if bad:
            raise FqError(f"config allocation.ks {ks!r}: {', '.join(map(str, bad))} not a candidate K of "
                          f"codebook {', '.join(sorted(cbs))} (1..8, 16 kept as published; mul1 also 1.5, 2.5, 3.5)")
        return out

    @property
    def measures_allocation(self) -> bool:
        """Whether this campaign measures its own allocation (budgeted bases and no allocation.file)."""
        return self.recipe.needs_allocation and not self.allocation_config["file"]

    @property
    def sensitivity_file(self) -> str:
        return self.p(SENSITIVITY_FILE)

    @property
    def allocation_file(self) -> str:
        return self.allocation_config["file"] or self.p(ALLOCATION_FILE)

    @property
    def sensitivity_text(self) -> str:
        """The text the sensitivity job measures on: the calibration text (the demo's split in a weight-only demo)."""
        return self.calibration_text if self.calibration else self.p("demo-text", "calibration.txt")

    @property
    def allocation_budgets(self) -> list[float]:
        return sorted({n.bits for n in self.recipe.budgeted})

    @property
    def calibration_text(self) -> str:
        return self.calibration["text"] or self.p("demo-text", "calibration.txt")

    @cached_property
    def calibrated_layers(self) -> tuple[int, ...]:
        """MoE layers whose fragments are encoded against a Hessian (next-token layers stay weight-only: the
        calibration chain runs the decoder stack, which they are not part of)."""
        if not self.calibration:
            return ()
        return tuple(l for l in self.source.moe_layers if l not in self.source.mtp_layers)

    @property
    def calibration_layers(self) -> tuple[int, ...]:
        """Every decoder layer the chain runs: 0 .. the last calibrated layer (every decoder layer when the head's
        Hessian is captured: it reads the last layer's output)."""
        if not self.calibrated_layers:
            return ()
        if None in self.linear_capture:
            return tuple(range(self.source.num_hidden_layers))
        last = max([*self.calibrated_layers, *(l for l in self.linear_capture if l is not None)])
        return tuple(range(last + 1))

    def calib_path(self, name: str) -> str:
        return self.p("calibration", name)

    @property
    def calib_tokens(self) -> str:
        return self.calib_path("tokens.safetensors")

    def calib_hidden(self, layer: int | None) -> str:
        """The hidden states entering layer ``layer + 1`` (None: the embeddings, entering layer 0)."""
        return self.calib_path("hidden-embed.safetensors" if layer is None else f"hidden-layer{layer:03d}.safetensors")

    def hessian(self, layer: int) -> str:
        return self.calib_path(store.file_name(layer))

    def hessian_binding(self, layer: int) -> str:
        return self.calib_path(f"hessian-layer{layer:03d}.bound.json")

    def linear_hessian(self, layer: int | None) -> str:
        """The input Hessians of a layer's (None: the head's) quantized non-expert linears (fq.hessian.linear_store)."""
        from fq.hessian.linear_store import linear_file_name

        return self.calib_path(linear_file_name(layer))

    def linear_hessian_binding(self, layer: int | None) -> str:
        return self.calib_path(Path(Path(self.linear_hessian(layer)).name).stem + ".bound.json")

    def head_norm_skeleton(self) -> list[str]:
        """The committed skeleton shard holding the final norm (what the head's calibration job reads)."""
        norm = self.layout.layers.removesuffix("layers.") + "norm.weight"
        if norm not in self.source.weight_map:
            raise FqError(f"campaign {self.name}: the source has no final norm {norm}; the head's Hessian needs it")
        return [self.skeleton(self.source.weight_map[norm])]

    @cached_property
    def linear_capture(self) -> dict[int | None, tuple[str, ...]]:
        """layer (None: the head) -> the quantized linears whose input Hessians its calibration job captures
        (calibrated campaigns with whole-model bases; every class any base quantizes)."""
        if not self.calibration:
            return {}
        out: dict = {}
        for node, layer in self.linear_jobs:
            out.setdefault(layer, set()).update(self.linear_names(node, layer))
        return {l: tuple(sorted(v)) for l, v in out.items()}

    @cached_property
    def _layer_tensor_shards(self) -> dict[int | None, tuple[str, ...]]:
        import re

        layout = self.layout  # model.layers.*, or a vision-language checkpoint's model.language_model.layers.*
        layer_re = re.compile(re.escape(layout.layers) + r"(\d+)\.")
        embed = layout.embed.removesuffix("weight")
        out: dict = {}
        for name, shard in self.source.weight_map.items():
            m = layer_re.match(name)
            if m:
                out.setdefault(int(m.group(1)), set()).add(shard)
            elif name.startswith(embed):
                out.setdefault(None, set()).add(shard)
        return {k: tuple(sorted(v)) for k, v in out.items()}

    def calib_shards(self, layer: int | None) -> tuple[str, ...]:
        """Source shards the chain's job for ``layer`` reads (None: the embedding job)."""
        shards = self._layer_tensor_shards.get(layer, ())
        if not shards:
            embed = self.layout.embed.removesuffix(".weight")
            raise FqError(f"campaign {self.name}: the source has no tensors for "
                          f"{embed if layer is None else f'layer {layer}'}")
        return shards

    def calib_record(self, layer: int | None) -> str:
        """The job's record (what it read and wrote, with digests): small, kept; what retirement waits for."""
        return self.calib_path("embed.json" if layer is None else f"layer{layer:03d}.json")

    def calib_outputs(self, layer: int | None) -> list[str]:
        """hidden (temp: the next job's input), the Hessian file (calibrated MoE layers), the linear Hessians (layers
        with quantized non-expert linears), the record."""
        hessian = [self.hessian(layer)] if layer is not None and layer in self.calibrated_layers else []
        if layer is not None and layer in self.linear_capture:
            hessian.append(self.linear_hessian(layer))
        return [self.calib_hidden(layer)] + hessian + [self.calib_record(layer)]

    def _retiring_window(self, shard: str) -> int:
        for w in self.plan.windows:
            if shard in w.retire:
                return w.index
        return self.shard_window(shard)

    @cached_property
    def calib_windows(self) -> dict:
        """Per chain job (None: embed), the windows that retire the shards it reads. Refuses a layout where a job
        would need a shard that is staged only after one it reads is retired (the chain could never run)."""
        out = {}
        W = self.plan.windows_on_disk
        for layer in (None,) + self.calibration_layers:
            shards = self.calib_shards(layer)
            staged = max(self.shard_window(s) for s in shards)
            retired = min(self._retiring_window(s) for s in shards)
            if staged - W >= retired:
                raise FqError(f"campaign {self.name}: calibration of {'the embeddings' if layer is None else f'layer {layer}'} "
                              f"reads shards {list(shards)} staged by windows {retired}..{staged}, more than "
                              f"windows_on_disk={W} apart; raise windows_on_disk or merge those windows")
            out[layer] = {self._retiring_window(s) for s in shards}
        return out

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

    def share_spec(self, node: str, layer: int, index: int) -> dict:
        """A share job's params: the base, the owner base whose committed fragment it copies, and the paths."""
        block = self.block(layer, index)
        owner = self.recipe.expert_owner(node)
        return {"node": node, "node_digest": self.recipe.node_digest(node), "owner": owner,
                "owner_digest": self.recipe.node_digest(owner), "layer": layer, "block": index,
                "owner_fragment": self.fragment(owner, block), "owner_metrics": self.metrics(owner, block),
                "layout": self.layout.to_json()}

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
        outs += [self.native_metrics(K, cb, b) for (K, cb), blocks in self.native_jobs.items() for b in blocks
                 if b.window == window]
        outs += [self.weight_only_metrics(f.node, f.block) for f in self.weight_only_jobs if f.block.window == window]
        if self.calibration:  # the chain's jobs that read a shard this window deletes
            outs += [self.calib_outputs(l)[-1] for l, ws in self.calib_windows.items() if window in ws]
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

    # -- whole-model bases: linear nodes and skeleton variants ---------------------------------------------------
    @property
    def linear_jobs(self) -> tuple[tuple[str, int | None], ...]:
        """(linear node, layer) of every linear fragment (None: the head): one job each."""
        return self.plan.linear_jobs()

    def linear_fragment(self, node: str, layer: int | None) -> str:
        return self.p("linears", node, linear_filename(node, layer))

    def linear_metrics(self, node: str, layer: int | None) -> str:
        return self.p("metrics", "linears", Path(linear_filename(node, layer)).stem + ".json")

    def linear_names(self, node: str, layer: int | None) -> tuple[str, ...]:
        """The linears (tensor prefixes) of one linear job."""
        return tuple(self.plan.linear(node)["layers"]["head" if layer is None else str(layer)])

    def linear_sources(self, node: str, layer: int | None) -> dict:
        """{linear: fq.model.formats.ExpertSource as JSON} read from the committed skeleton shards (verbatim copies of
        the source, attested): a linear job needs no staged shard, so it never holds a window open."""
        from fq.model.formats import SCALE_SUFFIX, ExpertSource

        out = {}
        for name in self.linear_names(node, layer):
            weight, scale = f"{name}.weight", f"{name}.{SCALE_SUFFIX}"
            shard = self.skeleton(self.source.weight_map[weight])
            if scale in self.source.weight_map:
                src = ExpertSource(shard, weight, None, self.skeleton(self.source.weight_map[scale]), scale,
                                   self.source.source_format.block)
            else:
                src = ExpertSource(shard, weight)
            out[name] = src.to_json()
        return out

    def linear_skeletons(self, node: str, layer: int | None) -> list[str]:
        """The committed skeleton shards a linear job reads."""
        refs = self.linear_sources(node, layer).values()
        return sorted({ref["shard"] for ref in refs} | {ref["scale_shard"] for ref in refs if "scale_shard" in ref})

    def linear_files(self) -> list[str]:
        """Every linear fragment with its attestation and metrics."""
        out = []
        for node, layer in self.linear_jobs:
            p = self.linear_fragment(node, layer)
            out += [p, self.attestation(p), self.linear_metrics(node, layer)]
        return out

    @staticmethod
    def variant_name(classes) -> str:
        """The skeleton variant of a base quantizing ``classes``: ``without-attention+head``."""
        return "without-" + "+".join(classes)

    def base_variant(self, base: str) -> str | None:
        """The skeleton variant a base publishes (None: the whole skeleton, as copied)."""
        node = self.recipe.node(base)
        return self.variant_name([c for c, _ in node.skeleton]) if node.skeleton else None

    @cached_property
    def skeleton_variants(self) -> dict[str, dict[str, tuple[str, ...]]]:
        """variant -> {source shard: the skeleton tensors it keeps} (shards left with nothing are omitted): the
        skeleton without the tensors a whole-model base replaces by its linear fragments."""
        from fq.model.linears import removed_tensors

        out = {}
        for base in self.recipe.bases:
            v = self.base_variant(base.name)
            if v is None or v in out:
                continue
            gone, have = set(), set(self.source.skeleton_tensors)
            for _, ln, layers in self.recipe.linear_assignments(base.name):
                for layer, names in self.plan.linear(ln.name)["layers"].items():
                    if layers is None or (None if layer == "head" else int(layer)) in layers:
                        for name in names:
                            gone.update(removed_tensors(name, have))
            out[v] = {s: kept for s, ts in self.skeleton_tensors.items() if (kept := tuple(t for t in ts if t not in gone))}
        return out

    def variant_skeleton(self, variant: str, shard: str) -> str:
        return self.p("skeleton", variant, shard)

    def base_skeletons(self, base: str) -> list[str]:
        """The committed skeleton shards a base publishes: the whole skeleton, or its variant's."""
        v = self.base_variant(base)
        if v is None:
            return [self.skeleton(s) for s in self.skeleton_shards]
        return [self.variant_skeleton(v, s) for s in self.skeleton_variants[v]]

    def base_linear_fragments(self, base: str) -> list[str]:
        """The linear fragments a whole-model base publishes (none for an experts-only base)."""
        if not self.recipe.node(base).is_base:
            raise FqError(f"recipe {self.recipe.source}: {base!r} is a stage, not a base")
        return self.node_linear_fragments(base)

    def node_linear_fragments(self, node: str) -> list[str]:
        """The linear fragments a node publishes: a whole-model base's quantized linears, or a stage's residuals on
        non-expert classes (recipe ``skeleton`` on a stage: published in its stage directory)."""
        out = []
        for _, ln, layers in self.recipe.linear_assignments(node):
            out += [self.linear_fragment(ln.name, layer) for n, layer in self.linear_jobs
                    if n == ln.name and (layers is None or layer in layers)]
        return out

    def linear_ancestors(self, node: str, layer: int | None) -> list[dict]:
        """The committed linear fragments a stage's residual on a class corrects, as its job reads them (base first):
        [{node, codebook, digest, path}]; empty for a base's linear node."""
        out, entry = [], self.plan.linear(node)
        while "parent" in entry:
            entry = self.plan.linear(entry["parent"])
            out.append({"node": entry["name"], "codebook": entry["codebook"], "digest": entry["digest"],
                        "path": self.linear_fragment(entry["name"], layer)})
        return out[::-1]

    def variant_files(self) -> list[str]:
        return [p for v, shards in self.skeleton_variants.items() for s in shards
                for p in (self.variant_skeleton(v, s), self.attestation(self.variant_skeleton(v, s)))]

    def expert_sources(self, layer: int, experts) -> dict:
        """{expert: {proj: fq.model.formats.ExpertSource as JSON}} (staged paths) for the encode job's params."""
        return {str(e): {p: self.source.expert_source(layer, e, p, self.staged).to_json() for p in PROJECTIONS}
                for e in experts}

    # -- native comparisons (report) ----------------------------------------------------------------
    @cached_property
    def native_bases(self) -> dict[str, str]:
        """product -> the published base it is compared with (``fq.planning.native``: the same bits, codebook and
        linear nodes, the chain's last node on every expert), for each chain that has one."""
        return native.native_bases(native.recipe_likes(self.recipe, self.plan.selections))

    @cached_property
    def native_jobs(self) -> dict[tuple[int, str], dict[Block, tuple[int, ...]]]:
        """One-pass encodes at each multi-node product's bits, over the experts its last node encodes,
        unless the recipe publishes a base it is compared with (``native_bases``: like with like):
        (K, codebook) -> {block: experts}. Only with compare_native; K above 8 has no one-pass counterpart."""
        if not self.config.get("compare_native"):
            return {}
        paired = self.native_bases
        want: dict[tuple[int, str], dict[Block, set[int]]] = {}
        for prod in self.recipe.products:
            chain = [self.recipe.node(n) for n in prod.chain]
            if len(chain) == 1 or prod.name in paired or any(not isinstance(n.K, int) for n in chain):
                continue  # a budgeted chain's K varies per unit: no one-pass counterpart
            bits, cb = sum(n.K for n in chain), chain[0].codebook
            if bits > 8:
                continue
            for f in self.fragments:
                if f.node == prod.chain[-1]:
                    want.setdefault((bits, cb), {}).setdefault(f.block, set()).update(f.experts)
        return {k: {b: tuple(sorted(e)) for b, e in sorted(v.items(), key=lambda kv: (kv[0].layer, kv[0].first_expert))}
                for k, v in sorted(want.items())}

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
        return out + self.linear_files() + self.variant_files()

    def missing_committed(self) -> list[str]:
        """Planned outputs that are absent although the campaign was finalized: deleted by hand, or lost.
        Snakemake does not rerun a finished job because an intermediate file vanished, so the Snakefile
        turns a non-empty list into a fresh input of finalize (a repair marker), which re-runs the jobs
        that produce the missing files, their descendants, and finalize itself."""
        expected = self.committed_files()
        for (K, cb), blocks in self.native_jobs.items():
            expected += [self.native_metrics(K, cb, b) for b in blocks] + [self.native_tensors(K, cb, b) for b in blocks]
        for f in self.weight_only_jobs:
            expected += [self.weight_only_tensors(f.node, f.block), self.weight_only_metrics(f.node, f.block)]
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
SENSITIVITY_FILE = "allocation/sensitivity.json"  # the units measured (rule sensitivity), under OUT
ALLOCATION_FILE = "allocation/allocation.json"  # the allocations solved from it (rule allocate): what plans read


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
        families.check_calibration(source.family_entry, f"config calibration ({source.origin}/config.json)")
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
        return resolve_budgets(recipe, source, None), None, True
    doc = document.load(path)
    check_source(doc, source, str(path))
    return resolve_budgets(recipe, source, doc, str(path)), doc, False


def campaign_plan(config: dict, recipe, source, usage=None, allocation: dict | None = None):
    """The plan of a config's campaign. A ``disk_budget`` is shared, in a calibrated campaign, with the Hessians
    and the hidden states (fq.planning.calibration_cost.windows_budget, as fq plan and fq price count it)."""
    budget, cal = config.get("disk_budget"), config.get("calibration")
    if budget is not None and cal:
        from fq.planning.calibration_cost import price_calibration, windows_budget

        need = price_calibration(source, int(cal.get("rows", CALIB_ROWS)), int(cal.get("columns", CALIB_COLUMNS)))
        budget = windows_budget(budget, need, "config disk_budget")
    from fq.allocation import document

    return make_plan(recipe, source, usage=usage, block_size=config["block_size"], windows=config.get("windows"),
                     disk_budget=budget, windows_on_disk=config["windows_on_disk"],
                     allow_unloadable=bool(config.get("allow_unloadable", False)),
                     allocation_sha256=document.sha256(allocation) if allocation is not None else None)


def load_campaign_json(path: str | os.PathLike) -> dict:
    return canonical.load(path)
