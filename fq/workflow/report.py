"""Campaign report: relative MSE per product against bits per weight, a per-layer heatmap, each
product beside a one-pass ("native") encode at the same bits, and a table of products, sizes and digests. A chain's
native comparison is the published base that differs from it in its routed experts alone (``fq.planning.native``:
the same bits, codebook and linear nodes), else the campaign's one-pass encode of its last node's experts.

Quality comes from the metrics each encode job writes (per expert and projection: sum of squared
weights, sum of squared errors of the chain reconstruction up to that node). A product's error for an
expert is that of the deepest node of its chain that encodes the expert (a hot stage covers only
some experts; the others keep their parent's reconstruction).

With the eval job's ``fq-eval/1`` file (``fq eval``: each product measured at the model's output against the
source), the rows gain ``kl``, ``ppl``, ``top1`` and the native comparison's ``native_kl``/``native_top1``, and
``kl.png`` plots KL (and top-1 agreement) against effective bits per weight, native points beside; a calibrated
campaign with calibration.compare_weight_only adds each product's weight-only twin (``weight_only_kl``,
``weight_only_top1``: the same chain encoded without the Hessians), plotted beside it. Those numbers
are measurements, not signed claims: they stay in ``eval/eval.json`` and the report, never in
``campaign_summary.json`` (the signed publication statement's view, checked field by field by ``fq verify``).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from fq.core import atomic, canonical, kbits
from fq.workflow.campaign import Campaign


def _load_metrics(c: Campaign) -> dict:
    """node -> (layer, expert, proj) -> (sum_sq_w, sum_sq_err)."""
    out: dict = defaultdict(dict)
    for f in c.fragments:
        doc = canonical.load(c.metrics(f.node, f.block))
        for e, projs in doc["experts"].items():
            for p, m in projs.items():
                out[f.node][(f.block.layer, int(e), p)] = (m["sum_sq_w"], m["sum_sq_err"])
    for (K, cb), blocks in c.compare.native_jobs.items():
        for b in blocks:
            doc = canonical.load(c.compare.native_metrics(K, cb, b))
            for e, projs in doc["experts"].items():
                for p, m in projs.items():
                    out[f"native K{K} {cb}"][(b.layer, int(e), p)] = (m["sum_sq_w"], m["sum_sq_err"])
    return out


def product_errors(c: Campaign, metrics: dict, chain) -> dict:
    """(layer, expert, proj) -> (sum_sq_w, sum_sq_err) of a product: deepest covering node wins."""
    errs = {}
    for node in chain:  # base first, so deeper nodes overwrite
        errs.update(metrics[node])
    return errs


def _rel(errs: dict, keys=None) -> float:
    keys = errs.keys() if keys is None else keys
    w = sum(errs[k][0] for k in keys)
    e = sum(errs[k][1] for k in keys)
    return e / w if w > 0 else 0.0


def effective_bpw(c: Campaign, chain) -> float:
    """Bits per weight averaged over all experts: a node adds K for the share of experts it encodes (a budgeted base
    its K per layer and projection)."""
    total = len(c.plan.blocks) and sum(len(c.plan.experts_of(chain[0], l)) for l in c.source.moe_layers)
    bits = 0.0
    for n in chain:
        node = c.recipe.node(n)
        bits += sum(kbits.bits(node.K_at(l)) * len(c.plan.experts_of(n, l)) for l in c.source.moe_layers) / total
    return bits


def stored_bytes(c: Campaign, chain) -> int:
    """What a consumer of the product stores: its base's published directory (skeleton, quantized linears, expert
    fragments) and each stage's fragments."""
    pub = Path(c.p("published"))
    files = list((pub / "base" / chain[0]).glob("*.safetensors"))
    for n in chain[1:]:
        files += list((pub / "stages" / n).glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


def build_rows(c: Campaign, summary: dict) -> list[dict]:
    metrics = _load_metrics(c)
    paired = c.compare.native_bases  # chain -> the published base it is compared with, like with like (fq.planning.native)
    chains = {p.name: p.chain for p in c.recipe.products}
    # where a base runs: the family's exllamav3 class, or why none loads it (published with allow_unloadable)
    runtime = c.source.family_entry.exl3 if not c.source.exl3_problems else \
        "none: " + "; ".join(c.source.exl3_problems)
    rows = []
    for prod in c.recipe.products:
        chain = list(prod.chain)
        errs = product_errors(c, metrics, chain)
        last = set(metrics[chain[-1]])
        bits = c.recipe.product_bpw(prod)  # a float where a budgeted base's K varies per unit
        cb = c.recipe.node(chain[0]).codebook
        native_name = paired.get(prod.name)
        native_node = chains[native_name][0] if native_name else None  # the base's metrics are its node's
        if native_name is None and len(chain) > 1 and f"native K{bits} {cb}" in metrics:
            native_name = native_node = f"native K{bits} {cb}"
        native = _rel(metrics[native_node], sorted(last)) if native_name else None
        info = summary["products"].get(prod.name, {})
        planned = next((p for p in c.plan.products if p["name"] == prod.name), {})
        rows.append({
            "product": prod.name, "chain": " > ".join(chain), "nominal_bpw": bits,
            "effective_bpw": round(effective_bpw(c, chain), 4), "model_bpw": planned.get("model_bpw"),
            "stored_bytes": stored_bytes(c, chain), "rel_mse": _rel(errs),
            "rel_mse_last_experts": _rel(errs, sorted(last)),
            "native": native_name or "", "native_rel_mse": native,
            "vs_native": (_rel(errs, sorted(last)) / native) if native else None,
            "per_layer": {l: _rel(errs, [k for k in errs if k[0] == l]) for l in c.source.moe_layers},
            "bytes": info.get("bytes"), "assembly_sha256": info.get("sha256", ""), "exl3_runtime": runtime,
        })
    return rows


EVAL_FIELDS = ("kl", "ppl", "top1", "native_kl", "native_top1", "weight_only_kl", "weight_only_top1")


def add_eval(rows: list[dict], doc: dict | None) -> list[dict]:
    """Each row's output-level numbers from an fq-eval/1 document (None: the columns stay empty)."""
    for r in rows:
        e = (doc or {}).get("products", {}).get(r["product"])
        native = None
        if e is not None and e.get("native"):
            native = doc["native"].get(e["native"]) or doc["products"].get(e["native"])
        twin = (doc or {}).get("weight_only", {}).get(e.get("weight_only")) if e is not None else None
        r.update({"kl": e and e["kl"], "ppl": e and e["ppl"], "top1": e and e["top1"],
                  "native_kl": native and native["kl"], "native_top1": native and native["top1"],
                  "weight_only_kl": twin and twin["kl"], "weight_only_top1": twin and twin["top1"]})
    return rows


def write_table(rows: list[dict], path: str) -> None:
    cols = ["product", "chain", "nominal_bpw", "effective_bpw", "model_bpw", "rel_mse", "native", "native_rel_mse",
            "vs_native", "kl", "ppl", "top1", "native_kl", "native_top1", "weight_only_kl", "weight_only_top1", "bytes",
            "stored_bytes", "assembly_sha256", "exl3_runtime"]
    lines = ["\t".join(cols)]
    for r in rows:
        vals = []
        for k in cols:
            v = r[k]
            vals.append("" if v is None else (f"{v:.6g}" if isinstance(v, float) else str(v)))
        lines.append("\t".join(vals))
    atomic.write_text(path, "\n".join(lines) + "\n")


def plot_quality(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for r in rows:
        ax.scatter(r["effective_bpw"], r["rel_mse"], s=40, zorder=3)
        ax.annotate(r["product"], (r["effective_bpw"], r["rel_mse"]), textcoords="offset points", xytext=(5, 4), fontsize=8)
        if r["native_rel_mse"] is not None:
            ax.scatter(r["nominal_bpw"], r["native_rel_mse"], marker="x", color="gray", zorder=2)
            ax.annotate(f"{r['native']} on {r['product']}'s experts", (r["nominal_bpw"], r["native_rel_mse"]),
                        textcoords="offset points", xytext=(5, -10), fontsize=7, color="gray")
    ax.set_yscale("log")
    ax.set_xlabel("bits per weight (trellis, averaged over experts)")
    ax.set_ylabel("relative MSE of the expert weights")
    ax.set_title("Quality per product (x: one-pass encode at the same bits)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    plt.close(fig)


def plot_kl(doc: dict, path: str, stored: dict | None = None, whole=()) -> None:
    """KL against the source and top-1 agreement, per product, native point and weight-only twin, against effective
    bits per weight; with ``stored`` (product -> bytes a consumer stores), a third panel: each product's KL against
    its total bytes, whole-model bases beside experts-only ones (where bits buy the most)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fq.runtime.evaluate import table

    if stored:
        fig, (ax, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.5), dpi=120)
    else:
        fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.5), dpi=120)
    floor = min([r["kl"] for r in table(doc) if r["kl"] > 0] or [1e-6]) / 10  # KL 0 (the source itself) drawn here
    twins = False
    for r in table(doc):
        native, twin = r["kind"] == "native", r["kind"] == "weight-only"
        twins = twins or twin
        if native:
            style, label, color = {"marker": "x", "color": "gray", "zorder": 2}, \
                f"one-pass K{r['K']} on {r['product']}'s {r['experts']} experts", "gray"
        elif twin:
            style, label, color = {"marker": "^", "facecolors": "none", "edgecolors": "tab:orange", "s": 40,
                                   "zorder": 2}, r["name"], "tab:orange"
        else:
            style, label, color = {"s": 40, "zorder": 3}, r["name"], "black"
        for a, y in ((ax, max(r["kl"], floor)), (ax2, r["top1"])):
            a.scatter(r["effective_bpw"], y, **style)
            a.annotate(label, (r["effective_bpw"], y), textcoords="offset points",
                       xytext=(5, -10 if native or twin else 4), fontsize=8 if color == "black" else 7, color=color)
    if stored:
        for r in table(doc):
            if r["kind"] in ("native", "weight-only") or r["name"] not in stored:
                continue
            w = r["name"] in whole
            y = max(r["kl"], floor)
            ax3.scatter(stored[r["name"]] / 1e6, y, s=40, marker="s" if w else "o",
                        color="tab:blue" if w else "black", zorder=3)
            ax3.annotate(r["name"], (stored[r["name"]] / 1e6, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
        ax3.set_yscale("log")
        ax3.set_xlabel("stored MB (base dir + stages); squares: whole-model")
        ax3.set_ylabel("KL(source || product)")
        ax3.margins(x=0.3, y=0.1)
        ax3.grid(True, which="both", alpha=0.3)
    ax.set_yscale("log")
    ax.set_ylabel("KL(source || product), nats per token")
    ax2.set_ylabel("top-1 agreement with the source")
    for a in (ax, ax2):
        a.margins(x=0.45, y=0.1)
        a.set_xlabel("bits per weight (trellis, averaged over experts)")
        a.grid(True, which="both", alpha=0.3)
    t = doc["text"]
    twin_note = "; open triangles: the same chain weight-only (no Hessian)" if twins else ""
    fig.suptitle(f"Output quality on {t['positions']} held-out positions ({t['file']}); x: one-pass at the same bits"
                 + twin_note, fontsize=10 if twins else None)
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    plt.close(fig)


def plot_layers(rows: list[dict], layers, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    data = np.array([[r["per_layer"][l] for l in layers] for r in rows])
    fig, ax = plt.subplots(figsize=(max(4, 0.5 * len(layers) + 3), 0.45 * len(rows) + 1.5), dpi=120)
    im = ax.imshow(np.log10(np.maximum(data, 1e-12)), aspect="auto", cmap="viridis")
    ax.set_xticks(range(len(layers)), [str(l) for l in layers])
    ax.set_yticks(range(len(rows)), [r["product"] for r in rows])
    ax.set_xlabel("MoE layer")
    for i in range(len(rows)):
        for j in range(len(layers)):
            ax.text(j, i, f"{data[i, j]:.3g}", ha="center", va="center", fontsize=7, color="white")
    fig.colorbar(im, ax=ax, label="log10 relative MSE")
    ax.set_title("Relative MSE per product and layer")
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    plt.close(fig)


def plot_allocation(c: Campaign, path: str) -> None:
    """Each budgeted base's K per unit and layer (attention, dense MLP, shared expert, routed gate/up, routed down;
    the head in the title), and the experts each budgeted stage on it bought per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from fq.planning.budget import source_units

    bases = [n for n in c.recipe.budgeted if n.K is not None]
    units = source_units(c.source)
    layers = sorted({l for _, l in units.values() if l is not None})
    rows = ("attention", "dense", "shared", "gate/up", "down")
    fig, axes = plt.subplots(len(bases), 1, figsize=(max(5, 0.6 * len(layers) + 3), 2.6 * len(bases) + 0.6),
                             dpi=120, squeeze=False)
    for ax, n in zip(axes[:, 0], bases):
        skel = dict(n.skeleton)
        grid = np.full((len(rows), len(layers)), np.nan)
        for j, layer in enumerate(layers):
            for i, cls in enumerate(rows[:3]):
                v = skel.get(cls)
                k = v if kbits.is_one(v) else dict(v or ()).get(layer)
                if k is not None and f"L{layer}.{cls}" in units:
                    grid[i, j] = k
            if layer in c.source.moe_layers:
                spec = n.K_at(layer)
                grid[3, j], grid[4, j] = kbits.proj(spec, "gate"), kbits.proj(spec, "down")
        ax.imshow(grid, aspect="auto", cmap="viridis", vmin=1, vmax=8)
        for i in range(len(rows)):
            for j in range(len(layers)):
                if not np.isnan(grid[i, j]):
                    ax.text(j, i, f"K{int(grid[i, j])}", ha="center", va="center", fontsize=8, color="white")
        stages = [s for s in c.recipe.budgeted_stages if s.parent == n.name and s.experts.mode == "layers"]
        # under each layer: how many of its experts each budgeted stage bought
        ticks = [str(layer) + "".join(f"\n{s.name}: {len(s.experts.layer_map().get(layer, ()))}" for s in stages)
                 if layer in c.source.moe_layers else str(layer) for layer in layers]
        ax.set_xticks(range(len(layers)), ticks, fontsize=8)
        ax.set_yticks(range(len(rows)), rows)
        head = skel.get("head")
        ax.set_title(f"{n.name}: {n.bits:g} bits; head K{head if kbits.is_one(head) else dict(head or ())[None]}"
                     + "".join(f"; {s.name}: K{s.K} residual on {sum(len(e) for _, e in s.experts.layers)} experts"
                               for s in stages), fontsize=9)
        ax.set_xlabel("decoder layer")
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    plt.close(fig)


def load_proxy(c: Campaign) -> dict:
    """node -> proj -> layer -> [proxy error of each matrix] (calibrated fragments' metrics: tr(E H Eᵀ)/tr(W H Wᵀ))."""
    out: dict = {}
    for f in c.fragments:
        doc = canonical.load(c.metrics(f.node, f.block))
        for projs in doc["experts"].values():
            for p, m in projs.items():
                if m.get("proxy_err") is not None:
                    out.setdefault(f.node, {}).setdefault(p, {}).setdefault(f.block.layer, []).append(m["proxy_err"])
    return out


def plot_proxy(proxy: dict, path: str) -> None:
    """Proxy error per matrix of every calibrated node, by layer and projection: median (marker) and range (bar)."""
    import statistics

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    projs = sorted({p for by in proxy.values() for p in by})
    all_layers = sorted({l for by in proxy.values() for ls in by.values() for l in ls})
    fig, axes = plt.subplots(1, max(1, len(projs)), figsize=(4 * max(1, len(projs)) + 1, 4), dpi=120, sharey=True)
    axes = list(axes) if len(projs) > 1 else [axes]
    for ax, proj in zip(axes, projs):
        for i, (node, by) in enumerate(sorted(proxy.items())):
            layers = sorted(by.get(proj, {}))
            if not layers:
                continue
            med = [statistics.median(by[proj][l]) for l in layers]
            lo = [med[k] - min(by[proj][l]) for k, l in enumerate(layers)]
            hi = [max(by[proj][l]) - med[k] for k, l in enumerate(layers)]
            x = [l + 0.08 * (i - len(proxy) / 2) for l in layers]
            ax.errorbar(x, med, yerr=[lo, hi], fmt="o", capsize=3, label=node)
        ax.set_yscale("log")
        ax.set_xticks(all_layers, [str(l) for l in all_layers])
        ax.set_xlabel("MoE layer")
        ax.set_title(proj)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("proxy error tr(E H Eᵀ) / tr(W H Wᵀ)")
    axes[-1].legend(fontsize=7)
    fig.suptitle("Calibrated encodes: proxy error per matrix (median, min-max) per node and layer; "
                 "a stage's is relative to the residual it encodes", fontsize=10)
    fig.tight_layout()
    with atomic.atomic_open(path, "wb") as fh:
        fig.savefig(fh, format="png", metadata={"Software": None})
    plt.close(fig)


def make_report(c: Campaign, summary_path: str, table: str, quality_png: str, layers_png: str, rows_json: str,
                eval_json: str | None = None, kl_png: str | None = None, proxy_png: str | None = None,
                allocation_png: str | None = None) -> list[dict]:
    summary = canonical.load(summary_path)
    doc = canonical.load(eval_json) if eval_json else None
    rows = add_eval(build_rows(c, summary), doc)
    if kl_png:
        plot_kl(doc, kl_png, {r["product"]: r["stored_bytes"] for r in rows},
                whole={p.name for p in c.recipe.products if c.recipe.node(p.chain[0]).skeleton})
    write_table(rows, table)
    plot_quality(rows, quality_png)
    plot_layers(rows, list(c.source.moe_layers), layers_png)
    if proxy_png:
        plot_proxy(load_proxy(c), proxy_png)
    if allocation_png:
        plot_allocation(c, allocation_png)
    atomic.write_text(rows_json, canonical.pretty([{**r, "per_layer": {str(k): v for k, v in r["per_layer"].items()}}
                                                   for r in rows]))
    return rows
