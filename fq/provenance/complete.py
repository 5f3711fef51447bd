"""One completeness-and-consistency check of a product's base, which every consumer runs.

Signatures say who wrote a file; they do not say that the files together are a model. A tree re-signed by the
campaign's own key after a linear fragment was dropped, a bf16 weight left beside its quantized form, or a fragment
holding another layer's linears under its own labels verifies file by file. ``base_problems`` looks at the base as
one model, from verified headers and attestations only (no payload, no torch), and says what is wrong with it:

1. **Exactly once.** Every tensor lives in one file: no name in two skeleton shards, no linear in two linear
   fragments, no skeleton ``.weight`` (or FP8 scale) of a linear the base stores as EXL3, no routed-expert weight in
   the skeleton, no routed expert in two fragments of the base.
2. **Labels.** Every EXL3 linear of a linear fragment is, by its tensor name, of the class and layer its attestation
   names (``fq.model.linears.classify``), and its attested source tensors are exactly its linears' weights (and,
   from an FP8 source, their block scales); every
   linear fragment of the base is one the plan names; one fragment per (class, layer); fragments of one linear node
   attest one node digest.
3. **One objective per layer.** A layer's linear fragments all name the same Hessian (file and sha256) or none.
4. **The model the config describes** (its family read from the base's config, ``source_config.json`` else
   ``config.json``): the plan's layout stores the routed projections at the family's scales (``stored_scale_log2``,
   fq.model.experts: what its EXL3 runtime reads); every MoE layer holds every routed expert; every decoder layer
   0..num_hidden_layers-1 is there; the head (the family's: ``lm_head.weight``, DeepSeek-V4's ``head.weight``) is
   there unless the embeddings are tied; and layers of one kind (MoE or dense, and the config's ``layer_types`` entry
   where it has one, or the family's ``layer_kinds``: DeepSeek-V4's attention type and routing) hold the same tensors
   -- skeleton and EXL3 linears together, by name relative to the layer, with the same shapes -- so a layer missing a
   norm, its router or one projection is named.
5. **The index.** ``model.safetensors.index.json``, where the base has one, names exactly the tensors of the base's
   ``.safetensors`` files, each in the file that holds it.
6. **Shared expert encodings** (``experts_from``, given the tree's root): every fragment of the base node names the
   same owner or none, and the owner's fragment is in the tree, verifies, and holds the same expert bytes.

Callers: ``fq verify`` (each plan of a tree), ``fq.provenance.combine.verify_fragments`` with a base directory
(``fq combine --base``, fq's CPU runtime, its exllamav3 runtime, ``fq eval``, ``fq generate``) and the TP source
(``tp-export``, the TP store).

    BaseShard.from_attested(att) / BaseShard(name, predicate, entries)
    base_problems(plan, shards, *, files, read, where, root=None, public_key=None) -> [problem, ...]
    check_base(...)                                   # the same, raising FqError with every problem
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fq.core.canonical import loads
from fq.errors import FqError
from fq.model.experts import ExpertLayout
from fq.model.formats import SCALE_SUFFIX
from fq.model.linears import classify
from fq.provenance.product import check_linear_entry

CONFIG, SOURCE_CONFIG, INDEX = "config.json", "source_config.json", "model.safetensors.index.json"
COMPANIONS = (SCALE_SUFFIX, "weight_scale")  # FP8 block scales beside a weight (fq.model.linears)
MAX_LISTED = 4  # names listed in one problem line before "and N more"


@dataclass(frozen=True)
class BaseShard:
    """An attested ``.safetensors`` file of a base, as far as the check needs it: its verified attestation
    predicate and its header's tensors (name -> (dtype, shape))."""

    name: str  # relative to the base directory
    predicate: dict
    entries: dict
    sha256: str = ""  # the shard's, as its attestation signs it
    attestation_sha256: str = ""

    @classmethod
    def from_attested(cls, att) -> "BaseShard":
        return cls(att.name.rsplit("/", 1)[-1], att.predicate,
                   {e.name: (e.dtype, tuple(e.shape)) for e in att.info.header.entries}, att.sha256,
                   att.attestation_sha256)

    @property
    def kind(self) -> str:
        return self.predicate["kind"]


def headers_only(base_dir: Path, files: dict, derived: set, public_key, campaign: dict) -> list[BaseShard]:
    """The base's attested shards from their attestations and headers alone (no payload is read): what a consumer
    that reads only the ranges it needs (the TP source) checks. Each attestation and header must be the ones the
    base manifest lists and the attestation states."""
    from fq.core.safepath import open_regular
    from fq.model.shards import read_header
    from fq.provenance.attest.fragment import check_header, read_attestation
    from fq.provenance.fragments import attestation_name

    out = []
    for name, (digest, _) in sorted(files.items()):
        if not name.endswith(".safetensors") or name in derived:
            continue
        where = f"{base_dir}/{name}"
        att = read_attestation(base_dir, name, public_key, campaign)
        if att.attestation_sha256 != files.get(attestation_name(name), (None,))[0] or att.sha256 != digest:
            raise FqError(f"{where}: shard or attestation is not the one the base manifest lists")
        with open_regular(base_dir, name, where) as fh:
            header = read_header(fh, where)
        check_header(att, header, where)
        out.append(BaseShard(name, att.predicate, {e.name: (e.dtype, tuple(e.shape)) for e in header.entries},
                             att.sha256, att.attestation_sha256))
    return out


def check_published_base(plan: dict, root: Path, public_key) -> None:
    """The base a plan pins, in its tree, from headers and attestations only: for a consumer that does not read the
    base's payload (``fq combine`` without ``--base``, the TP source)."""
    from fq.provenance.manifest import read_base_manifest, read_verified

    base_dir = Path(root) / plan["base"]["dir"]
    manifest = read_base_manifest(base_dir, public_key, plan["campaign"])
    if manifest.sha256 != plan["base"]["manifest"]["sha256"]:
        raise FqError(f"{base_dir}: base manifest sha256 {manifest.sha256[:16]}… is not the one the plan pins")
    files = manifest.files
    shards = headers_only(base_dir, files, {d["name"] for d in manifest.derived}, public_key, plan["campaign"])
    check_base(plan, shards, files=files, read=lambda n: read_verified(base_dir, n, *files[n])[1],
               where=str(base_dir), root=Path(root), public_key=public_key)


def check_base(plan: dict, shards: list[BaseShard], **kw) -> None:
    problems = base_problems(plan, shards, **kw)
    if problems:
        raise FqError(problems[0] if len(problems) == 1 else
                      f"{len(problems)} problems: " + "; ".join(problems))


def base_problems(plan: dict, shards: list[BaseShard], *, files: dict, read: Callable[[str], bytes], where: str,
                  root: Path | None = None, public_key=None) -> list[str]:
    """``files``: the base manifest's {name: (sha256, size)}; ``read(name)``: a listed file's verified bytes;
    ``where``: the base directory as messages name it; ``root`` and ``public_key``: the tree the plan is in (the
    owner of a shared expert encoding is looked up there)."""
    out: list[str] = []
    layout = ExpertLayout.from_json(plan["layout"], "plan layout") if plan.get("layout") else None
    base_node = plan["base"]["node"]
    base_rel = plan["base"]["dir"] + "/"
    skeleton = [s for s in shards if s.kind == "skeleton"]
    linear = [s for s in shards if s.kind == "linear"]
    experts = [s for s in shards if s.kind == "expert" and s.predicate["node"] == base_node
               and f"{base_rel}{s.name}" in {f["name"] for f in plan["fragments"]}]
    model = _model(files, read, where, out)
    prefix = (layout.layers if layout else model["layers"] if model else "model.layers.")
    if model and layout is not None and layout.scales_json() != model["stored"]:
        out.append(f"{where}: the plan's layout stores the routed projections times 2^n for n = "
                   f"{layout.scales_json()}, the family's layout (as its EXL3 runtime reads them) {model['stored']}")

    tensors: dict[str, tuple[str, tuple]] = {}  # the base's model, by source name: skeleton tensors and EXL3 weights
    owner: dict[str, str] = {}  # tensor name -> file holding it
    for s in skeleton:
        for name, (dtype, shape) in s.entries.items():
            if name in owner:
                out.append(f"{where}/{s.name}: tensor {name} is also in {owner[name]}")
                continue
            if layout is not None and layout.is_routed_weight(name):
                out.append(f"{where}/{s.name}: a skeleton shard holds the routed-expert weight {name}")
            owner[name], tensors[name] = s.name, (dtype, shape)
    exl3: dict[str, str] = {}  # linear prefix -> fragment
    by_unit: dict[tuple, str] = {}
    node_digests: dict[str, dict[str, str]] = {}
    objectives: dict = {}
    plan_linears = {f["name"][len(base_rel):]: f for f in plan.get("linears", ())}
    moe = set(model["moe_layers"]) if model else {f["layer"] for f in plan["fragments"]}
    n_layers = model["n_layers"] if model else 1 << 30
    for s in linear:
        p = s.predicate
        at = f"{where}/{s.name}"
        if s.name not in plan_linears:
            out.append(f"{at}: a linear fragment the plan does not name for its base")
        else:
            try:  # the attestation, bytes and labels the plan names for it (what fq verify checks per plan)
                check_linear_entry(s, plan_linears[s.name], at)
            except FqError as e:
                out.append(str(e))
        unit = (p["class"], p["layer"])
        if unit in by_unit:
            out.append(f"{at}: a second linear fragment of {p['class']} {_unit(p['layer'])} (the first is "
                       f"{by_unit[unit]})")
        by_unit.setdefault(unit, s.name)
        node_digests.setdefault(p["node"], {}).setdefault(p["node_digest"], s.name)
        h = (p.get("quant_args") or {}).get("hessian")
        objectives.setdefault(p["layer"], {}).setdefault(
            "weight-only" if h is None else f"Hessian {h.get('file')} sha256 {str(h.get('sha256'))[:16]}…", s.name)
        mine = sorted({n.rpartition(".")[0] for n in s.entries})
        src = {t.get("tensor") for t in (p.get("source") or {}).get("tensors", ())}
        # each linear's weight, and beside it its block scales where the source is FP8 (read with the weight)
        weights = {n for n in src if isinstance(n, str) and n.rsplit(".", 1)[-1] not in COMPANIONS}
        scales_of_others = {n for n in src - weights if n.rpartition(".")[0] not in mine}
        if weights != {f"{lin}.weight" for lin in mine} or scales_of_others:
            out.append(f"{at}: attests source tensors {_names(src)}, its linears are {_names(mine)}")
        shapes = {t.get("tensor"): tuple(t.get("shape") or ()) for t in (p.get("source") or {}).get("tensors", ())}
        for lin in mine:
            got = classify(f"{lin}.weight", prefix, moe, n_layers)
            if got is None or (got.cls, got.layer) != unit:
                what = "no linear fq quantizes" if got is None else f"{got.cls} {_unit(got.layer)}"
                out.append(f"{at}: holds {lin}, which is {what}, under the labels {p['class']} {_unit(p['layer'])}")
            if lin in exl3:
                out.append(f"{at}: linear {lin} is also in {exl3[lin]}")
                continue
            exl3[lin] = s.name
            for c in ("weight", *COMPANIONS):
                if f"{lin}.{c}" in owner:
                    out.append(f"{where}/{owner[f'{lin}.{c}']}: {lin}.{c} is both a skeleton tensor and part of the "
                               f"EXL3 linear in {s.name}")
            tensors[f"{lin}.weight"] = ("EXL3", shapes.get(f"{lin}.weight", ()))
    for node, digests in sorted(node_digests.items()):
        if len(digests) > 1:
            out.append(f"{where}: linear node {node}'s fragments attest {len(digests)} node digests "
                       f"({'; '.join(f'{d[:16]}…: {n}' for d, n in sorted(digests.items()))})")
    claimed: dict[str, set] = {}
    for node, digests in node_digests.items():
        for d in digests:
            claimed.setdefault(d, set()).add(node)
    for d, nodes in sorted(claimed.items()):
        if len(nodes) > 1:
            out.append(f"{where}: linear node digest {d[:16]}… is attested by {len(nodes)} linear nodes "
                       f"({', '.join(sorted(nodes))}); a digest names one node's definition")
    for layer, objs in sorted(objectives.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
        if len(objs) > 1:
            out.append(f"{where}: the linear fragments of {_unit(layer)} were encoded against {len(objs)} objectives "
                       f"({'; '.join(f'{o}: {n}' for o, n in sorted(objs.items()))}); a layer binds one Hessian")
    out += _experts(experts, layout, model, where)
    if model is not None:
        out += _model_problems(tensors, model, where)
    out += _index(shards, files, read, where)
    if root is not None and public_key is not None:
        out += _shared(experts, plan, where, root, public_key)
        out += _stage_linears(plan, Path(root), public_key, exl3, prefix, moe, n_layers)
    return out


def _stage_linears(plan: dict, root: Path, public_key, exl3: dict, prefix: str, moe, n_layers: int) -> list[str]:
    """A stage's residuals on non-expert linears (plan ``stage_linears``) get the base's label checks: every linear of
    a residual fragment is of the class and layer it names, and exactly the linears of the base fragment it
    corrects (the base's EXL3 linears of that class and layer)."""
    from fq.core.safepath import open_regular
    from fq.model.shards import read_header
    from fq.provenance.attest.fragment import check_header, read_attestation

    out = []
    base_sets: dict[tuple, set] = {}
    for lin, frag in exl3.items():
        got = classify(f"{lin}.weight", prefix, moe, n_layers)
        if got is not None:
            base_sets.setdefault((got.cls, got.layer), set()).add(lin)
    for f in plan.get("stage_linears", ()):
        at = str(root / f["name"])
        try:
            att = read_attestation(root, f["name"], public_key, plan["campaign"], sha256=f["attestation_sha256"])
            with open_regular(root, f["name"], at) as fh:
                header = read_header(fh, at)
            check_header(att, header, at)
        except FqError:
            continue  # the file's own problem: every consumer reports it where it reads the residual
        mine = sorted({e.name.rpartition(".")[0] for e in header.entries})
        unit = (f["class"], f["layer"])
        for lin in mine:
            got = classify(f"{lin}.weight", prefix, moe, n_layers)
            if got is None or (got.cls, got.layer) != unit:
                what = "no linear fq quantizes" if got is None else f"{got.cls} {_unit(got.layer)}"
                out.append(f"{at}: holds {lin}, which is {what}, under the labels {f['class']} {_unit(f['layer'])}")
        want = base_sets.get(unit, set())
        if set(mine) != want:
            out.append(f"{at}: corrects {_names(mine)}, the base's {f['class']} {_unit(f['layer'])} fragment holds "
                       f"{_names(want)}")
    return out


def _unit(layer) -> str:
    return "the head" if layer is None else f"layer {layer}"


def _names(names) -> str:
    names = sorted(names)
    more = len(names) - MAX_LISTED
    return ", ".join(names[:MAX_LISTED]) + (f" and {more} more" if more > 0 else "") if names else "none"


def _model(files: dict, read, where: str, out: list) -> dict | None:
    """What the base's config says the model is; None (and a problem) when it has no readable config."""
    from fq.model import families
    from fq.model.families.base import read_int

    name = SOURCE_CONFIG if SOURCE_CONFIG in files else CONFIG if CONFIG in files else None
    if name is None:
        out.append(f"{where}: no {CONFIG} in its manifest; a base carries its model's config")
        return None
    cfg = f"{where}/{name}"
    try:
        config = loads(read(name), cfg)
        if not isinstance(config, dict):
            raise FqError(f"{cfg}: not a JSON object")
        family = families.for_config(config, cfg)
        view = family.text_view(config, cfg)
        n_layers = read_int(view, ("num_hidden_layers",), cfg, family.title)
        moe_layers = family.moe_layers(view, n_layers, cfg)
        n_experts = family.n_experts(view, cfg)
    except FqError as e:
        out.append(f"{where}: its model config cannot be read as a model ({e})")
        return None
    types = family.kinds(view, n_layers)  # the config's layer_types, or the family's (DeepSeek-V4's schedule)
    tied = bool(view.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    return {"n_layers": n_layers, "moe_layers": moe_layers, "n_experts": n_experts, "types": types, "tied": tied,
            "layers": family.layout.layers, "config": name, "head": family.head,
            "stored": family.layout.scales_json(),
            "experts_prefix": family.layout.prefix.split("{layer}", 1)[1].lstrip(".")}


def _experts(experts: list[BaseShard], layout, model: dict | None, where: str) -> list[str]:
    """Every routed expert of every MoE layer once in the base node's fragments."""
    out, seen = [], {}
    for s in experts:
        for e in s.predicate["experts"]:
            key = (s.predicate["layer"], e["expert"])
            if key in seen:
                out.append(f"{where}/{s.name}: layer {key[0]} expert {key[1]} is also in {seen[key]}")
            seen.setdefault(key, s.name)
    if model is None or layout is None:
        return out
    have = {}
    for layer, ex in seen:
        have.setdefault(layer, set()).add(ex)
    for layer in model["moe_layers"]:
        missing = sorted(set(range(model["n_experts"])) - have.get(layer, set()))
        if missing:
            out.append(f"{where}: MoE layer {layer} lacks routed expert(s) {_names(map(str, missing))} of the "
                       f"{model['n_experts']} its {model['config']} names")
    extra = sorted(set(have) - set(model["moe_layers"]))
    if extra:
        out.append(f"{where}: routed experts in layer(s) {', '.join(map(str, extra))}, which its {model['config']} "
                   f"does not make MoE")
    return out


def _model_problems(tensors: dict, model: dict, where: str) -> list[str]:
    """Decoder layers present, the head, and layers of one kind holding the same tensors of the same shapes."""
    import re

    out = []
    pat = re.compile(re.escape(model["layers"]) + r"(\d+)\.(.+)")
    per_layer: dict[int, dict] = {}
    for name, (dtype, shape) in tensors.items():
        m = pat.fullmatch(name)
        if not m or name.rsplit(".", 1)[-1] in COMPANIONS:
            continue
        per_layer.setdefault(int(m.group(1)), {})[m.group(2)] = shape
    n, moe = model["n_layers"], set(model["moe_layers"])
    absent = [l for l in range(n) if l not in per_layer]
    if absent:
        out.append(f"{where}: decoder layer(s) {_names(map(str, absent))} of the {n} its {model['config']} names "
                   f"hold no tensor")
    head = model["head"]
    if not model["tied"] and head not in tensors:
        out.append(f"{where}: no {head} (as skeleton or EXL3); its {model['config']} does not tie the embeddings")
    # the MoE block (``mlp``, Mixtral's ``block_sparse_moe``) differs between MoE and dense layers, whose MLP is
    # ``mlp`` (Kimi-Linear's too, beside its ``block_sparse_moe``); the rest of a layer (attention, norms) only between
    # the config's layer types
    blocks = {model["experts_prefix"].split(".")[0], "mlp"}
    parts: dict[tuple, dict[int, dict]] = {}
    for l in range(n):
        typ = model["types"][l] if model["types"] else None
        for rel, shape in per_layer.get(l, {}).items():
            key = ("MoE block" if l in moe else "MLP", typ) if rel.split(".")[0] in blocks else ("layer", typ)
            parts.setdefault(key, {}).setdefault(l, {})[rel] = shape
        for key in ((("MoE block" if l in moe else "MLP"), typ), ("layer", typ)):
            if l in per_layer:
                parts.setdefault(key, {}).setdefault(l, {})
    for (what, typ), layers in sorted(parts.items(), key=lambda kv: (min(kv[1]), kv[0][0])):
        if len(layers) < 2:
            continue
        counts = Counter(frozenset(v.items()) for v in layers.values())
        (usual, k), *rest = counts.most_common()
        if rest and rest[0][1] == k:  # no majority: every name any of them holds
            usual = {}
            for v in layers.values():
                for rel, shape in v.items():
                    usual.setdefault(rel, shape)
        ref = dict(usual)
        kind = what + (f" of the {typ} layers" if typ else "")
        for l, mine in sorted(layers.items()):
            if mine == ref:
                continue
            missing = sorted(set(ref) - set(mine))
            extra = sorted(set(mine) - set(ref))
            shaped = sorted(r for r in set(ref) & set(mine) if ref[r] != mine[r])
            why = ([f"lacks {_names(missing)}"] if missing else []) + ([f"has {_names(extra)} besides"] if extra else [])
            why += [f"{r} is {list(mine[r])}, not {list(ref[r])}" for r in shaped[:MAX_LISTED]]
            out.append(f"{where}: layer {l} holds other tensors than the other layers' ({kind}): {'; '.join(why)}")
    return out


def _index(shards: list[BaseShard], files: dict, read, where: str) -> list[str]:
    if INDEX not in files:
        return []
    at = f"{where}/{INDEX}"
    try:
        doc = loads(read(INDEX), at)
        wm = doc.get("weight_map") if isinstance(doc, dict) else None
        if not isinstance(wm, dict):
            raise FqError(f"{at}: no weight_map object")
    except FqError as e:
        return [str(e)]
    out = []
    held = {n: s.name for s in shards for n in s.entries}
    unattested = {n for n in files if n.endswith(".safetensors")} - {s.name for s in shards}
    for name, f in sorted(wm.items()):
        if f not in files:
            out.append(f"{at}: names {f!r} (for {name}), which the base does not hold")
        elif held.get(name) != f and f not in unattested:
            out.append(f"{at}: names {f} for {name}, which " +
                       (f"is in {held[name]}" if name in held else "no file of the base holds"))
    missing = sorted(n for n in held if n not in wm)
    if missing:
        out.append(f"{at}: does not name {_names(missing)} (in {held[missing[0]]})")
    return out


def _shared(experts: list[BaseShard], plan: dict, where: str, root: Path, public_key) -> list[str]:
    """``experts_from``: one owner for the node's fragments, and the owner's fragment in the tree with the same
    expert bytes."""
    from fq.provenance.attest.fragment import verify_shard

    owners = {s.name: s.predicate.get("experts_from") for s in experts}
    kinds = {None if o is None else o.get("node") for o in owners.values()}
    if len(kinds) > 1:
        listed = "; ".join(f"{n}: {o.get('node') if o else 'its own'}" for n, o in sorted(owners.items()))
        return [f"{where}: the base's fragments disagree on whose expert encoding they hold ({listed})"]
    out = []
    for name, src in sorted(owners.items()):
        if src is None:
            continue
        rel = f"base/{src['node']}/{src['name']}"
        at = f"{where}/{name}"
        if not (Path(root) / rel).is_file():
            out.append(f"{at}: holds the experts of {src['node']}'s {src['name']}, which the tree does not hold "
                       f"({rel}: no such file); a shared encoding is published with its owner")
            continue
        try:
            theirs = verify_shard(root, rel, public_key, plan["campaign"])
        except FqError as e:
            out.append(f"{at}: holds the experts of {rel}, which does not verify ({e})")
            continue
        mine = next(s for s in experts if s.name == name).predicate["experts"]
        if theirs.sha256 != src["sha256"] or theirs.predicate.get("kind") != "expert" or \
                theirs.predicate.get("node") != src["node"] or \
                [(e["expert"], e["sha256"]) for e in theirs.predicate["experts"]] != \
                [(e["expert"], e["sha256"]) for e in mine]:
            out.append(f"{at}: holds the experts of {rel} sha256 {src['sha256'][:16]}…, but that file is "
                       f"{theirs.sha256[:16]}… {'with other expert bytes ' if theirs.sha256 == src['sha256'] else ''}"
                       f"(shared encoding broken)")
    return out
