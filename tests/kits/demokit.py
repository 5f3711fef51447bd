"""A smaller checkpoint cut from fq's embedded demo model, for campaign tests whose claims do not depend on its
size: the demo's trained weights, tokenizer and text, with ``experts`` routed experts in each MoE layer, the ones
the demo routes most tokens to (its recorded usage), numbered 0.. in their demo order, their router rows and
score-correction biases kept with them (``n_routed_experts`` set to the count). Laid out in the demo's four shards
(``shard_of``: one of them straddles the demo's window partition 1 | 2). Each routed expert is three matrices of
every base and stage node, so a campaign on it encodes ``experts / 8`` of the demo's routed-expert matrices;
everything else (attention, the shared experts, the dense layer, the head, the calibration chain's layers) is the
demo's.

    write(out, experts=4) -> ``out``: the checkpoint directory ``out/model`` (a ``source: {kind: local}``), the
        demo's text splits in ``out/text`` (``calibration.txt``, ``heldout.txt``, ``train.txt``) and the expert
        usage recorded with the demo in ``out/usage.json``, the kept experts' counts (so the same hottest ones)
    kept(experts) -> {layer: the demo's experts kept, in order}
    local_source(out) -> a campaign config's ``source:`` for it (named REPO)
    full_demo(d) -> (d/model, d/calibration.txt): the demo checkpoint itself and its calibration split
    calibration_tokens(model, text, rows, cols) -> fq.hessian.calibration.CalibrationTokens of that text

Pure file work (fq's safetensors reader and writer, no torch): well under a second.
"""
from __future__ import annotations

import json
from pathlib import Path

from fq.core import canonical
from fq.model import demo_model as dm
from fq.model.shards import RawTensor, encode_header

EXPERTS = 4
REPO = "fq-demo-4-experts"  # the name a campaign gives it (source.repo: its bases' model cards' base_model)
ROUTER = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")  # a row per expert (float32)


def kept(experts: int = EXPERTS) -> dict[int, list[int]]:
    """layer -> the demo's ``experts`` most used experts of that MoE layer (ties to the lower index), in order."""
    if not 2 <= experts <= dm.N_EXPERTS:
        raise ValueError(f"experts: {experts}, expected 2..{dm.N_EXPERTS} (the demo routes each token to 2)")
    out = {}
    for layer, counts in dm.usage()["layers"].items():
        ranked = sorted(range(len(counts)), key=lambda e: (-counts[e], e))
        out[int(layer)] = sorted(ranked[:experts])
    return out


def shard_of(name: str, experts: int) -> int:
    """The demo's four shards (fq.model.demo_model._shard_of), their expert boundaries scaled to ``experts`` (new
    numbering): 1 skeleton only; 2 layer 1 but its last quarter of experts; 3 those and the first half of layer 2's
    (straddling the demo's window partition 1 | 2); 4 the rest of layer 2 and lm_head."""
    if ".mlp.experts." not in name:
        return dm._shard_of(name)
    layer, expert = int(name.split(".")[2]), int(name.split(".")[5])
    if layer == 1:
        return 3 if expert >= experts - max(1, experts // 4) else 2
    return 3 if expert < experts // 2 else 4


def _cut(t: RawTensor, keep: dict[int, list[int]]) -> RawTensor | None:
    """``t`` in the smaller checkpoint: a kept routed expert under its new number, None for the others, a router's
    weight or bias with the kept experts' rows; any other tensor as it is."""
    parts = t.name.split(".")
    if ".mlp.experts." in t.name:
        layer, at = int(parts[2]), parts.index("experts") + 1
        if int(parts[at]) not in keep[layer]:
            return None
        parts[at] = str(keep[layer].index(int(parts[at])))
        return RawTensor(".".join(parts), t.dtype, t.shape, t.data)
    if t.name.endswith(ROUTER):
        rows = keep[int(parts[2])]
        n = len(t.data) // t.shape[0]
        return RawTensor(t.name, t.dtype, (len(rows), *t.shape[1:]), b"".join(bytes(t.data[e * n:(e + 1) * n])
                                                                            for e in rows))
    return t


def checkpoint_files(experts: int = EXPERTS) -> dict[str, bytes]:
    """name -> bytes of the smaller checkpoint (deterministic)."""
    d = dm.data()
    keep = kept(experts)
    tensors = sorted((c for t in dm._tensors(d[dm.WEIGHTS], dm.WEIGHTS) if (c := _cut(t, keep)) is not None),
                     key=lambda t: t.name)
    by_shard: dict[int, list[RawTensor]] = {}
    for t in tensors:
        by_shard.setdefault(shard_of(t.name, experts), []).append(t)
    names = {i: f"model-{n:05d}-of-{len(by_shard):05d}.safetensors" for n, i in enumerate(sorted(by_shard), 1)}
    out = {names[i]: encode_header(ts, {"format": "pt"}) + b"".join(bytes(t.data) for t in ts)
           for i, ts in by_shard.items()}
    weight_map = {t.name: names[shard_of(t.name, experts)] for t in tensors}
    out["model.safetensors.index.json"] = canonical.pretty(
        {"metadata": {"total_size": sum(len(t.data) for t in tensors)}, "weight_map": weight_map}).encode()
    for name in dm.SIDE_FILES:
        out[name] = d[name]
    config = json.loads(d["config.json"])
    config["n_routed_experts"] = experts
    out["config.json"] = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    return out


def usage(experts: int = EXPERTS) -> dict:
    """The demo's recorded expert usage, the kept experts' counts."""
    doc, keep = dm.usage(), kept(experts)
    return dict(doc, description=f"{doc['description']}; its {experts} most used experts a layer "
                                 "(tests/kits/demokit.py)",
                layers={layer: [counts[e] for e in keep[int(layer)]] for layer, counts in doc["layers"].items()})


def write(out: Path, experts: int = EXPERTS) -> Path:
    out = Path(out)
    model = out / "model"
    model.mkdir(parents=True)
    for name, b in checkpoint_files(experts).items():
        (model / name).write_bytes(b)
    dm.write_text(out / "text")
    (out / "usage.json").write_text(canonical.pretty(usage(experts)))
    return out


def local_source(out: Path) -> dict:
    return {"kind": "local", "path": str(Path(out) / "model"), "repo": REPO, "revision": "demo-1"}


def full_demo(d: Path) -> tuple[Path, Path]:
    """The demo checkpoint itself (not cut) in ``d/model``, and its calibration split in ``d/calibration.txt``."""
    model = dm.write(Path(d) / "model")
    text = Path(d) / "calibration.txt"
    text.write_bytes(dm.text("calibration").encode("utf-8"))
    return model, text


def calibration_tokens(model: Path, text: Path, rows: int, cols: int):
    """``rows`` x ``cols`` tokens of ``text`` by ``model``'s tokenizer, named by the text's sha256 as a campaign
    names it."""
    import hashlib

    from fq.hessian import calibration

    return calibration.from_text(text, hashlib.sha256(text.read_bytes()).hexdigest(), model, rows, cols)
