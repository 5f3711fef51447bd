"""Expert-usage statistics (fq-expert-usage/1): how often each routed expert was selected, per layer.

A stage with ``{"hot": N}`` encodes the N most used experts of each layer. Ranking is by count,
ties broken by the lower expert index, so the same file always selects the same experts, and the
N hottest are always within the M hottest for N <= M (a hot stage under a hot parent nests).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from fq.core import canonical
from fq.core.safepath import describe_mode, sha256_file
from fq.core.schema_check import validate
from fq.errors import FqError

FORMAT = "fq-expert-usage/1"


@dataclass(frozen=True, eq=False)
class ExpertUsage:
    counts: Mapping[int, tuple[float, ...]]  # layer -> count per expert index
    sha256: str  # of the canonical document; part of a plan's run identity
    source: str

    def hottest(self, layer: int, n: int, n_experts: int) -> tuple[int, ...]:
        """The ``n`` most used experts of ``layer``, sorted by expert index."""
        if layer not in self.counts:
            raise FqError(f"expert usage {self.source}: no counts for layer {layer} "
                          f"(has layers {', '.join(str(l) for l in sorted(self.counts))})")
        counts = self.counts[layer]
        if len(counts) != n_experts:
            raise FqError(f"expert usage {self.source}: layers.{layer} has {len(counts)} counts; "
                          f"expected one per expert ({n_experts})")
        ranked = sorted(range(n_experts), key=lambda e: (-counts[e], e))
        return tuple(sorted(ranked[:n]))


def parse_usage(doc, source: str = "<usage>") -> ExpertUsage:
    validate(doc, "expert-usage", f"expert usage {source}")
    counts = {int(k): tuple(v) for k, v in doc["layers"].items()}
    return ExpertUsage(counts=counts, sha256=canonical.sha256_hex(canonical.dumps(doc)), source=source)


def load_usage(path: str | Path) -> ExpertUsage:
    path = Path(path)
    return parse_usage(canonical.load(path), str(path))


# -- measuring: route real text through the model ----------------------------------------------------
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def _layer_of(module_name: str, layers: str | None = None) -> int | None:
    """The decoder layer a module belongs to; ``layers``: the family layout's layers prefix (``model.layers.``, a
    vision-language model's ``model.language_model.layers.``), which transformers' module names share with the
    checkpoint's tensor names."""
    m = re.match(re.escape(layers) + r"(\d+)\.", module_name) if layers else _LAYER.search(module_name)
    return int(m.group(1)) if m else None


def routers(model, layers: str | None = None) -> dict[int, object]:
    """layer -> router module of a transformers 5.x MoE model: the ``*TopkRouter``/``*TopKRouter`` modules
    (GLM-4-MoE, GLM-5, DeepSeek-V3, Qwen3-MoE, Mixtral), AFMoE's ``AfmoeTokenChoiceRouter`` and DeepSeek-V4's
    ``DeepseekV4HashRouter`` (its first layers pick experts by token id), whose forward returns (logits, weights,
    indices).
    ``layers``: the layers prefix of the family's layout (``fq.model.experts.ExpertLayout.layers``); a router
    outside it (a head that is not one of the decoder's layers) is not counted."""
    out = {}
    for name, mod in model.named_modules():
        cls = type(mod).__name__
        if cls.endswith(("TopkRouter", "TopKRouter", "TokenChoiceRouter", "HashRouter")):
            if layers and not name.startswith(layers):
                continue
            layer = _layer_of(name, layers)
            if layer is None or layer in out:
                raise FqError(f"router {name} ({cls}): cannot tell its layer, or a second router in that layer")
            out[layer] = mod
    if not out:
        raise FqError(f"{type(model).__name__}: no router module (a *TopkRouter, as transformers 5.x MoE models have) found")
    return out


def count_selections(model, ids, *, seq_len: int = 256, batch: int = 8, progress: bool = False,
                     layers: str | None = None) -> dict[int, list[int]]:
    """Route the token stream ``ids`` through ``model`` in windows of ``seq_len`` (every token once, each
    window its own context) and count, per MoE layer, how often each expert is among a token's top-k."""
    import torch

    rs = routers(model, layers)
    # the router's own weight [experts, hidden], or AFMoE's, a linear inside it (router.gate)
    n_experts = {L: int((r.weight if hasattr(r, "weight") else r.gate.weight).shape[0]) for L, r in rs.items()}
    counts = {L: torch.zeros(n, dtype=torch.int64) for L, n in n_experts.items()}
    handles = []
    for L, r in rs.items():
        def hook(_mod, _inp, out, L=L):
            idx = out[-1]
            counts[L] += torch.bincount(idx.reshape(-1).to(torch.int64), minlength=n_experts[L])
        handles.append(r.register_forward_hook(hook))
    ids = torch.as_tensor(list(ids), dtype=torch.int64)
    windows = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(ids), unit="tok", desc="routing")
    try:
        with torch.no_grad():
            for i in range(0, len(windows), batch):
                group = windows[i:i + batch]
                for n in sorted({len(w) for w in group}):  # the last window may be shorter
                    model(input_ids=torch.stack([w for w in group if len(w) == n]))
                if bar:
                    bar.update(sum(len(w) for w in group))
    finally:
        for h in handles:
            h.remove()
        if bar:
            bar.close()
    return {L: c.tolist() for L, c in sorted(counts.items())}


def check_checkpoint_dir(model_dir: str | Path, what: str = "model") -> Path:
    """``model_dir`` is a local checkpoint directory. Checked first: transformers takes a path that is not a
    directory for a hub repo id (a minute of network attempts, then a traceback)."""
    d = Path(model_dir)
    if not d.exists():
        raise FqError(f"{what} {model_dir}: no such directory (a checkpoint on disk is measured; a path is never "
                      f"taken for a hub repo id: download the repo first)")
    if not d.is_dir():
        kind = "a regular file" if d.is_file() else describe_mode(d.stat().st_mode)
        raise FqError(f"{what} {model_dir}: is {kind}, not a checkpoint directory")
    if not (d / "config.json").is_file():
        raise FqError(f"{what} {model_dir}: no config.json; expected a Hugging Face checkpoint directory")
    return d


def measure_usage(model_dir: str | Path, text: str, *, seq_len: int = 256, batch: int = 8, hash_weights: bool = True,
                  text_name: str | None = None, progress: bool = False) -> dict:
    """fq-expert-usage/1 of the checkpoint in ``model_dir`` (transformers' own model class, float32 on the
    CPU, as fq.model.checkpoint_model builds it) over ``text`` (its tokenizer, no special tokens), with provenance: the text's sha256 and token count,
    the model's config/index (and, with ``hash_weights``, shard) sha256, window length, library versions."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    from fq.model.checkpoint_model import load_checkpoint

    model_dir = check_checkpoint_dir(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    # fq's own loader: FP8 sources dequantized, Kimi-K2's kimi_k2 built as deepseek_v3 (from_pretrained needs
    # accelerate for the first and remote code for the second)
    model = load_checkpoint(model_dir)
    ids = tok(text, add_special_tokens=False, verbose=False)["input_ids"]
    if not ids:
        raise FqError("expert usage: the text is empty")
    from fq.model import families

    family = families.for_config(canonical.load(model_dir / "config.json"), str(model_dir / "config.json"))
    counts = count_selections(model, ids, seq_len=seq_len, batch=batch, progress=progress,
                              layers=family.transformers_layers())
    text_bytes = text.encode("utf-8")
    model_prov = {"config_sha256": sha256_file(model_dir / "config.json")}
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        model_prov["index_sha256"] = sha256_file(index)
    if hash_weights:
        shards = sorted(set(canonical.load(index)["weight_map"].values())) if index.is_file() else ["model.safetensors"]
        model_prov["shards_sha256"] = {s: sha256_file(model_dir / s) for s in shards}
    cfg = model.config
    top_k = getattr(cfg, "num_experts_per_tok", None)
    doc = {
        "format": FORMAT,
        "description": f"router top-{top_k} selections of {len(ids)} tokens"
                       + (f" of {text_name}" if text_name else "") + f", windows of {seq_len} tokens (fq usage)",
        "layers": {str(L): c for L, c in counts.items()},
        "provenance": {
            "model": model_prov,
            "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
            "top_k": top_k,
            "text": {"sha256": canonical.sha256_hex(text_bytes), "bytes": len(text_bytes), "tokens": len(ids),
                     **({"name": text_name} if text_name else {})},
            "seq_len": seq_len,
            "dtype": "float32",
            "device": "cpu",
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        },
    }
    parse_usage(doc, "measured usage")  # the schema holds
    for L, c in counts.items():
        if sum(c) != len(ids) * (top_k or sum(c) // len(ids)):
            raise FqError(f"expert usage: layer {L} counted {sum(c)} selections for {len(ids)} tokens x top-{top_k}")
    return doc


def write_usage(path: str | Path, doc: dict) -> Path:
    from fq.core import atomic

    path = Path(path)
    atomic.write_bytes(path, canonical.pretty(doc).encode())
    return path


def rankings(u: ExpertUsage) -> dict[int, tuple[int, ...]]:
    """Per layer, every expert from the most used to the least (ties: lower index first): what ``hottest``
    selects for every N."""
    return {L: tuple(sorted(range(len(c)), key=lambda e: (-c[e], e))) for L, c in sorted(u.counts.items())}


def measure_job(model_dir: str | Path, text_path: str | Path, out: str | Path, *, hot=(), threads: int | None = None,
                recorded: dict | None = None, log=None) -> dict:
    """The workflow's usage job (the demo campaign): measure ``model_dir``'s usage over the text file, check it
    against the usage recorded with the demo model (``recorded``; default ``fq.model.demo_model.usage()``), write it.

    The campaign's DAG -- which experts a hot stage encodes -- was planned at parse time, before this job ran,
    from the recorded usage; later parses read this file. A measurement that selects other experts for any of the
    recipe's hot stages (``hot``: their N) in any layer would disagree with the jobs already scheduled: refused,
    naming the counts. Other differences (another CPU's float rounding moving a few tokens' choices) are
    accepted with a warning: the hot selections, and so every encoded byte, stay the same."""
    import sys

    if log is None:
        def log(msg):
            print(msg, file=sys.stderr, flush=True)
    if threads:
        import torch

        torch.set_num_threads(threads)
    if recorded is None:
        from fq.model import demo_model

        recorded = demo_model.usage()
    text_path = Path(text_path)
    doc = measure_usage(model_dir, text_path.read_text(encoding="utf-8"), text_name=text_path.name)
    mine, theirs = parse_usage(doc, str(out)), parse_usage(recorded, "the recorded usage")
    if sorted(mine.counts) != sorted(theirs.counts):
        raise FqError(f"measured expert usage has layers {sorted(mine.counts)}, the recorded {sorted(theirs.counts)}")
    for n in sorted(set(hot)):
        for L, c in sorted(theirs.counts.items()):
            if mine.hottest(L, n, len(c)) != theirs.hottest(L, n, len(c)):
                raise FqError(f"measured expert usage selects experts {list(mine.hottest(L, n, len(c)))} as the {n} "
                              f"hottest of layer {L}, the usage the campaign was planned from (recorded with the demo "
                              f"model) {list(theirs.hottest(L, n, len(c)))}: measured {dict(mine.counts)}, recorded "
                              f"{dict(theirs.counts)}; torch or transformers route differently here. Measure it "
                              f"yourself (fq usage) and pass the file as config usage: to plan from it")
    if doc != recorded:
        log(f"warning: the measured usage differs from the recorded one (counts {dict(mine.counts)}, recorded "
            f"{dict(theirs.counts)}) but selects the same hot experts; plan.json and the summary record the "
            f"measured file's digest")
    write_usage(out, doc)
    log(f"{out}: " + "; ".join(f"layer {L}: {list(c)}" for L, c in sorted(mine.counts.items())))
    return doc
