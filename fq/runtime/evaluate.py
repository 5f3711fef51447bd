"""``fq eval``: every product of a published campaign, and every one-pass ("native") comparison point the campaign
encoded, measured at the model's output against the SOURCE model on held-out text.

- Products: every product the tree's signed publication statement lists. The whole tree is verified first, as
  ``fq verify`` verifies it (every file against the statement both ways, every plan, fragment and base; the
  version state), and refused before the source or any product is loaded; then each product is loaded by
  ``fq.runtime.load``, which verifies the bytes it loads once more (nothing unverified runs).
- Native points: for a product of more than one node at B = the chain's K summed (B <= 8), the published base
  that differs from it in its routed experts alone (``fq.planning.native``: K = B, the same codebook, the chain's
  last node on every expert, the same linear nodes on every non-expert class; a product of its own, already
  measured: named in ``native``), else (B an integer: every node one K, ``fq.core.kbits.chain_bits``) the one-pass
  K=B encode of the experts the chain's last node covers (``NATIVE_DIR/K{B}-{codebook}/*.safetensors``, written by
  the campaign's native jobs: comparison material, never published or signed) in place of the chain on exactly
  those experts, the other experts keeping the product's weights: the same bits per weight on every expert, encoded
  in one pass instead of a chain. The model is the product's verified state with those experts replaced (its
  linears, stage residuals included, the product's own).
- Weight-only twins (a calibrated campaign with calibration.compare_weight_only): for every product P whose chain
  has twins (every product, or those over the nodes the setting names), "P (weight-only)": the same chain encoded
  without the Hessians (``WEIGHT_ONLY_DIR/<node>/*.safetensors``, unsigned fragments of the real nodes, a stage's
  residual taken against its parent's twin; comparison material, never published), its routed experts each the sum
  of the twins of the chain's nodes that cover it, the rest (the verified product's skeleton) unchanged. The
  product's row names it (``weight_only``) with the paired ``kl_minus_weight_only`` (negative: calibration helped).
- Source: the checkpoint directory (with ``source_sha256``, each shard is checked against the digest ``fq init``
  recorded before it is parsed); its ``tokenizer.json`` (``tokenizers``) turns the text into ids; the first
  ``tokens`` ids, in windows of ``seq_len``, are the measured positions (``fq.runtime.quality``).

Output (``fq-eval/1``, canonical JSON, and a TSV of the same rows): text and tokenizer digests, windows and
positions, the method, versions, the source's own perplexity, and per product / native point: chain, nominal and
effective bits per weight (the effective one weights each node's K by the share of experts it covers), KL (nats,
mean over positions, KL(source || model); ``kl_se`` its standard error over windows, ``kl_windows`` per window),
perplexity, top-1 agreement, mean NLL; for a product with a native comparison, ``kl_minus_native`` (its KL minus
the comparison's) and the standard error of that paired difference over windows. Deterministic (one thread,
fixed batches, exact sums): the same inputs give the same file, byte for byte, on one machine and build.

    evaluate(published, public_key, *, source, text, native_dir=None, weight_only_dir=None, source_sha256=None,
             tokens=4096, seq_len=256, out_json, out_tsv=None, progress=None, state=None) -> dict
"""
from __future__ import annotations

import os
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fq.core import atomic, canonical, kbits
from fq.core.canonical import sha256_hex
from fq.errors import FqError
from fq.model.experts import ExpertLayout

FORMAT = "fq-eval/1"
TSV_COLUMNS = ("name", "kind", "chain", "nominal_bpw", "effective_bpw", "kl", "kl_se", "ppl", "top1", "nll", "native",
               "kl_minus_native", "kl_minus_native_se", "weight_only", "kl_minus_weight_only",
               "kl_minus_weight_only_se")


def tokenize(source: Path, text: str) -> tuple[list[int], str]:
    """Token ids of ``text`` with the source checkpoint's ``tokenizer.json``; and that file's sha256."""
    from tokenizers import Tokenizer

    path = Path(source) / "tokenizer.json"
    if not path.is_file():
        raise FqError(f"{source}: no tokenizer.json; fq eval tokenizes the text with the source's tokenizer")
    data = path.read_bytes()
    return Tokenizer.from_str(data.decode("utf-8")).encode(text, add_special_tokens=False).ids, sha256_hex(data)


def effective_bpw(plan: dict) -> float:
    """Bits per weight over all routed experts: each chain node's K times the share of the base's experts it covers
    (a node with K per layer and projection: each covered expert at its layer's mean K, ``fq.core.kbits.bits``)."""
    covered: dict[str, set] = {}
    for f in plan["fragments"]:
        covered.setdefault(f["node"], set()).update((f["layer"], e["expert"]) for e in f["experts"])
    total = len(covered[plan["chain"][0]["node"]])
    out = 0
    for n in plan["chain"]:
        spec, cov = kbits.node(n["K"]), covered.get(n["node"], ())
        if kbits.is_one(spec):
            out += spec * len(cov) / total
        else:
            out += sum(kbits.bits(kbits.at_layer(spec, layer)) for layer, _ in sorted(cov)) / total
    return out


def _unsigned_sets(directory: Path | None, pattern: str, key) -> dict:
    """key(path, meta) -> {(layer, expert, proj): tensor set in the source's units} of the unsigned comparison
    fragments ``directory/pattern`` (structure validated by ``describe``); ``key`` names the group a file belongs to,
    or refuses the file."""
    from safetensors.torch import load_file

    from fq.provenance.fragments import describe

    out: dict = {}
    if directory is None or not Path(directory).is_dir():
        return out
    for path in sorted(Path(directory).glob(pattern)):
        with open(path, "rb") as fh:
            info = describe(fh, path.name, str(path))
        sets = out.setdefault(key(path, info), {})
        layout: ExpertLayout = info.meta["layout"]
        mine: dict = {}
        for name, t in load_file(str(path)).items():
            layer, expert, proj, suffix = layout.parse(name)
            mine.setdefault((layer, expert, proj), {})[suffix] = t
        # each set as it reconstructs the source's matrix (a stored scale undone: ExpertLayout.source)
        sets.update({k: layout.source(k[2], tset) for k, tset in mine.items()})
    return out


def native_sets(native_dir: Path | None) -> dict:
    """(K, codebook) -> {(layer, expert, proj): tensor set} of the one-pass encodes under ``native_dir``
    (``K{K}-{codebook}/*.safetensors``, fragments of node ``native-K{K}-{codebook}``, structure validated)."""
    def key(path, info):
        meta = info.meta
        if info.kind != "expert" or meta["node"] != f"native-K{meta['K']}-{meta['codebook']}" \
                or path.parent.name != f"K{meta['K']}-{meta['codebook']}":
            raise FqError(f"{path}: not a one-pass comparison encode of {path.parent.name}")
        return meta["K"], meta["codebook"]

    return _unsigned_sets(native_dir, "K*-*/*.safetensors", key)


def weight_only_sets(weight_only_dir: Path | None) -> dict:
    """node -> {(layer, expert, proj): tensor set} of the weight-only twins under ``weight_only_dir``
    (``<node>/*.safetensors``, unsigned fragments of node ``<node>``, structure validated)."""
    def key(path, info):
        if info.kind != "expert" or info.meta["node"] != path.parent.name:
            raise FqError(f"{path}: not a weight-only twin of node {path.parent.name}")
        return info.meta["node"]

    return _unsigned_sets(weight_only_dir, "*/*.safetensors", key)


def _row(q, **extra) -> dict:
    return {**extra, "kl": q.kl, "kl_se": q.kl_se, "ppl": q.ppl, "top1": q.top1, "nll": q.nll,
            "kl_windows": list(q.kl_windows)}


def evaluate(published: str | os.PathLike, public_key: Ed25519PublicKey, *, source: str | os.PathLike,
             text: str | os.PathLike, out_json: str | os.PathLike, native_dir: str | os.PathLike | None = None,
             weight_only_dir: str | os.PathLike | None = None,
             source_sha256: dict | None = None, tokens: int = 4096, seq_len: int = 256,
             out_tsv: str | os.PathLike | None = None, progress=None, state=None,
             twin_aliases: dict | None = None) -> dict:
    import torch
    import transformers

    from fq.planning.native import native_bases, plan_likes
    from fq.provenance.product import open_product
    from fq.provenance.publication import read_publication
    from fq.provenance.verify import verify_path
    from fq.runtime import quality
    from fq.runtime.load import build_model, load_checkpoint, product_state

    say = progress or (lambda msg: None)
    root = Path(published)
    report = verify_path(root, public_key, state=state)  # everything eval will load, before any forward pass
    if not report.ok:
        shown = "; ".join(report.problems[:5]) + (f"; … ({len(report.problems) - 5} more)" if len(report.problems) > 5
                                                    else "")
        raise FqError(f"{root}: refused before any forward pass ({len(report.problems)} problem(s); fq verify lists "
                      f"them all): {shown}")
    report.record(state)
    stmt = read_publication(root, public_key)
    products = stmt.predicate["products"]
    plans = {name: open_product(root / e["file"], public_key, root=root, state=state).predicate
             for name, e in products.items()}
    paired = native_bases(plan_likes(plans))  # chain -> the published base it is compared with, like with like
    natives = native_sets(Path(native_dir) if native_dir is not None else None)
    twins = weight_only_sets(Path(weight_only_dir) if weight_only_dir is not None else None)
    for alias, owner in (twin_aliases or {}).items():  # a base publishing another base's experts: that base's twins
        if owner in twins:
            twins.setdefault(alias, twins[owner])

    raw = Path(text).read_bytes()
    ids, tokenizer_sha256 = tokenize(Path(source), raw.decode("utf-8"))
    windows = quality.token_windows(ids, seq_len, tokens)
    ref = quality.Reference(load_checkpoint(source, source_sha256), windows)
    say(f"source: perplexity {ref.ppl:.4f} over {ref.positions} positions")

    rows: dict = {}
    native_rows: dict = {}
    twin_rows: dict = {}
    for name in sorted(products):
        loaded = product_state(root / products[name]["file"], public_key, root=root)  # its bytes verified as loaded
        plan = loaded.plan
        chain = plan["chain"]
        q = quality.compare(build_model(loaded.config, loaded.tensors), ref)
        bits, cb = kbits.chain_bits(n["K"] for n in chain), chain[0]["codebook"]
        row = rows[name] = _row(q, chain=[n["node"] for n in chain], nominal_bpw=bits,
                                effective_bpw=effective_bpw(plan), plan_sha256=loaded.plan_sha256, native=None)
        say(f"{name}: KL {q.kl:.6g}, perplexity {q.ppl:.4f}, top-1 {q.top1:.4f}")
        row["weight_only"] = None
        if twins and all(n["node"] in twins for n in chain):  # twins of named nodes only: the chains they cover
            tname = f"{name} (weight-only)"
            tq = quality.compare(build_model(loaded.config, _twin_tensors(loaded, plan, twins, weight_only_dir)), ref)
            twin_rows[tname] = _row(tq, product=name, chain=[n["node"] for n in chain], nominal_bpw=bits,
                                    effective_bpw=row["effective_bpw"])
            row["weight_only"] = tname
            say(f"{tname}: KL {tq.kl:.6g}, perplexity {tq.ppl:.4f}, top-1 {tq.top1:.4f}")
        if len(chain) == 1 or bits > 8:
            continue
        if name in paired:
            row["native"] = paired[name]
            continue
        if not isinstance(bits, int) or (bits, cb) not in natives:  # one-pass encodes are at one K
            continue
        tensors, experts = native_tensors(loaded, natives[(bits, cb)], native_dir)
        nq = quality.compare(build_model(loaded.config, tensors), ref)
        nname = f"native K{bits} {cb} for {name}"
        native_rows[nname] = _row(nq, product=name, K=bits, codebook=cb, experts=len(experts),
                                  chain=[n["node"] for n in chain[:-1]] + [f"native-K{bits}-{cb}"], nominal_bpw=bits,
                                  effective_bpw=row["effective_bpw"])
        row["native"] = nname
        say(f"{nname}: KL {nq.kl:.6g}, perplexity {nq.ppl:.4f}, top-1 {nq.top1:.4f}")
    for row in rows.values():  # paired on the same windows: the product's KL minus its native comparison's
        other = native_rows.get(row["native"]) or rows.get(row["native"])
        diff = [a - b for a, b in zip(row["kl_windows"], other["kl_windows"])] if other else []
        row["kl_minus_native"] = quality.mean(diff) if diff else None
        row["kl_minus_native_se"] = quality.standard_error(diff)
        twin = twin_rows.get(row["weight_only"])
        diff = [a - b for a, b in zip(row["kl_windows"], twin["kl_windows"])] if twin else []
        row["kl_minus_weight_only"] = quality.mean(diff) if diff else None
        row["kl_minus_weight_only_se"] = quality.standard_error(diff)

    doc = {"format": FORMAT, "campaign": stmt.predicate["campaign"], "publication_version": stmt.version,
           "publication_sha256": stmt.sha256,
           "text": {"file": Path(text).name, "sha256": sha256_hex(raw), "tokens": int(windows.numel()),
                    "seq_len": seq_len, "windows": int(windows.shape[0]), "positions": ref.positions},
           "tokenizer_sha256": tokenizer_sha256,
           "method": {"kl": "KL(source || model) of next-token distributions, nats, mean over positions",
                      "ppl": "exp(mean negative log-likelihood of the next token)",
                      "top1": "share of positions whose most likely next token is the source's",
                      "forward": "float32 on the CPU, log-softmax in float64, exact sums",
                      "threads": quality.THREADS, "batch": quality.BATCH},
           "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
           "source": {"nll": ref.nll, "ppl": ref.ppl},
           "products": rows, "native": native_rows, "weight_only": twin_rows}
    atomic.write_text(out_json, canonical.pretty(doc))
    if out_tsv is not None:
        write_tsv(doc, out_tsv)
    return doc


def table(doc: dict) -> list[dict]:
    """The rows of an fq-eval/1 document: products, native points, then weight-only twins, each with its name and
    kind."""
    out = [{"name": n, "kind": "product", **r} for n, r in sorted(doc["products"].items())]
    out += [{"name": n, "kind": "native", **r} for n, r in sorted(doc["native"].items())]
    return out + [{"name": n, "kind": "weight-only", **r} for n, r in sorted(doc.get("weight_only", {}).items())]


def native_tensors(state, sets: dict, where) -> tuple[dict, list]:
    """A native point's dense state: the product's verified ``state`` (every linear the product's own, stage residuals
    included) with each expert its chain's last node covers replaced by its one-pass encode (``sets``: (layer,
    expert, proj) -> tensor set); and those (layer, expert)."""
    from fq.codec import reconstruct
    from fq.runtime.load import expert_shapes

    chain = state.plan["chain"]
    bits, cb, last = kbits.chain_bits(n["K"] for n in chain), chain[0]["codebook"], chain[-1]["node"]
    experts = sorted((f["layer"], e["expert"]) for f in state.plan["fragments"] if f["node"] == last
                     for e in f["experts"])
    tensors = dict(state.tensors)
    shapes = expert_shapes(state.config, state.layout, state.product)
    for layer, expert in experts:
        for proj in state.layout.projections:
            tset = sets.get((layer, expert, proj))
            if tset is None:
                raise FqError(f"{where}: K{bits}-{cb} has no one-pass encode of layer {layer} expert {expert} "
                              f"{proj}, which {state.product}'s last node {last} covers")
            tensors[state.expert_key(layer, expert, proj)] = reconstruct(tset, f"native K{bits} {cb} {proj}",
                                                                         shapes[proj])
    return tensors, experts


def _twin_tensors(state, plan: dict, twins: dict, where) -> dict:
    """The product's verified dense state with every routed expert replaced by the sum of its chain's twins (the
    chain's nodes that cover the expert, base first), fused where the family's model loads fused experts."""
    from fq.codec import reconstruct_chain
    from fq.runtime.load import as_transformers_loads, expert_shapes

    shapes = expert_shapes(state.config, state.layout, str(where))
    covers: dict = {}
    for f in plan["fragments"]:
        for e in f["experts"]:
            covers.setdefault((f["layer"], e["expert"]), set()).add(f["node"])
    tensors = dict(state.tensors)  # gpt-oss: its fused experts, each overwritten below with the twins
    for (layer, expert), nodes in sorted(covers.items()):
        chain = [n["node"] for n in plan["chain"] if n["node"] in nodes]
        for proj in state.layout.projections:
            sets = []
            for node in chain:
                tset = twins.get(node, {}).get((layer, expert, proj))
                if tset is None:
                    raise FqError(f"{where}: no weight-only twin of node {node} for layer {layer} expert {expert} {proj}")
                sets.append(tset)
            tensors[state.expert_key(layer, expert, proj)] = reconstruct_chain(
                sets, f"weight-only {' > '.join(chain)} layer {layer} expert {expert} {proj}", shapes[proj])
    return as_transformers_loads(tensors, state.config, state.layout, str(where))


def write_tsv(doc: dict, path: str | os.PathLike) -> None:
    lines = ["\t".join(TSV_COLUMNS)]
    for r in table(doc):
        vals = []
        for k in TSV_COLUMNS:
            v = r.get(k)
            vals.append("" if v is None else " > ".join(v) if isinstance(v, list) else
                        f"{v:.6g}" if isinstance(v, float) else str(v))
        lines.append("\t".join(vals))
    atomic.write_text(path, "\n".join(lines) + "\n")
