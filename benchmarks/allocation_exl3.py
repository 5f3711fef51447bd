"""fq's measured-sensitivity allocation against exllamav3 1.6.5's converter at equal stored bytes (issue 41).

Three steps, each a subcommand; ``build`` runs where the encodes are cheapest (the CPU for the demo, the GPU for the
benchmark MoE), ``measure`` on the GPU (exllamav3 loads every directory), ``report`` anywhere:

    python benchmarks/allocation_exl3.py build MODEL CAL_TEXT OUT [--bits 2,2.5,3,4,5] [--ks 1-8] [--device cpu]
        [--sens-rows 16 --sens-cols 128 --samples 8] [--hess-cols 512 --hess-tokens 65536] [--seed 0]
        [--weighting none|affinity-down|affinity] [--from-build EARLIER/fq/build.json [--resolve]]
    python benchmarks/allocation_exl3.py measure MODEL OUT --fq OUT/fq --text NAME=PATH [--text ...]
        [--b 1.5,2,...] [--hq 1.5,2,...] [--parallel 4] [--tokens 32768] [--seq 256] [--skip-exl3]
    python benchmarks/allocation_exl3.py check MODEL OUT/fq CHECK.json --text NAME=PATH [--text ...] [--tokens 32768]
        [--base NAME=DIR ...]
    python benchmarks/allocation_exl3.py report OUT/measure.json [...] --json RESULT.json [--plot KL.png]

``build``: ``fq allocate``'s measurement (fq.allocation.measure.unit_options: every unit's predicted KL at every K of
``--ks`` from the Fisher quadratic form in an LDLQ-shaped direction, on ``--sens-rows`` x ``--sens-cols`` calibration
tokens, ``--samples`` label samples) and its solver (fq.allocation.solve.solve at
fq.allocation.solve.budget_from_bits(bits, allocated weights)) per ``--bits``; then every linear is encoded by fq's
LDLQ (fq.codec.ldlq.encode_ldlq_batch, mul1) at the K its unit got, against its Hessian on the calibration text
(``--hess-tokens`` tokens in windows of ``--hess-cols``; routed experts with the campaign's all-experts capture:
fq.allocation.measure.hessians), and written as an EXL3 model directory exllamav3 loads (``OUT/fq/b{bits}``:
config.json, tokenizer, one ``model.safetensors`` with the source's other tensors as published and per quantized linear
``{name}.trellis`` int16, ``.suh``/``.svh`` fp16 and the ``.mul1`` marker). Unsigned benchmark material: keep it out of
git. ``OUT/fq/build.json``: the units' options, each allocation (K per unit, bits, bytes, predicted KL, gap bound), the
encodes' proxy errors, timings. ``--weighting`` encodes against the routed experts' Hessians under the campaign's
router-affinity weighting (``calibration.weighting``); ``--from-build`` takes an earlier build's allocations instead of
measuring them again (the same K per unit and bytes: a paired comparison of Hessians), or with ``--resolve`` solves
its measurement again at ``--bits`` with the candidates ``--ks`` and floor ``--least-k``. With ``--check-cpu TEXT`` every directory's linears are read back from its
file, decoded by fq (fq.codec.tensors.reconstruct) and their KL against the source measured in transformers (float32,
the build's device) on TEXT: a check of the files' content independent of exllamav3.

``measure``: the held-out windows of each ``--text`` (``--tokens`` tokens, windows of ``--seq``), the source's
log-probabilities in transformers (float32, CUDA; exl3_whole_model.source_logprobs), exllamav3's converter at each
``--b`` (``-b``) and ``--hq`` (``-b -hq``) run ``--parallel`` at a time (exl3_whole_model.convert, its bundled
calibration corpus, defaults otherwise; their logs one after another in ``OUT/convert.log``), and every directory
(fq's, the converter's, and the source itself as the runtime's floor) loaded by exllamav3 on cuda:0 and scored:
KL(source || model) per position; per text the mean, the standard error over positions and over windows, and the
per-window means (for paired statistics). Sizes are the bytes of each directory's ``*.safetensors``.
``OUT/measure.json`` is rewritten after every model. benchmarks/allocation_exl3_device.sh runs it on the device.

``check``: ``measure``'s scoring of fq's directories without a GPU: the same windows, KL(source || directory) per
position in transformers (float32, the CPU) with the linears read back from each directory's file and decoded by fq;
a measure.json that ``report`` reads beside exllamav3's conversions measured on a GPU (fq's side then in another
runtime: a proxy, labelled by its ``device``). ``--base NAME=DIR`` scores other EXL3 directories the same way (kind
``base``: a campaign's published whole-model bases of hand-made recipes), which ``report`` reads fq's allocations
against as a third curve (fq / recipes at equal bytes; never part of exllamav3's best).

``report``: per text and fq allocation, exllamav3's ``-b`` and ``-b -hq`` curves interpolated at fq's bytes
(log-KL linear in bytes between the two neighbouring conversions; a size up to 1% past an end of a curve takes that
end's KL), the ratio fq / the lower of the two with its standard error (delta method on per-window means, paired: fq
and the conversions share the windows), per curve the nearest conversion by bytes with the paired per-window
difference and the size ratio, and the plot (KL against bytes, log scale). Several measure.json files merge (a row
name seen first wins), so conversions measured in separate device calls join one report.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import torch

from fq.runtime.quality import token_windows  # light: no provenance imports, which the device need not have

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # exl3_whole_model, beside this file
    sys.path.insert(0, str(HERE))

CODEBOOK = "mul1"


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def _write_json(path: Path, doc) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)


# ------------------------------------------------------------------------------------------------------------ build

def exl3_config(src: Path, qc: dict) -> dict:
    """The source's config.json with the keys exllamav3 reads under another spelling (the family's derived keys, as
    fq's bases state them) and a ``quantization_config`` block as exllamav3's converter writes it."""
    from fq.model import families

    cfg = json.loads((src / "config.json").read_text())
    extra = families.for_config(cfg, str(src / "config.json")).exl3_needs.derived_keys(cfg)
    return {**cfg, **extra, "quantization_config": qc}


def source_tensors(src: Path) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with safe_open(str(f), "pt") as g:
            for k in g.keys():
                out[k] = g.get_tensor(k)
    return out


def write_exl3_dir(src: Path, dest: Path, coded: dict[str, dict], qc: dict, source: dict | None = None) -> int:
    """An EXL3 model directory: every source tensor as published but the quantized linears' ``.weight``, which are
    replaced by their EXL3 tensors (``coded``: linear name -> {trellis, suh, svh, mul1}). Returns its tensor bytes."""
    from safetensors.torch import save_file

    source = source_tensors(src) if source is None else source
    missing = [n for n in coded if f"{n}.weight" not in source]
    if missing:
        raise SystemExit(f"{src}: no source tensor for {missing[:3]} ({len(missing)} linears)")
    tensors = {k: v for k, v in source.items() if not (k.endswith(".weight") and k[:-7] in coded)}
    for n, ts in coded.items():
        for t, v in ts.items():
            tensors[f"{n}.{t}"] = v.contiguous()
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(exl3_config(src, qc), indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy(src / f, dest / f)
    return sum(p.stat().st_size for p in dest.glob("*.safetensors"))


def log_probs(model, windows, device) -> torch.Tensor:
    """float64 log-probabilities of a transformers model over ``windows`` (every position)."""
    with torch.no_grad():
        lp = torch.cat([torch.log_softmax(model(input_ids=windows[i: i + 8].to(device)).logits.double(), -1)
                        for i in range(0, windows.shape[0], 8)])
    return lp


def read_back(dd: Path, W: dict) -> dict[str, torch.Tensor]:
    """Every quantized linear of the EXL3 directory ``dd`` (names as fq.allocation.measure.weights), read back from
    its file and decoded by fq (fq.codec.tensors.reconstruct) at its own shape (``W``'s)."""
    from fq.codec.tensors import reconstruct

    back = source_tensors(dd)
    parts = ("trellis", "suh", "svh", "mcg", "mul1")
    return {n: reconstruct({t: back[f"{n}.{t}"] for t in parts if f"{n}.{t}" in back}, n, tuple(w.shape))
            for n, w in W.items() if f"{n}.trellis" in back}


def window_kl(model, dd: Path, W: dict, checks: dict, dev) -> dict:
    """KL(source || ``dd``'s weights) per window of each held-out text in ``checks`` ({name: (windows, the source's
    log-probabilities)}), in transformers on ``model`` (whose weights are put back after)."""
    from fq.allocation.measure import apply

    orig = {n: t.clone() for n, t in W.items()}
    apply(model, {n: w.to(dev) for n, w in read_back(dd, W).items()})
    out = {}
    for name, (w, ref) in checks.items():
        per = (ref.exp() * (ref - log_probs(model, w, dev))).sum(-1).double().cpu()  # (windows, seq)
        out[name] = per
    apply(model, orig)
    return out


def shared_hessians(H: dict) -> dict:
    """``H`` with equal Hessians as one tensor (by their bytes), so that a batch factors each once (a layer's routed
    gate/up share one: the all-experts capture gives every expert the same inputs)."""
    one: dict[str, torch.Tensor] = {}
    return {n: one.setdefault(hashlib.sha256(h.contiguous().cpu().numpy().tobytes()).hexdigest(), h)
            for n, h in H.items()}


def measure_and_solve(a, model, sens_w, ks, bits, clock):
    """fq allocate's measurement and solver at each budget of ``bits``: (options, allocated weights, fit, allocations,
    least K of each)."""
    from fq.allocation import error_model, solve, units
    from fq.allocation.document import LEAST_K
    from fq.allocation.measure import unit_options

    t0 = time.time()
    def progress(done, total):  # the Fisher pass's windows, then the injected points: where a slow build is
        if done == total or done % max(1, total // 10) == 0:
            print(f"sensitivity: {done}/{total} ({time.time() - t0:.0f} s)", flush=True)

    options, n_weights, sens, fit = unit_options(model, sens_w, ks, CODEBOOK, samples=a.samples, seed=a.seed,
                                                 progress=progress)
    clock["sensitivity"] = time.time() - t0
    print(f"sensitivity: {len(options)} units, {len(sens.linears)} linears, {sens.positions} positions, "
          f"{clock['sensitivity']:.1f} s", flush=True)

    def d(K):
        return error_model.distortion(K, CODEBOOK)

    sizes = {u: {K: v[1] for K, v in o.items()} for u, o in options.items()}
    q = {u: sum(sens.linears[n].quad[0] for n in ns) / (2 * sens.positions)
         for u, ns in units.group_units(sorted(sens.linears)).items()}
    least = LEAST_K if a.least_k is None else a.least_k
    print("LDLQ efficiency c(K): " + " ".join(f"{K}:{c:.3f}" for K, c in fit["efficiency"].items()), flush=True)
    allocs, least_of = {}, {}
    for model_kind in a.models.split(","):
        for b in bits:  # fq allocate's rule: K >= LEAST_K wherever the budget allows
            budget = solve.budget_from_bits(b, n_weights)
            if model_kind == "fisher":  # the second-order term alone, d(K) x the Fisher form (before injection)
                opts = {u: {K: (d(K) * q[u], sizes[u][K]) for K in ks} for u in options}
                s, lk = solve.solve_from(opts, budget, n_weights, least)
            elif model_kind == "additive":  # every unit's injected curve at D(K), summed
                s, lk = solve.solve_from(options, budget, n_weights, least)
            elif model_kind == "pooled":  # fq's: flips pooled over units (fq.allocation.solve.solve_pooled)
                s, lk = solve.solve_pooled(fit["parts"], sizes, budget, n_weights, least)
            else:
                raise SystemExit(f"--models: unknown error model {model_kind!r} (fisher, additive, pooled)")
            allocs[(model_kind, b)], least_of[(model_kind, b)] = s, lk
            print(f"{model_kind} {b:g} bits: {s.bits:.4f} bits, {s.bytes:,} B, predicted KL {s.predicted_kl:.5f}, "
                  f"least K {lk}; K " + " ".join(f"{u}:{k}" for u, k in s.ks.items()), flush=True)

    return options, n_weights, fit, allocs, least_of


def weighted_expert_hessians(model, windows, src: Path, weighting: str) -> dict[str, torch.Tensor]:
    """The routed experts' Hessians under the campaign's router-affinity weighting (``calibration.weighting``;
    fq.hessian.affinity): H_e = sum_t c_te x x^T / sum_t c_te with c_te the router's score of expert e for token t
    (the family's declared sigmoid or softmax, checked against the weights the router applied). ``affinity-down``:
    the down projections'; ``affinity``: also one input Hessian per expert for its gate and up. Names as
    fq.allocation.measure.weights'; every other Hessian stays the all-experts capture's."""
    from fq.hessian import affinity
    from fq.model.families import for_config

    config = json.loads((src / "config.json").read_text())
    kind = affinity.check_weighting(for_config(config, str(src)), weighting, str(src)).router_score
    sums: dict[str, list] = {}

    def add(name, v, c):
        acc = sums.setdefault(name, [torch.zeros(v.shape[1], v.shape[1], dtype=torch.float64), 0.0])
        acc[0] += (v * c[:, None]).T @ v
        acc[1] += float(c.sum())

    routers, handles, origs = {}, [], []
    for name, mod in model.named_modules():
        if not (hasattr(mod, "gate_up_proj") and mod.gate_up_proj.dim() == 3):
            continue
        gate = model.get_submodule(name.rsplit(".", 1)[0]).gate
        handles.append(gate.register_forward_hook(lambda m, i, o, name=name: routers.__setitem__(name, o)))

        def fwd(hidden_states, top_k_index, top_k_weights, mod=mod, name=name, orig=mod.forward):
            logits, applied = affinity.router_outputs(routers[name])
            score = affinity.scores(logits, applied, routers[name][2], kind, name)
            x = hidden_states.detach().double()
            I = mod.gate_up_proj.shape[1] // 2
            for e in range(mod.gate_up_proj.shape[0]):
                c = score[:, e]
                gu = torch.nn.functional.linear(hidden_states.detach(), mod.gate_up_proj[e].detach())
                add(f"{name}.{e}.down_proj", (mod.act_fn(gu[..., :I]) * gu[..., I:]).double(), c)
                if weighting == "affinity":
                    add(f"{name}.{e}.gate_up", x, c)
            return orig(hidden_states, top_k_index, top_k_weights)

        origs.append((mod, mod.forward))
        mod.forward = fwd
    try:
        with torch.no_grad():
            for i in range(windows.shape[0]):
                model(input_ids=windows[i: i + 1])
    finally:
        for h in handles:
            h.remove()
        for mod, f in origs:
            mod.forward = f
    out = {}
    for n, (acc, mass) in sums.items():
        H = acc / mass
        if n.endswith(".gate_up"):
            out.update({f"{n[:-len('gate_up')]}{p}": H for p in ("gate_proj", "up_proj")})
        else:
            out[n] = H
    return out


def allocations_from(build_json: Path, src: Path):
    """An earlier build's options, fit and allocations (its rows' K per unit), for encoding them again against other
    Hessians (``--weighting``): the same allocation, so the bytes match and the comparison is paired."""
    from types import SimpleNamespace

    doc = json.loads(build_json.read_text())
    if doc.get("model_config") != json.loads((src / "config.json").read_text()):
        raise SystemExit(f"{build_json}: model_config is not {src}'s config.json: --from-build takes a build of this model")
    options = {u: {_k(K): tuple(v) for K, v in o.items()} for u, o in doc["options"].items()}
    fit = {"efficiency": {_k(K): c for K, c in doc["efficiency"].items()},
           "injected": {u: {_k(K): v for K, v in p.items()} for u, p in doc["injected"].items()},
           "parts": {u: {_k(K): tuple(v) for K, v in p.items()} for u, p in doc["parts"].items()}}
    allocs, least_of = {}, {}
    for r in doc["rows"]:
        key = (r["error_model"], float(r["budget_bits"]))
        allocs[key] = SimpleNamespace(ks=r["ks"], bits=r["bits"], bytes=r["linear_bytes"], predicted_kl=r["predicted_kl"],
                                      gap_bound=r["gap_bound"])
        least_of[key] = r["least_K"]
    return options, doc["allocated_weights"], fit, allocs, least_of


def resolve(options, fit, n_weights, ks, bits, least_k):
    """The pooled solver (fq's) on an earlier build's measurement, with the candidates restricted to ``ks``."""
    from fq.allocation import solve
    from fq.allocation.document import LEAST_K

    least = LEAST_K if least_k is None else least_k
    sizes = {u: {K: v[1] for K, v in o.items() if K in ks} for u, o in options.items()}
    parts = {u: {K: p[K] for K in sizes[u]} for u, p in fit["parts"].items()}
    allocs, least_of = {}, {}
    for b in bits:
        s, lk = solve.solve_pooled(parts, sizes, solve.budget_from_bits(b, n_weights), n_weights, least)
        allocs[("pooled", b)], least_of[("pooled", b)] = s, lk
        print(f"pooled {b:g} bits (re-solved): {s.bits:.4f} bits, {s.bytes:,} B, predicted KL {s.predicted_kl:.5f}, "
              f"least K {lk}; K " + " ".join(f"{u}:{k}" for u, k in s.ks.items()), flush=True)
    return allocs, least_of


def _k(K: str):
    return float(K) if "." in K else int(K)


def build(a) -> int:
    from transformers import AutoModelForCausalLM

    from fq.allocation import units
    from fq.allocation.measure import hessians, weights
    from fq.codec.ldlq import encode_ldlq_batch
    from fq.commands.allocate import parse_ks

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    src, out = Path(a.model), Path(a.out) / "fq"
    out.mkdir(parents=True, exist_ok=True)
    ks, bits = parse_ks(a.ks), _floats(a.bits)
    clock = {}
    t0 = time.time()
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).to(dev).eval()
    cal_ids, tok_sha = tokenize(src, Path(a.cal_text).read_text())
    sens_w = token_windows(cal_ids, a.sens_cols, a.sens_rows * a.sens_cols).to(dev)
    hess_w = token_windows(cal_ids, a.hess_cols, a.hess_tokens).to(dev)
    if a.random_rows:  # the last fraction of each set of windows replaced by seeded uniform token ids, as
        # exllamav3's default calibration ends in random rows "to exercise the full vocabulary"
        vocab = int(model.config.vocab_size)
        gen = torch.Generator().manual_seed(a.seed)
        for w, on in ((hess_w, True), (sens_w, a.random_sens)):
            n = round(a.random_rows * w.shape[0])
            if on and n:
                w[-n:] = torch.randint(0, vocab, (n, w.shape[1]), generator=gen).to(w)
    clock["load"] = time.time() - t0

    if a.from_build:  # the allocations of an earlier build (same model, sensitivity windows and candidates)
        options, n_weights, fit, allocs, least_of = allocations_from(Path(a.from_build), src)
        if a.resolve:  # its measurement solved again: other candidates (--ks), floor (--least-k) or budgets (--bits)
            allocs, least_of = resolve(options, fit, n_weights, ks, bits, a.least_k)
    else:
        options, n_weights, fit, allocs, least_of = measure_and_solve(a, model, sens_w, ks, bits, clock)

    t0 = time.time()
    H = hessians(model, hess_w, dev)
    if a.weighting != "none":
        H.update(weighted_expert_hessians(model, hess_w, src, a.weighting))
    clock["hessians"] = time.time() - t0
    W = weights(model)
    names = sorted(W)
    seed_of = {n: a.seed * 1_000_003 + i for i, n in enumerate(names)}
    groups = units.group_units(W)
    # linears of one input width and K are encoded together, each in its own Hessian's metric (a layer's routed
    # gate/up share one: the all-experts capture gives every expert the same inputs)
    need: dict[tuple, list[str]] = {}  # (K, in_features) -> linears
    for s in allocs.values():
        for u, K in s.ks.items():
            for n in groups[u]:
                lst = need.setdefault((K, W[n].shape[1]), [])
                if n not in lst:
                    lst.append(n)
    H = shared_hessians(H)
    enc: dict[tuple[str, int], object] = {}
    t0 = time.time()
    done = 0
    total = sum(len(v) for v in need.values())
    for (K, _), ns in sorted(need.items()):
        res = encode_ldlq_batch([W[n].double() for n in ns], [H[n] for n in ns], K, CODEBOOK,
                                seeds=[seed_of[n] for n in ns], device=dev, names=ns)
        for n, e in zip(ns, res):
            enc[(n, K)] = e
        done += len(ns)
        print(f"\rencoded {done}/{total} ({time.time() - t0:.0f} s)", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    clock["encode"] = time.time() - t0
    del H

    source = source_tensors(src)
    checks = {}
    for spec in a.check_cpu or []:  # NAME=PATH: held-out text, each directory's KL in transformers on it
        name, path = spec.split("=", 1)
        ids, _ = tokenize(src, Path(path).read_text())
        w = token_windows(ids, 256, a.check_tokens)
        checks[name] = (w, log_probs(model, w, dev))
    rows = []
    for (model_kind, b), s in allocs.items():
        ks_of = {n: s.ks[u] for u, ns in groups.items() for n in ns}
        coded = {n: enc[(n, K)].tensors for n, K in ks_of.items()}
        head_k = s.ks.get("head")
        qc = {"quant_method": "exl3", "version": "fq-allocation-benchmark", "bits": round(s.bits, 4),
              "head_bits": head_k, "calibration": {"rows": hess_w.shape[0], "cols": hess_w.shape[1]},
              "codebook": CODEBOOK, "allocation": s.ks, "error_model": model_kind}
        tag = f"b{b:g}" if model_kind == a.models.split(",")[0] else f"{model_kind}-b{b:g}"
        dd = out / tag
        if dd.exists():
            shutil.rmtree(dd)
        nbytes = write_exl3_dir(src, dd, coded, qc, source)
        row = {"name": f"fq {tag}", "dir": dd.name, "error_model": model_kind, "budget_bits": b, "bits": s.bits,
               "linear_bytes": s.bytes, "bytes": nbytes, "predicted_kl": s.predicted_kl, "gap_bound": s.gap_bound,
               "least_K": least_of[(model_kind, b)], "ks": s.ks,
               "proxy_err": {n: enc[(n, K)].proxy_err for n, K in sorted(ks_of.items())}}
        if checks:
            # the weights as read back from the written file (fq's decoder), not the encoder's own W_hat
            row["check"] = {}
            for name, per in window_kl(model, dd, W, checks, dev).items():
                per = per.mean(-1)  # per window
                row["check"][name] = {"kl": float(per.mean()), "windows": [round(float(x), 9) for x in per]}
            print(f"{row['name']}: transformers KL " + " ".join(f"{k} {v['kl']:.5f}" for k, v in row["check"].items()),
                  flush=True)
        rows.append(row)
        print(f"{row['name']}: {nbytes:,} B in {dd}", flush=True)
    doc = {"model": str(src), "model_config": json.loads((src / "config.json").read_text()),
           "tokenizer_sha256": tok_sha, "codebook": CODEBOOK, "ks": ks, "samples": a.samples, "seed": a.seed,
           "sensitivity_windows": list(sens_w.shape), "hessian_windows": list(hess_w.shape),
           "random_rows": a.random_rows, "random_sens": a.random_sens,
           "weighting": a.weighting, "from_build": a.from_build, "resolve": a.resolve,
           "allocated_weights": n_weights, "device": str(dev), "seconds": {k: round(v, 2) for k, v in clock.items()},
           "options": {u: {str(K): list(v) for K, v in o.items()} for u, o in options.items()},
           "injected": {u: {str(K): kl for K, kl in p.items()} for u, p in fit["injected"].items()},
           "parts": {u: {str(K): list(v) for K, v in p.items()} for u, p in fit["parts"].items()},
           "efficiency": {str(K): c for K, c in fit["efficiency"].items()}, "rows": rows}
    if checks:
        doc["check_cpu"] = {name: {"windows": list(w.shape)} for name, (w, _) in checks.items()}
    _write_json(out / "build.json", doc)
    return 0


# ---------------------------------------------------------------------------------------------------------- measure

def tokenize(src: Path, text: str) -> tuple[list[int], str]:
    """Token ids of ``text`` with the source's tokenizer.json (as fq.runtime.evaluate.tokenize, without its imports
    of fq's provenance layer, which the device machine need not have); and that file's sha256."""
    from tokenizers import Tokenizer

    data = (Path(src) / "tokenizer.json").read_bytes()
    ids = Tokenizer.from_str(data.decode("utf-8")).encode(text, add_special_tokens=False).ids
    return ids, hashlib.sha256(data).hexdigest()


def text_windows(src: Path, text: Path, tokens: int, seq: int) -> torch.Tensor:
    ids, _ = tokenize(src, text.read_text())
    return token_windows(ids, seq, tokens)


def stats(kl: torch.Tensor, n_windows: int) -> dict:
    """kl: per position (windows x seq flattened): mean, SE over positions, SE over windows, per-window means."""
    from exl3_whole_model import mean_se

    m, se = mean_se(kl)
    w = kl.reshape(n_windows, -1).mean(1)
    _, se_w = mean_se(w)
    return {"kl": m, "se_pos": se, "se_win": se_w, "windows": [round(float(x), 9) for x in w]}


def measure(a) -> int:
    from exl3_whole_model import converter_source, convert, exl3_logprobs, kl_per_position, source_logprobs, \
        tensor_bytes

    src, out = Path(a.model), Path(a.out)
    if a.fq and not (Path(a.fq) / "build.json").is_file():  # before any conversion starts: nothing to compare
        raise SystemExit(f"{a.fq}/build.json: no fq build there (run build first)")
    out.mkdir(parents=True, exist_ok=True)
    texts = dict(t.split("=", 1) for t in a.text)
    wins = {k: text_windows(src, Path(p), a.tokens, a.seq) for k, p in texts.items()}
    if torch.cuda.is_available():
        refs = {k: source_logprobs(src, w) for k, w in wins.items()}
    else:  # the CPU dry run (--skip-exl3)
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        refs = {k: log_probs(model, w, "cpu").float() for k, w in wins.items()}
    doc = {"model": str(src), "seq": a.seq, "texts": {k: {"path": p, "windows": int(wins[k].shape[0]),
                                                           "positions": int(wins[k].numel())} for k, p in texts.items()},
           "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "rows": []}
    if a.skip_exl3:
        ex = None
    else:
        import exllamav3 as ex
        doc["exllamav3"] = getattr(ex, "__version__", "?")

    def score(name: str, kind: str, d: Path, extra: dict) -> None:
        t0 = time.time()
        row = {"name": name, "kind": kind, "dir": str(d), "bytes": tensor_bytes(d), **extra, "texts": {}}
        for k, w in wins.items():
            got = exl3_logprobs(ex, d, w) if ex is not None else refs[k]
            row["texts"][k] = stats(kl_per_position(refs[k], got), w.shape[0])
        row["eval_seconds"] = round(time.time() - t0, 2)
        doc["rows"].append(row)
        _write_json(out / "measure.json", doc)
        print(f"{name}: {row['bytes']:,} B " + " ".join(f"{k} KL {v['kl']:.5f} ± {v['se_win']:.5f}"
                                                       for k, v in row["texts"].items()), flush=True)

    # --scratch keeps the conversions between calls (a device call is at most 10 minutes): a finished one is scored
    # again without converting, an interrupted one resumes from its work directory (the converter's own -r)
    keep = a.scratch is not None
    scratch = Path(a.scratch) if keep else Path(tempfile.mkdtemp(prefix="alloc-exl3-"))
    scratch.mkdir(parents=True, exist_ok=True)
    conv_src = converter_source(src, scratch)
    bs, hqs = [("b", b) for b in _floats(a.b)], [("hq", b) for b in _floats(a.hq)]
    jobs = [j for pair in zip(bs, hqs) for j in pair] + bs[len(hqs):] + hqs[len(bs):]  # alternately
    pool = ThreadPoolExecutor(max_workers=max(1, a.parallel)) if jobs and ex is not None else None

    def job(kind, b):
        label = f"exllamav3 -b {b:g}" + (" -hq" if kind == "hq" else "")
        tag = label.replace(" ", "_")
        t0 = time.time()
        d, work, done = scratch / tag, scratch / (tag + "-work"), scratch / (tag + ".done")
        if done.is_file():  # converted by an earlier call: its time then
            return label, kind, b, d, float(done.read_text())
        args = ["-r"] if (work / "args.json").is_file() else ["-b", f"{b:g}"] + (["-hq"] if kind == "hq" else [])
        convert(conv_src, d, work, args, scratch / f"{tag}.log")
        secs = time.time() - t0
        if keep:
            done.write_text(f"{secs:.1f}")
        return label, kind, b, d, secs

    def logs():  # the converter's logs so far, one after another
        with open(out / "convert.log", "w") as f:
            for log in sorted(scratch.glob("*.log")):
                f.write(f"===== {log.name}\n{log.read_text(errors='replace')}\n")

    futures = [pool.submit(job, k, b) for k, b in jobs] if pool else []
    # while the converter runs: the runtime floor (the source itself through exllamav3) and fq's directories
    score("source (exllamav3, 16-bit)", "source", conv_src, {})
    fq_build = json.loads((Path(a.fq) / "build.json").read_text()) if a.fq else {"rows": []}
    for r in fq_build["rows"]:
        score(r["name"], "fq", Path(a.fq) / r["dir"], {"bits": r["bits"], "budget_bits": r["budget_bits"],
                                                        "predicted_kl": r["predicted_kl"], "ks": r["ks"]})
    for f in as_completed(futures):  # scored as they finish: a run cut short keeps every finished conversion
        try:
            label, kind, b, d, secs = f.result()
        except Exception as e:  # a failed conversion is reported, the others still measured
            print(f"conversion failed: {e}", flush=True)
            for log in sorted(scratch.glob("*.log")):
                print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-15:]), flush=True)
            doc.setdefault("failed", []).append(str(e))
            continue
        score(label, kind, d, {"b": b, "convert_seconds": round(secs, 1)})
        logs()
        if not keep:
            shutil.rmtree(d, ignore_errors=True)
    if pool:
        pool.shutdown()
    logs()
    if not keep:
        shutil.rmtree(scratch, ignore_errors=True)
    _write_json(out / "measure.json", doc)
    return 0


# ----------------------------------------------------------------------------------------------------------- report

def check(a) -> int:
    """Every directory of a build (its build.json rows) scored in transformers on the CPU as ``measure`` scores
    them in exllamav3: KL(source || directory) per position on each held-out ``--text``, written as a measure.json
    (``report`` reads it beside exllamav3's conversions measured on a GPU: fq's side in transformers, float32)."""
    from transformers import AutoModelForCausalLM

    from fq.allocation.measure import weights

    if a.threads:
        torch.set_num_threads(a.threads)
    dev = torch.device("cpu")
    src, fq_dir = Path(a.model), Path(a.fq)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    W = weights(model)
    checks, texts = {}, {}
    for spec in a.text:
        name, path = spec.split("=", 1)
        w = text_windows(src, Path(path), a.tokens, a.seq)
        checks[name] = (w, log_probs(model, w, dev))
        texts[name] = {"path": path, "positions": int(w.numel()), "windows": int(w.shape[0])}
    doc = {"device": "cpu: fq's directories in transformers (float32), fq's decoder", "model": str(src),
           "seq": a.seq, "texts": texts, "rows": []}
    todo = [(row["name"], "fq", fq_dir / row["dir"], row["bits"])
            for row in json.loads((fq_dir / "build.json").read_text())["rows"]]
    todo += [(name, "base", Path(d), None) for name, d in (spec.split("=", 1) for spec in a.base or [])]
    for name, kind, dd, bits in todo:
        t0 = time.time()
        per = window_kl(model, dd, W, checks, dev)
        doc["rows"].append({"name": name, "kind": kind, "dir": str(dd), "bits": bits,
                            "bytes": sum(f.stat().st_size for f in dd.glob("*.safetensors")),
                            "eval_seconds": round(time.time() - t0, 2),
                            "texts": {n: stats(kl.flatten(), kl.shape[0]) for n, kl in per.items()}})
        print(f"{name}: " + " ".join(f"{n} {v['kl']:.5f}" for n, v in doc["rows"][-1]["texts"].items()),
              flush=True)
    _write_json(Path(a.out), doc)
    return 0


def _se(x: list[float]) -> float:
    n = len(x)
    m = sum(x) / n
    return math.sqrt(sum((v - m) ** 2 for v in x) / (n - 1) / n)


END_TOLERANCE = 0.01


def interpolate(curve: list[dict], text: str, nbytes: int):
    """The curve (rows of one converter mode) at ``nbytes``: log KL linear in bytes between the two neighbouring
    conversions; within 1% of bytes past an end, that end's KL; (KL, weights {row name: w}) or None further out."""
    pts = sorted(curve, key=lambda r: r["bytes"])
    for lo, hi in zip(pts, pts[1:]):
        if lo["bytes"] <= nbytes <= hi["bytes"] and hi["bytes"] > lo["bytes"]:
            w = (nbytes - lo["bytes"]) / (hi["bytes"] - lo["bytes"])
            kl = math.exp((1 - w) * math.log(lo["texts"][text]["kl"]) + w * math.log(hi["texts"][text]["kl"]))
            return kl, {lo["name"]: 1 - w, hi["name"]: w}
    for p in (pts[0], pts[-1]):  # just past an end of the curve (within END_TOLERANCE of its bytes): that end
        if abs(p["bytes"] - nbytes) <= END_TOLERANCE * p["bytes"]:
            return p["texts"][text]["kl"], {p["name"]: 1.0}
    return None


def ratio_se(fq_row: dict, weights: dict, rows: dict, text: str) -> float:
    """SE of log(fq KL / interpolated KL), delta method on the per-window means (paired: the same windows)."""
    f = fq_row["texts"][text]
    z = [x / f["kl"] for x in f["windows"]]
    for name, w in weights.items():
        r = rows[name]["texts"][text]
        z = [zi - w * x / r["kl"] for zi, x in zip(z, r["windows"])]
    return _se(z)


def report(a) -> int:
    rows = []
    meta = {}
    for p in a.measure:
        d = json.loads(Path(p).read_text())
        meta = {k: v for k, v in d.items() if k != "rows"}
        seen = {r["name"] for r in rows}
        rows += [r for r in d["rows"] if r["name"] not in seen]
    by_name = {r["name"]: r for r in rows}
    fq_rows = sorted((r for r in rows if r["kind"] == "fq"), key=lambda r: r["bytes"])
    curves = {k: [r for r in rows if r["kind"] == k] for k in ("b", "hq", "base")}
    floor = next((r for r in rows if r["kind"] == "source"), None)
    result = {"meta": meta, "rows": rows, "comparison": {}}
    for text in meta["texts"]:
        table = []
        for fr in fq_rows:
            ent = {"name": fr["name"], "bytes": fr["bytes"], "bits": fr.get("bits"),
                   "kl": fr["texts"][text]["kl"], "se_win": fr["texts"][text]["se_win"]}
            best = None
            for k, curve in curves.items():
                if not curve:
                    continue
                near = min(curve, key=lambda r: abs(r["bytes"] - fr["bytes"]))
                d = [x - y for x, y in zip(fr["texts"][text]["windows"], near["texts"][text]["windows"])]
                ent[f"{k}_nearest"] = {"name": near["name"], "bytes_ratio": fr["bytes"] / near["bytes"],
                                       "kl": near["texts"][text]["kl"], "paired_diff": sum(d) / len(d),
                                       "paired_se": _se(d)}
                it = interpolate(curve, text, fr["bytes"])
                if it is None:  # fq's size outside the curve's range: no interpolation
                    ent[k] = None
                    continue
                kl, w = it
                s = ratio_se(fr, w, by_name, text)
                ratio = ent["kl"] / kl
                ent[k] = {"kl": kl, "from": w, "ratio": ratio, "ratio_se": ratio * s}
                if k != "base" and (best is None or kl < best[1]):  # exllamav3's best; base: fq's own recipes
                    best = (k, kl)
            if best is not None:
                ent["best"] = best[0]
                ent["ratio_best"] = ent["kl"] / best[1]
                ent["ratio_best_se"] = ent[best[0]]["ratio_se"]
                ent["goal_met"] = ent["ratio_best"] <= 0.8
            table.append(ent)
        result["comparison"][text] = table
        print(f"\n### {text} ({meta['texts'][text]['positions']} positions; runtime floor "
              f"{floor['texts'][text]['kl']:.2e})" if floor else f"\n### {text}")
        print("| fq allocation | bytes | fq KL ± SE | exllamav3 -b (interp.) | -b -hq (interp.) | fq / best ± SE |"
              " nearest -b: paired ΔKL ± SE (size) | nearest -b -hq: paired ΔKL ± SE (size) |")
        print("| --- | ---: | --- | --- | --- | --- | --- | --- |")
        for e in table:
            def cell(k):
                return "—" if e.get(k) is None else f"{e[k]['kl']:.3e}"
            def near(k):
                nb = e.get(f"{k}_nearest")
                return (f"{nb['name'].removeprefix('exllamav3 ')}: {nb['paired_diff']:+.2e} ± {nb['paired_se']:.1e} "
                        f"({nb['bytes_ratio']:.3f})") if nb else "—"
            rb = f"**{e['ratio_best']:.2f}** ± {e['ratio_best_se']:.2f}" if "ratio_best" in e else "—"
            print(f"| {e['name']} ({e['bits']:.3f} bits) | {e['bytes']:,} | {e['kl']:.3e} ± {e['se_win']:.1e} | "
                  f"{cell('b')} | {cell('hq')} | {rb} | {near('b')} | {near('hq')} |")
        if curves["base"]:
            print("\n| fq allocation | bytes | fq KL | hand-made recipes (`--base`, interp.) | fq / recipes ± SE | "
                  "nearest recipe: paired ΔKL ± SE (size) |")
            print("| --- | ---: | --- | --- | --- | --- |")
            for e in table:
                rr = "—" if e.get("base") is None else f"**{e['base']['ratio']:.2f}** ± {e['base']['ratio_se']:.2f}"
                print(f"| {e['name']} | {e['bytes']:,} | {e['kl']:.3e} | {cell('base')} | {rr} | {near('base')} |")
    if a.json:
        _write_json(Path(a.json), result)
    if a.plot:
        plot(rows, meta, Path(a.plot), a.title)
    return 0


def plot(rows: list[dict], meta: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    texts = list(meta["texts"])
    fig, axes = plt.subplots(1, len(texts), figsize=(6.2 * len(texts), 4.6), squeeze=False)
    style = {"fq": ("o-", "C3", "fq (measured-sensitivity allocation, LDLQ)"), "b": ("s--", "C0", "exllamav3 -b"),
             "hq": ("^--", "C2", "exllamav3 -b -hq"), "base": ("D:", "C1", "fq, hand-made recipes (--base)")}
    for ax, text in zip(axes[0], texts):
        for kind, (fmt, col, label) in style.items():
            pts = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["bytes"])
            if not pts:
                continue
            x = [r["bytes"] / 1e6 for r in pts]
            y = [r["texts"][text]["kl"] for r in pts]
            e = [r["texts"][text]["se_win"] for r in pts]
            ax.errorbar(x, y, yerr=e, fmt=fmt, color=col, label=label, ms=4, capsize=2)
        fl = next((r for r in rows if r["kind"] == "source"), None)
        if fl:
            ax.axhline(fl["texts"][text]["kl"], color="gray", lw=0.8, ls=":", label="source through exllamav3 (floor)")
        ax.set_yscale("log")
        ax.set_xlabel("stored bytes (MB, *.safetensors)")
        ax.set_ylabel("KL(source || quantized), nats/position")
        ax.set_title(f"{title}: held-out '{text}' ({meta['texts'][text]['positions']} positions)", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("model")
    b.add_argument("cal_text")
    b.add_argument("out")
    b.add_argument("--bits", default="2,2.5,3,4,5")
    b.add_argument("--ks", default="1-8")
    b.add_argument("--device", default="cpu")
    b.add_argument("--least-k", type=float, default=None, help="fq allocate's floor: K >= this where a budget allows")
    b.add_argument("--sens-rows", type=int, default=16)
    b.add_argument("--sens-cols", type=int, default=128)
    b.add_argument("--samples", type=int, default=8)
    b.add_argument("--hess-cols", type=int, default=512)
    b.add_argument("--hess-tokens", type=int, default=65536)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--random-rows", type=float, default=0.0,
                   help="fraction of the Hessian windows replaced by seeded random token ids (exllamav3's default "
                        "calibration: about 0.15)")
    b.add_argument("--random-sens", action="store_true", help="--random-rows also in the sensitivity windows")
    b.add_argument("--threads", type=int, default=0)
    b.add_argument("--weighting", default="none", choices=("none", "affinity-down", "affinity"),
                   help="the routed experts' Hessians under the campaign's calibration.weighting (fq.hessian.affinity)")
    b.add_argument("--from-build", help="an earlier build.json of this model: its allocations, not measured again")
    b.add_argument("--resolve", action="store_true", help="with --from-build: solve its measurement again at --bits "
                   "with the candidates --ks and floor --least-k")
    b.add_argument("--check-cpu", action="append", help="NAME=PATH of held-out text (repeatable): also measure the "
                   "built weights' KL in transformers there, per window")
    b.add_argument("--models", default="pooled",
                   help="error models to solve with, comma-separated (fisher, additive, pooled; the first names b*)")
    b.add_argument("--check-tokens", type=int, default=4096)
    m = sub.add_parser("measure")
    m.add_argument("model")
    m.add_argument("out")
    m.add_argument("--fq", help="build's OUT/fq (build.json and the directories)")
    m.add_argument("--text", action="append", required=True, help="NAME=PATH of held-out text (repeatable)")
    m.add_argument("--b", default="", help="exllamav3 -b values")
    m.add_argument("--hq", default="", help="exllamav3 -b values with -hq")
    m.add_argument("--parallel", type=int, default=4)
    m.add_argument("--scratch", help="keep the conversions here (reused, or resumed, by a later call); default: a "
                                     "temporary directory removed at the end")
    m.add_argument("--tokens", type=int, default=32768)
    m.add_argument("--seq", type=int, default=256)
    m.add_argument("--skip-exl3", action="store_true", help="no exllamav3 (a dry run of the plumbing on the CPU)")
    c = sub.add_parser("check")
    c.add_argument("model")
    c.add_argument("fq", help="build's OUT/fq (build.json and the directories)")
    c.add_argument("out", help="the measure.json to write")
    c.add_argument("--text", action="append", required=True, help="NAME=PATH of held-out text (repeatable)")
    c.add_argument("--base", action="append", help="NAME=DIR: another EXL3 directory scored the same way (kind base: "
                   "e.g. a campaign's published whole-model base of a hand-made recipe), a curve fq's rows are read "
                   "against beside exllamav3's")
    c.add_argument("--tokens", type=int, default=32768)
    c.add_argument("--seq", type=int, default=256)
    c.add_argument("--threads", type=int, default=0)
    r = sub.add_parser("report")
    r.add_argument("measure", nargs="+")
    r.add_argument("--json")
    r.add_argument("--plot")
    r.add_argument("--title", default="demo model")
    a = ap.parse_args(argv)
    return {"build": build, "measure": measure, "check": check, "report": report}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
