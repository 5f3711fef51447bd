"""Expert Hessian variants at equal bytes, and why the K2+K1 residual chain loses to native K3 (issue 41, item 4).

    .venv/bin/python benchmarks/hessian_variants.py OUT.json [--work /tmp/hv] [--part hessians,residual]
        [--ks 2,3] [--variants all,routed,agq,agq2,affinity,agq-mix,qstream] [--seeds 0]
        [--repeat-seeds 1,2 --repeat-variants all,agq-mix] [--residuals r1,r1-wo,...]
        [--cal-rows 16 --cal-cols 128] [--eval-windows 196] [--threads 2]

The demo model (fq.model.demo_model, trained weights) in transformers, float32. Only the routed experts are
quantized (the demo's k2/k3 bases: experts only; attention, shared experts, dense MLP and head stay as published),
every routed-expert linear (2 MoE layers x 8 experts x gate/up/down) LDLQ-encoded (fq.codec.ldlq, mul1) at one K:
so every variant of one K has the same bytes by construction, and the same seed per matrix (paired encodes).

Hessians, captured on the calibration split (``--cal-rows`` x ``--cal-cols`` tokens, the demo campaign's 16 x 128),
H_e = sum_t c_te x_t x_t^T / sum_t c_te with token weights c_te per expert e (x: the MoE block's input for gate/up,
act(gate x)*(up x) of expert e for down):

  all       c = 1 on every token: today's all-experts capture (fq's default, exllamav3's converter)
  routed    c = 1 on the tokens whose top-k includes e (fq's routed-only capture)
  agq       c = w_te, the router's combine weight for e (top-k, normalized, scaled; 0 for a token not sent to e):
            MoEQuant's affinity-guided Hessian
  agq2      c = w_te^2: the weight of the expert's output error in the layer's output (second order)
  affinity  c = s_te = sigmoid(router logit) on every token (the router's affinity before top-k: a soft all-experts)
  agq-mix   H_agq + H_all, each normalized to unit mass (shrinks the affinity-weighted estimate toward all-experts)
  X-down    (agq-down, affinity-down) gate/up from ``all``, down from X: no per-expert input Hessian needed
  qstream   all-experts, captured with the earlier MoE layers' experts already quantized at the same K (exllamav3's
            sequential order; here layer 2's Hessians see layer 1's encodes; layer 1's are the ``all`` encodes)

``routed``, ``agq`` and ``agq2`` fall back to ``all`` for an expert that sees fewer routed tokens than the matrix's
input width (its Hessian would be rank-deficient); the fallbacks are listed in OUT.

Measured: KL(source || quantized) on held-out windows of 256 tokens (mean over positions per window, mean over
windows), on (1) the demo's held-out split and (2) outside text: fq's own Markdown docs at a pinned commit
(``OUTSIDE_COMMIT``; docs/*.md but benchmarks.md, and README.md), not drawn from the demo corpus's source (Python's
own documentation); windows spread evenly over it. Per-window paired differences against ``all`` with standard errors;
``--repeat-seeds`` encodes again with other seeds per matrix, which measures the encode's own randomness.

Part ``residual``: K2 + K1 residual (the demo's k2.r1: K1 LDLQ of W - W_hat(K2) in the calibration H metric) against
native K3 LDLQ, plus residual-stage variants at the same bytes (``--residuals``): the residual Hessian damped
(``r1-damp{x}``: H + x*mean(diag H)*I before the encoder's own damping), weight-only (``r1-wo``), the residual encoded
with another LDLQ drift factor in the scale search (``r1-drift{x}``, default 1.08 at K1), and the weight-only chain for
reference (``wo-k2``, ``wo-k3``, ``wo-k2.r1``); the K2 base itself encoded with a damped H and then the default K1
stage (``bdamp{x}-r1``, and its base ``bdamp{x}-k2``); the whole chain on the ``affinity`` Hessians (``aff-r1``, with
``aff-k2`` and ``aff-k3``). Per chain: KL on both texts and, per matrix, the relative error in the
calibration Hessian's metric, in Hessians captured on the held-out and outside texts, and in plain weight space.

OUT.json holds the settings, texts, bits, per-seed-set rows and the aggregates over seed sets (``over_seeds_vs_all``,
``over_seeds``: the mean over seed sets of the paired difference, its standard error across seed sets); the
per-window KLs go to OUT_windows.json beside it.

Encodes, Hessians and per-window KLs are cached under ``--work`` (``cache/``), so runs can be split and a rerun only
assembles OUT.json.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from fq.allocation import solve  # noqa: E402
from fq.allocation.measure import apply, weights  # noqa: E402
from fq.codec import encoder as wo_encoder  # noqa: E402
from fq.codec import ldlq as ldlq_mod  # noqa: E402
from fq.codec.ldlq import encode_ldlq, encode_ldlq_batch  # noqa: E402
from fq.model import demo_model  # noqa: E402
from fq.runtime.evaluate import tokenize  # noqa: E402
from fq.runtime.quality import token_windows  # noqa: E402

OUTSIDE_COMMIT = "166b015"
VARIANTS = ("all", "routed", "agq", "agq2", "affinity", "agq-mix", "qstream", "agq-down", "affinity-down")
TOPK = ("routed", "agq", "agq2")
WEIGHTINGS = ("all", "routed", "agq", "agq2", "affinity")
RESIDUALS = ("r1", "r1-damp0.1", "r1-damp0.3", "r1-damp1", "r1-wo", "r1-drift1.0", "r1-drift1.2", "wo-k2", "wo-k3",
             "wo-k2.r1", "bdamp0.3-r1", "bdamp1-r1", "aff-r1")
PROJ = ("gate_proj", "up_proj", "down_proj")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def demo_source(work) -> tuple[Path, "torch.nn.Module"]:
    """The trained demo model, written once under WORK/model (kept for reruns) and loaded in transformers, float32:
    (its directory, the model)."""
    from transformers import AutoModelForCausalLM

    mdir = Path(work) / "model"
    if not (mdir / "config.json").exists():
        demo_model.write(mdir)
    return mdir, AutoModelForCausalLM.from_pretrained(str(mdir), dtype=torch.float32).eval()


# ------------------------------------------------------------------------------------------------ text

def outside_text() -> tuple[str, list[str]]:
    names = subprocess.run(["git", "-C", str(ROOT), "ls-tree", "--name-only", OUTSIDE_COMMIT, "docs/"], check=True,
                           capture_output=True, text=True).stdout.split()
    names = sorted(n for n in names if n.endswith(".md") and n != "docs/benchmarks.md") + ["README.md"]
    parts = [subprocess.run(["git", "-C", str(ROOT), "show", f"{OUTSIDE_COMMIT}:{n}"], check=True, capture_output=True,
                            text=True).stdout for n in names]
    return "<|endoftext|>".join(parts), names


def even_windows(ids, seq: int, n: int) -> torch.Tensor:
    allw = token_windows(ids, seq, len(ids))
    if allw.shape[0] <= n:
        return allw
    idx = [round(i * (allw.shape[0] - 1) / (n - 1)) for i in range(n)]
    return allw[idx]


# ------------------------------------------------------------------------------------------------ capture

def expert_modules(model) -> dict[int, tuple]:
    """layer -> (fused experts module, router module, its name prefix)."""
    out = {}
    for name, mod in model.named_modules():
        if hasattr(mod, "gate_up_proj") and getattr(mod, "gate_up_proj").dim() == 3:
            layer = int(name.split(".layers.")[1].split(".")[0])
            parent = model.get_submodule(name.rsplit(".", 1)[0])
            out[layer] = (mod, parent.gate, name)
    return out


def capture(model, windows: torch.Tensor, weightings=WEIGHTINGS, batch: int = 8) -> dict:
    """Per MoE layer: token-weighted sums of x x^T (per expert and weighting) and a_e a_e^T, float64, with masses,
    the routed token counts and the token count."""
    mods = expert_modules(model)
    sums: dict = {}
    logits: dict = {}
    handles, origs = [], []
    for layer, (mod, gate, _name) in mods.items():
        handles.append(gate.register_forward_hook(lambda m, i, o, layer=layer: logits.__setitem__(layer, o[0].detach())))

        def fwd(hidden_states, top_k_index, top_k_weights, mod=mod, layer=layer, orig=mod.forward):
            x = hidden_states.detach().double()
            T, E, I = x.shape[0], mod.gate_up_proj.shape[0], mod.gate_up_proj.shape[1] // 2
            s = sums.setdefault(layer, {"x": {}, "a": {}, "mass": {}, "count": [0] * E, "T": 0})
            s["T"] += T
            sig = torch.sigmoid(logits[layer].double())
            for e in range(E):
                sel = (top_k_index == e)
                w = (top_k_weights.detach().double() * sel).sum(-1)
                routed = sel.any(-1).double()
                s["count"][e] += int(routed.sum())
                c = {"all": torch.ones(T, dtype=torch.float64), "routed": routed, "agq": w, "agq2": w * w,
                     "affinity": sig[:, e]}
                gu = torch.nn.functional.linear(hidden_states.detach(), mod.gate_up_proj[e].detach())
                a = (mod.act_fn(gu[..., :I]) * gu[..., I:]).double()
                for k in weightings:
                    ck = c[k][:, None]
                    for key, v in (("x", x), ("a", a)):
                        d = s[key].setdefault((e, k), torch.zeros(v.shape[1], v.shape[1], dtype=torch.float64))
                        d += (v * ck).T @ v
                    s["mass"][(e, k)] = s["mass"].get((e, k), 0.0) + float(c[k].sum())
            return orig(hidden_states, top_k_index, top_k_weights)

        origs.append((mod, mod.forward))
        mod.forward = fwd
    try:
        with torch.no_grad():
            for i in range(0, windows.shape[0], batch):
                model(input_ids=windows[i: i + batch])
    finally:
        for h in handles:
            h.remove()
        for mod, f in origs:
            mod.forward = f
    return {"sums": sums, "names": {layer: v[2] for layer, v in mods.items()}}


def hessians_for(cap: dict, variant: str, layers=None) -> tuple[dict, list]:
    """name -> H for every routed-expert linear of ``layers`` under ``variant`` (a weighting, or agq-mix); and the
    experts that fell back to all-experts."""
    out, fallback = {}, []
    down_only = variant.endswith("-down")
    variant = variant.removesuffix("-down")
    for layer, s in cap["sums"].items():
        if layers is not None and layer not in layers:
            continue
        prefix = cap["names"][layer]
        E = len(s["count"])
        for e in range(E):
            def H(key, k):
                return s[key][(e, k)] / s["mass"][(e, k)]
            for key, projs in (("x", ("gate_proj", "up_proj")), ("a", ("down_proj",))):
                n = s[key][(e, "all")].shape[0]
                if down_only and key == "x":
                    h = H(key, "all")
                elif variant == "agq-mix":
                    h = H(key, "agq") + H(key, "all") if s["mass"][(e, "agq")] > 0 else 2 * H(key, "all")
                elif variant in TOPK and s["count"][e] < n:
                    h = H(key, "all")
                    fallback.append(f"L{layer}.e{e}.{key}({s['count'][e]}<{n})")
                else:
                    h = H(key, variant)
                for p in projs:
                    out[f"{prefix}.{e}.{p}"] = h
    return out, fallback


def digest(tensors: dict) -> str:
    h = hashlib.sha256()
    for n in sorted(tensors):
        h.update(n.encode())
        h.update(tensors[n].detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


# ------------------------------------------------------------------------------------------------ encodes

class Cache:
    def __init__(self, work: Path):
        self.dir = work / "cache"
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, tag: str, ext: str) -> Path:
        return self.dir / f"{hashlib.sha256(tag.encode()).hexdigest()[:20]}.{ext}"

    def load(self, tag: str, ext: str = "pt"):
        p = self.path(tag, ext)
        if not p.exists():
            return None
        return torch.load(p) if ext == "pt" else json.loads(p.read_text())

    def save(self, tag: str, obj, ext: str = "pt"):
        p = self.path(tag, ext)
        tmp = p.with_suffix(".tmp")
        if ext == "pt":
            torch.save(obj, tmp)
        else:
            tmp.write_text(json.dumps(obj))
        tmp.replace(p)


def seed_of(names: list, name: str, seedset: int, stage: int = 0) -> int:
    return seedset * 100_000 + stage * 10_000 + names.index(name)


def encode_set(cache: Cache, tag: str, W: dict, H: dict | None, names: list, allnames: list, K: int, seedset: int, *,
               parents: dict | None = None, stage: int = 0, drift: float | None = None) -> dict:
    """name -> {W_hat, tensors, proxy, rel_mse} for ``names``; H None = weight-only. Cached under ``tag``."""
    got = cache.load(tag)
    if got is not None:
        return got
    t0 = time.time()
    out = {}
    old = ldlq_mod.ldlq_drift
    if drift is not None:
        ldlq_mod.ldlq_drift = lambda k: drift
    try:
        groups: dict = {}
        for n in names:  # gate and up of an expert share H: one batch
            groups.setdefault(n.rsplit(".", 1)[0] + ("/gu" if not n.endswith("down_proj") else "/d"), []).append(n)
        for g in groups.values():
            Ws = [W[n].double() for n in g]
            seeds = [seed_of(allnames, n, seedset, stage) for n in g]
            par = None if parents is None else [[parents[n]] for n in g]
            if H is None:
                encs = [wo_encoder.encode(w, K, "mul1", s) if par is None else
                        wo_encoder.encode_residual(w, p, K, "mul1", s) for w, s, p in zip(Ws, seeds, par or [None] * len(Ws))]
            else:
                encs = encode_ldlq_batch(Ws, H[g[0]], K, "mul1", seeds, parents=par, names=g)
            for n, e in zip(g, encs):
                out[n] = {"W_hat": e.W_hat.float().cpu(), "tensors": e.tensors, "proxy": e.proxy_err,
                          "rel_mse": e.rel_mse}
    finally:
        ldlq_mod.ldlq_drift = old
    log(f"encoded {tag}: {len(names)} matrices in {time.time() - t0:.0f} s")
    cache.save(tag, out)
    return out


# ------------------------------------------------------------------------------------------------ KL

def log_probs(model, windows: torch.Tensor) -> list:
    out = []
    with torch.no_grad():
        for i in range(0, windows.shape[0], 8):
            out.append(torch.log_softmax(model(input_ids=windows[i: i + 8]).logits[:, :-1].double(), -1))
    return out


def window_kl(ref: list, model, windows) -> list[float]:
    rows = []
    for lp, lq in zip(ref, log_probs(model, windows)):
        rows += (lp.exp() * (lp - lq)).sum(-1).mean(-1).tolist()
    return rows


def paired(a: list, b: list) -> dict:
    d = [x - y for x, y in zip(a, b)]
    m = sum(d) / len(d)
    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5
    return {"diff": m, "se": se, "ratio": (sum(a) / len(a)) / (sum(b) / len(b))}


def mean(v):
    return sum(v) / len(v)


def over_seeds(kl: dict, base: dict) -> dict:
    """kl, base: seedset -> per-window KLs (the seed sets both have). Per seed set the mean KL; the ratio of the means
    over seed sets; the mean over seed sets of the paired difference, with its standard error across seed sets (the
    encode's randomness and the windows' together)."""
    seeds = sorted(set(kl) & set(base))
    k, b = [mean(kl[s]) for s in seeds], [mean(base[s]) for s in seeds]
    d = [x - y for x, y in zip(k, b)]
    m = mean(d)
    se = (sum((x - m) ** 2 for x in d) / (len(d) - 1) / len(d)) ** 0.5 if len(d) > 1 else None
    return {"seedsets": seeds, "kl": k, "kl_mean": mean(k), "base_mean": mean(b), "ratio": mean(k) / mean(b),
            "diff": m, "se": se}


# ------------------------------------------------------------------------------------------------ main

def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--work", default="/tmp/hv")
    ap.add_argument("--part", default="hessians,residual")
    ap.add_argument("--ks", default="2,3")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--repeat-seeds", default="")
    ap.add_argument("--repeat-variants", default="all")
    ap.add_argument("--residuals", default=",".join(RESIDUALS))
    ap.add_argument("--residual-seeds", default="0")
    ap.add_argument("--cal-rows", type=int, default=16)
    ap.add_argument("--cal-cols", type=int, default=128)
    ap.add_argument("--eval-windows", type=int, default=196)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    t_start = time.time()
    work = Path(a.work)
    cache = Cache(work)
    mdir, model = demo_source(work)

    cal_text, held_text = demo_model.text("calibration"), demo_model.text("heldout")
    out_text, out_names = outside_text()
    cal = token_windows(tokenize(mdir, cal_text)[0], a.cal_cols, a.cal_rows * a.cal_cols)
    held_ids, out_ids = tokenize(mdir, held_text)[0], tokenize(mdir, out_text)[0]
    texts = {"heldout": even_windows(held_ids, 256, a.eval_windows), "outside": even_windows(out_ids, 256, a.eval_windows)}
    text_info = {"heldout": {"source": "fq.model.demo_model.text('heldout')", "chars": len(held_text),
                             "tokens": len(held_ids)},
                 "outside": {"source": f"git show {OUTSIDE_COMMIT}:<file>, joined by <|endoftext|>", "files": out_names,
                             "chars": len(out_text), "tokens": len(out_ids),
                             "sha256": hashlib.sha256(out_text.encode()).hexdigest()}}
    for k, w in texts.items():
        text_info[k]["windows"] = int(w.shape[0])
    refs = {k: log_probs(model, w) for k, w in texts.items()}
    for k, w in texts.items():  # the source's own perplexity there, for scale
        nll = -mean([float(lp.gather(-1, w[i0: i0 + lp.shape[0], 1:, None]).mean()) for i0, lp in
                     zip(range(0, w.shape[0], 8), refs[k])])
        text_info[k]["source_ppl"] = math.exp(nll)
    log(f"texts: {json.dumps({k: {x: v[x] for x in ('tokens', 'windows', 'source_ppl')} for k, v in text_info.items()})}")

    W = weights(model)
    orig = {n: t.clone() for n, t in W.items()}
    names = sorted(n for n in W if ".experts." in n and "shared" not in n)
    n_weights = sum(W[n].numel() for n in names)

    def bits(ks) -> float:
        return 8 * sum(solve.linear_bytes(*W[n].shape, K) for n in names for K in ks) / n_weights

    cal_key = f"{a.cal_rows}x{a.cal_cols}"
    cap = cache.load(f"capture/{cal_key}")
    if cap is None:
        cap = capture(model, cal)
        cache.save(f"capture/{cal_key}", cap)
    usage = {L: s["count"] for L, s in cap["sums"].items()}
    log(f"routed tokens per expert (of {cap['sums'][1]['T']}): {usage}")

    def kl_of(tag: str, Wh: dict, text: str) -> list:
        key = f"kl/{tag}/{text}/{a.eval_windows}"
        got = cache.load(key, "json")
        if got is not None:
            return got
        apply(model, Wh)
        try:
            rows = window_kl(refs[text], model, texts[text])
        finally:
            apply(model, orig)
        cache.save(key, rows, "json")
        return rows

    doc = {"model": "fq.model.demo_model (trained, Glm4MoeForCausalLM: 2 MoE layers x 8 experts, top-2, sigmoid router)",
           "quantized": f"routed experts only: {len(names)} linears, {n_weights} weights", "codebook": "mul1",
           "calibration": {"rows": a.cal_rows, "cols": a.cal_cols, "routed_tokens": usage}, "texts": text_info,
           "bits": {"K1": bits([1]), "K2": bits([2]), "K3": bits([3]), "K2+K1": bits([2, 1])},
           "machine": {"cpu": platform.processor() or platform.machine(), "threads": a.threads,
                       "torch": torch.__version__}}
    allH = {}

    def Hmap(variant: str, K: int, seedset: int) -> tuple[dict, list, str]:
        if variant != "qstream":
            if variant not in allH:
                allH[variant] = hessians_for(cap, variant)
            H, fb = allH[variant]
            return H, fb, digest(H)
        base = encs("all", K, seedset)
        first = min(cap["names"])
        l1 = {n: base[n]["W_hat"] for n in names if f".layers.{first}." in n}
        tag = f"capture/{cal_key}/qstream/K{K}/s{seedset}/{digest(l1)}"
        qc = cache.load(tag)
        if qc is None:
            apply(model, l1)
            try:
                qc = capture(model, cal, weightings=("all",))
            finally:
                apply(model, orig)
            cache.save(tag, qc)
        H0, _ = hessians_for(cap, "all", layers={first})
        Hq, _ = hessians_for(qc, "all", layers=set(qc["sums"]) - {first})
        H = {**H0, **Hq}
        return H, [], digest(H)

    def encs(variant: str, K: int, seedset: int) -> dict:
        H, _, d = Hmap(variant, K, seedset)
        return encode_set(cache, f"enc/{variant}/K{K}/s{seedset}/{d}", W, H, names, names, K, seedset)

    # Hessians on the evaluation texts, for the per-matrix diagnostics (all-experts, as the campaign's capture)
    diagH = {"calibration": allH.setdefault("all", hessians_for(cap, "all"))[0]}
    for t in texts:
        c = cache.load(f"capture/eval/{t}/{a.eval_windows}")
        if c is None:
            c = capture(model, texts[t], weightings=("all",))
            cache.save(f"capture/eval/{t}/{a.eval_windows}", c)
        diagH[t] = hessians_for(c, "all")[0]

    def rel_err(E: torch.Tensor, n: str, H: torch.Tensor) -> float:
        E, Wn = E.double(), W[n].double()
        return float(torch.einsum("oi,ij,oj->", E, H, E) / torch.einsum("oi,ij,oj->", Wn, H, Wn))

    def diag(Wh: dict) -> dict:
        out = {}
        for label, H in diagH.items():
            v = {p: mean([rel_err(Wh[n] - W[n], n, H[n]) for n in names if n.endswith(p)]) for p in PROJ}
            v["mean"] = mean([rel_err(Wh[n] - W[n], n, H[n]) for n in names])
            out[label] = v
        out["weight"] = mean([float(((Wh[n] - W[n]).double() ** 2).sum() / (W[n].double() ** 2).sum()) for n in names])
        return out

    parts = a.part.split(",")
    ks = [int(k) for k in a.ks.split(",")]
    if "hessians" in parts:
        rows = []
        runs = [(v, s) for s in map(int, a.seeds.split(",")) for v in a.variants.split(",")]
        runs += [(v, int(s)) for s in a.repeat_seeds.split(",") if s for v in a.repeat_variants.split(",")]
        for K in ks:
            for v, s in runs:
                e = encs(v, K, s)
                tag = f"{v}/K{K}/s{s}/{Hmap(v, K, s)[2]}"
                r = {"variant": v, "K": K, "seedset": s, "bits": bits([K]),
                     "proxy_mean": mean([e[n]["proxy"] for n in names]),
                     "rel_mse_mean": mean([e[n]["rel_mse"] for n in names]), "fallback": Hmap(v, K, s)[1],
                     "errors": diag({n: e[n]["W_hat"] for n in names})}
                for t in texts:
                    r[f"kl_{t}"] = kl_of(tag, {n: e[n]["W_hat"] for n in names}, t)
                rows.append(r)
                log(f"K{K} {v} s{s}: " + " ".join(f"{t} {mean(r[f'kl_{t}']):.6f}" for t in texts))
        summary = []
        for r in rows:
            base = next(b for b in rows if b["variant"] == "all" and b["K"] == r["K"] and b["seedset"] == r["seedset"])
            sr = {k: r[k] for k in ("variant", "K", "seedset", "bits", "proxy_mean", "rel_mse_mean", "errors")}
            for t in texts:
                sr[t] = {"kl": mean(r[f"kl_{t}"]), **{f"vs_all_{k}": v for k, v in paired(r[f"kl_{t}"], base[f"kl_{t}"]).items()}}
            summary.append(sr)
        seednoise = []  # the same variant, another seed set: the encode's own randomness
        for r in rows:
            for q in rows:
                if r["variant"] == q["variant"] and r["K"] == q["K"] and q["seedset"] > r["seedset"]:
                    seednoise.append({"variant": r["variant"], "K": r["K"], "seedsets": [r["seedset"], q["seedset"]],
                                      **{t: paired(q[f"kl_{t}"], r[f"kl_{t}"]) for t in texts}})
        agg = {}
        for r in rows:
            key = f"{r['variant']}/K{r['K']}"
            if key in agg:
                continue
            same = {q["seedset"]: q for q in rows if q["variant"] == r["variant"] and q["K"] == r["K"]}
            base = {q["seedset"]: q for q in rows if q["variant"] == "all" and q["K"] == r["K"]}
            agg[key] = {t: over_seeds({s: q[f"kl_{t}"] for s, q in same.items()},
                                      {s: q[f"kl_{t}"] for s, q in base.items()}) for t in texts}
        doc["hessians"] = {"over_seeds_vs_all": agg, "summary": summary, "seed_noise": seednoise,
                           "fallback": {v: allH[v][1] for v in allH},
                           "windows": {f"{r['variant']}/K{r['K']}/s{r['seedset']}": {t: r[f"kl_{t}"] for t in texts}
                                       for r in rows}}

    if "residual" in parts:
        Hall, _, dall = Hmap("all", 2, 0)
        res_rows = []
        for s in map(int, a.residual_seeds.split(",")):
            k2, k3 = encs("all", 2, s), encs("all", 3, s)
            chains = {"k2": ([2], {n: k2[n]["W_hat"] for n in names}), "k3": ([3], {n: k3[n]["W_hat"] for n in names})}
            par = {n: k2[n]["tensors"] for n in names}
            for rv in a.residuals.split(","):
                if rv.startswith("wo-"):
                    b = encode_set(cache, f"enc/wo/K2/s{s}", W, None, names, names, 2, s)
                    if rv == "wo-k2":
                        chains[rv] = ([2], {n: b[n]["W_hat"] for n in names})
                    elif rv == "wo-k3":
                        b3 = encode_set(cache, f"enc/wo/K3/s{s}", W, None, names, names, 3, s)
                        chains[rv] = ([3], {n: b3[n]["W_hat"] for n in names})
                    else:
                        r = encode_set(cache, f"enc/wo-r1/s{s}", W, None, names, names, 1, s,
                                       parents={n: b[n]["tensors"] for n in names}, stage=1)
                        chains[rv] = ([2, 1], {n: b[n]["W_hat"] + r[n]["W_hat"] for n in names})
                    continue
                if rv.startswith("bdamp"):  # the K2 base itself encoded with a damped H, then the default K1 stage
                    x = float(rv[len("bdamp"):].removesuffix("-r1"))
                    Hb = {n: h + torch.eye(h.shape[0], dtype=h.dtype) * (x * float(torch.diagonal(h).mean()))
                          for n, h in Hall.items()}
                    b = encode_set(cache, f"enc/bdamp{x}/K2/s{s}/{dall}", W, Hb, names, names, 2, s)
                    r = encode_set(cache, f"enc/bdamp{x}-r1/s{s}/{dall}", W, Hall, names, names, 1, s,
                                   parents={n: b[n]["tensors"] for n in names}, stage=1)
                    chains[f"bdamp{x:g}-k2"] = ([2], {n: b[n]["W_hat"] for n in names})
                    chains[rv] = ([2, 1], {n: b[n]["W_hat"] + r[n]["W_hat"] for n in names})
                    chains[rv + "/stage"] = r
                    continue
                if rv == "aff-r1":  # the whole chain on the affinity Hessians (base: the hessians part's encodes)
                    Ha, _, da = Hmap("affinity", 2, s)
                    b, b3 = encs("affinity", 2, s), encs("affinity", 3, s)
                    r = encode_set(cache, f"enc/aff-r1/s{s}/{da}", W, Ha, names, names, 1, s,
                                   parents={n: b[n]["tensors"] for n in names}, stage=1)
                    chains["aff-k2"] = ([2], {n: b[n]["W_hat"] for n in names})
                    chains["aff-k3"] = ([3], {n: b3[n]["W_hat"] for n in names})
                    chains[rv] = ([2, 1], {n: b[n]["W_hat"] + r[n]["W_hat"] for n in names})
                    chains[rv + "/stage"] = r
                    continue
                if rv == "r1-wo":
                    r = encode_set(cache, f"enc/r1-wo/s{s}/{dall}", W, None, names, names, 1, s, parents=par, stage=1)
                else:
                    H, drift = Hall, None
                    if rv.startswith("r1-damp"):
                        x = float(rv[len("r1-damp"):])
                        H = {n: h + torch.eye(h.shape[0], dtype=h.dtype) * (x * float(torch.diagonal(h).mean()))
                             for n, h in Hall.items()}
                    elif rv.startswith("r1-drift"):
                        drift = float(rv[len("r1-drift"):])
                    elif rv != "r1":
                        raise SystemExit(f"unknown residual variant {rv}")
                    r = encode_set(cache, f"enc/{rv}/s{s}/{dall}", W, H, names, names, 1, s, parents=par, stage=1,
                                   drift=drift)
                chains[rv] = ([2, 1], {n: k2[n]["W_hat"] + r[n]["W_hat"] for n in names})
                chains[rv + "/stage"] = r
            for cname, val in chains.items():
                if cname.endswith("/stage"):
                    continue
                kks, Wh = val
                row = {"chain": cname, "seedset": s, "bits": bits(kks), "errors": diag(Wh)}
                st = chains.get(cname + "/stage")
                if st is not None:
                    row["stage_proxy_mean"] = mean([st[n]["proxy"] for n in names if st[n]["proxy"] is not None]) \
                        if st[names[0]]["proxy"] is not None else None
                for t in texts:
                    row[f"kl_{t}"] = kl_of(f"chain/{cname}/s{s}/{dall}", Wh, t)
                res_rows.append(row)
                log(f"chain {cname} s{s}: " + " ".join(f"{t} {mean(row[f'kl_{t}']):.6f}" for t in texts)
                    + f" | cal {row['errors']['calibration']['mean']:.5f} held {row['errors']['heldout']['mean']:.5f}"
                    f" out {row['errors']['outside']['mean']:.5f} weight {row['errors']['weight']:.5f}")
        summary = []
        for r in res_rows:
            k3 = next(b for b in res_rows if b["chain"] == "k3" and b["seedset"] == r["seedset"])
            sr = {k: r[k] for k in r if not k.startswith("kl_")}
            for t in texts:
                sr[t] = {"kl": mean(r[f"kl_{t}"]), **{f"vs_k3_{k}": v for k, v in paired(r[f"kl_{t}"], k3[f"kl_{t}"]).items()}}
                if r["chain"].startswith("r1") and r["chain"] != "r1":
                    r1 = next(b for b in res_rows if b["chain"] == "r1" and b["seedset"] == r["seedset"])
                    sr[t].update({f"vs_r1_{k}": v for k, v in paired(r[f"kl_{t}"], r1[f"kl_{t}"]).items()})
            summary.append(sr)
        agg = {}
        for r in res_rows:
            if r["chain"] in agg:
                continue
            same = {q["seedset"]: q for q in res_rows if q["chain"] == r["chain"]}
            agg[r["chain"]] = {"bits": r["bits"]}
            for ref in ("k3", "r1"):
                base = {q["seedset"]: q for q in res_rows if q["chain"] == ref}
                if base:
                    agg[r["chain"]][f"vs_{ref}"] = {t: over_seeds({s: q[f"kl_{t}"] for s, q in same.items()},
                                                                  {s: q[f"kl_{t}"] for s, q in base.items()})
                                                    for t in texts}
            agg[r["chain"]]["errors"] = {k: mean([q["errors"][k]["mean"] if k != "weight" else q["errors"][k]
                                                  for q in same.values()])
                                         for k in ("calibration", "heldout", "outside", "weight")}
        doc["residual"] = {"over_seeds": agg, "summary": summary,
                           "windows": {f"{r['chain']}/s{r['seedset']}": {t: r[f"kl_{t}"] for t in texts} for r in res_rows}}
    doc["seconds"] = round(time.time() - t_start, 1)
    windows = {part: doc[part].pop("windows") for part in ("hessians", "residual") if part in doc}
    for part in windows.values():  # 9 decimals: KLs of 1e-3 keep 6 digits
        for per in part.values():
            for t in per:
                per[t] = [round(x, 9) for x in per[t]]
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    Path(a.out).with_name(Path(a.out).stem + "_windows.json").write_text(json.dumps(windows, sort_keys=True) + "\n")
    log(f"wrote {a.out} ({doc['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
