"""Training the embedded demo model (``tools/train_demo_model.py``): corpus, tokenizer, model, export, evaluation.

Everything is a function of ``fq.model.demo_model.SEED`` and the Python version's own text (the corpus is written
out as the three committed splits, so later readers need not have this Python):

- corpus: the documentation that ships with Python, ``pydoc_data.topics`` (one document per topic) and the
  docstrings of the standard library's modules (one document per file, read with ``ast``: nothing imported),
  ordered by a seeded hash of their names and cut into held-out (the first ~4% of characters), calibration
  (the next ~6%) and train (the rest). The held-out part is never trained on, not even by the tokenizer.
- tokenizer: a byte-level BPE with 512 entries (``<|endoftext|>``, the 256 bytes, 255 merges) trained on the
  train split with the ``tokenizers`` library.
- model: transformers' own ``Glm4MoeForCausalLM`` (``fq.model.demo_model.MODEL_CONFIG``), float32 on the CPU,
  AdamW with warmup and cosine decay on random windows of the train split; the routers' ``e_score_correction_bias``
  is updated as DeepSeek-V3 does (auxiliary-loss-free balancing: after each step, raised for experts picked less
  than average, lowered for the others), so no expert starves and the bias is a real, non-zero tensor.
- export: saved by transformers in float32, reloaded in bfloat16 (the routers and their bias stay float32, as
  transformers keeps them) and saved again: ``model.safetensors``, ``config.json``, ``generation_config.json``.
- evaluation: perplexity of the written checkpoint (bf16 weights, computed in float32) on the held-out split,
  windows of ``EVAL_SEQ`` tokens, against the uniform baseline (the vocabulary size, 512).
"""
from __future__ import annotations

import ast
import hashlib
import lzma
import math
import os
import platform
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from fq.core import canonical
from fq.model.demo_model import (DATA, DATA_FILES, EOS, MANIFEST, MODEL_CONFIG, SEED, TEXT_SPLITS, TOKENIZER_CONFIG,
                                 VOCAB, WEIGHTS, checkpoint_files, load_data, text_file)
from fq.errors import FqError

HELDOUT_FRACTION = 0.04
CALIBRATION_FRACTION = 0.06
# the standard library's folders that are tests, GUIs or vendored code, not documented modules
_SKIP_DIRS = {"test", "tests", "idlelib", "tkinter", "turtledemo", "lib2to3", "site-packages", "ensurepip",
              "pydoc_data", "__pycache__"}

SEQ = 256  # training window (tokens)
BATCH = 16
STEPS = 450
LR = 2e-3
MIN_LR = 2e-4
WARMUP = 30
WEIGHT_DECAY = 0.1
CLIP = 1.0
BIAS_RATE = 2e-4  # e_score_correction_bias step per update (DeepSeek-V3's gamma)
THREADS = 2
EVAL_SEQ = 256


# -- corpus ------------------------------------------------------------------------------------------
def documents() -> dict[str, str]:
    """name -> text of every document of the corpus, from this Python's own files."""
    import pydoc_data.topics

    docs = {f"pydoc:{k}": v.strip() for k, v in pydoc_data.topics.topics.items() if v.strip()}
    lib = Path(sysconfig.get_paths()["stdlib"])
    for p in sorted(lib.rglob("*.py")):
        rel = p.relative_to(lib)
        if _SKIP_DIRS.intersection(rel.parts[:-1]) or rel.name.startswith("test_"):
            continue
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = [ast.get_docstring(n) for n in ast.walk(tree)
                 if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        body = "\n\n".join(d.strip() for d in parts if d and d.strip())
        if body:
            docs[f"docstrings:{rel.as_posix()}"] = body
    bad = [k for k, v in docs.items() if EOS in v]
    if bad:
        raise FqError(f"demo corpus: {bad[0]} contains the separator {EOS!r}")
    return docs


def split_corpus(docs: dict[str, str]) -> dict[str, list[str]]:
    """Documents in a seeded-hash order of their names; held-out takes them until it has HELDOUT_FRACTION of
    the characters, calibration until CALIBRATION_FRACTION, train the rest (each split in name order)."""
    order = sorted(docs, key=lambda k: hashlib.sha256(f"{SEED}:{k}".encode()).hexdigest())
    total = sum(len(v) for v in docs.values())
    names: dict[str, list[str]] = {s: [] for s in TEXT_SPLITS}
    held = cal = 0
    for k in order:
        if held < HELDOUT_FRACTION * total:
            names["heldout"].append(k)
            held += len(docs[k])
        elif cal < CALIBRATION_FRACTION * total:
            names["calibration"].append(k)
            cal += len(docs[k])
        else:
            names["train"].append(k)
    return {s: sorted(ns) for s, ns in names.items()}


def join(docs: list[str]) -> str:
    """A split's text: its documents separated by the end-of-text token (which the tokenizer maps to its id)."""
    return EOS.join(docs)


# -- tokenizer ---------------------------------------------------------------------------------------
def train_tokenizer(train_docs: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(train_docs, trainer=trainer, length=len(train_docs))
    if tok.get_vocab_size() != VOCAB or tok.token_to_id(EOS) != MODEL_CONFIG["eos_token_id"]:
        raise FqError(f"demo tokenizer: {tok.get_vocab_size()} entries, {EOS} = {tok.token_to_id(EOS)}; expected "
                      f"{VOCAB} and {MODEL_CONFIG['eos_token_id']}")
    return tok


# -- model -------------------------------------------------------------------------------------------
def glm_config():
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(**MODEL_CONFIG)


def lr_at(step: int, *, steps: int, lr: float = LR, min_lr: float = MIN_LR, warmup: int = WARMUP) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warmup over ``warmup`` steps to ``lr``, then cosine
    decay to ``min_lr`` at step ``steps``."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * t))


def _lr(step: int) -> float:
    return lr_at(step, steps=STEPS)  # the demo's schedule spans STEPS whatever --steps says (as it was trained)


class SelectionBalance:
    """Auxiliary-loss-free load balancing (DeepSeek-V3) of a model's routers that have a selection bias
    (``e_score_correction_bias``): forward hooks count each router's top-k selections since the last ``reset``;
    ``update`` raises the bias of the experts picked less than their layer's mean by ``rate`` and lowers the others'.
    The counts live on the routers' device. Routers without a bias are not hooked (``routers`` is then empty)."""

    def __init__(self, model, rate: float = BIAS_RATE):
        import torch

        from fq.model.usage import routers

        self.rate = rate
        self.routers = {L: r for L, r in routers(model).items() if hasattr(r, "e_score_correction_bias")}
        self.loads = {L: torch.zeros(r.weight.shape[0], dtype=torch.int64, device=r.e_score_correction_bias.device)
                      for L, r in self.routers.items()}
        self.handles = [r.register_forward_hook(lambda m, i, o, L=L: self._count(L, o)) for L, r in self.routers.items()]

    def _count(self, L: int, out) -> None:
        import torch

        self.loads[L] += torch.bincount(out[-1].reshape(-1), minlength=self.loads[L].numel())

    def reset(self) -> None:
        for c in self.loads.values():
            c.zero_()

    def update(self) -> None:
        import torch

        with torch.no_grad():  # nudge the selection bias
            for L, r in self.routers.items():
                c = self.loads[L].to(torch.float32)
                r.e_score_correction_bias += self.rate * torch.sign(c.mean() - c)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def train_model(train_ids, *, steps: int = STEPS, progress: bool = True, log=print, model=None):
    """A Glm4MoeForCausalLM (or ``model``, another family's freshly initialised one) trained on random windows of
    ``train_ids`` (a 1-D int64 tensor); returns (model, record). Routers with a selection bias
    (``e_score_correction_bias``) are balanced as DeepSeek-V3 does; others by the family's own auxiliary loss, if its
    config asks for one (``output_router_logits``)."""
    import torch
    from transformers import Glm4MoeForCausalLM

    torch.manual_seed(SEED)
    if model is None:
        model = Glm4MoeForCausalLM(glm_config())
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.95), eps=1e-8)
    balance = SelectionBalance(model, BIAS_RATE)
    gen = torch.Generator().manual_seed(SEED + 1)
    n = len(train_ids)
    losses = []
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=steps, unit="step", desc="training", file=sys.stderr)
    t0 = time.monotonic()
    try:
        for step in range(steps):
            starts = torch.randint(0, n - SEQ - 1, (BATCH,), generator=gen)
            x = torch.stack([train_ids[s:s + SEQ] for s in starts.tolist()])
            for g in opt.param_groups:
                g["lr"] = _lr(step)
            balance.reset()
            loss = model(input_ids=x, labels=x).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
            opt.step()
            balance.update()  # auxiliary-loss-free balancing (DeepSeek-V3): nudge the selection bias
            losses.append(loss.item())
            if bar:
                bar.update(1)
                bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
    finally:
        balance.remove()
        if bar:
            bar.close()
    wall = time.monotonic() - t0
    record = {
        "steps": steps, "batch": BATCH, "seq_len": SEQ, "tokens_seen": steps * BATCH * SEQ,
        "lr": LR, "min_lr": MIN_LR, "warmup": WARMUP, "weight_decay": WEIGHT_DECAY, "clip": CLIP, "bias_rate": BIAS_RATE,
        "optimizer": "AdamW(0.9, 0.95)", "train_wall_s": round(wall, 1),
        "loss_first20": round(sum(losses[:20]) / min(20, len(losses)), 4),
        "loss_last20": round(sum(losses[-20:]) / min(20, len(losses)), 4),
    }
    log(f"trained {steps} steps in {wall:.0f} s; loss {record['loss_first20']} -> {record['loss_last20']}")
    return model, record


EXPORTED = (WEIGHTS, "config.json", "generation_config.json")


def export_weights(model, workdir: Path, order=None) -> dict[str, bytes]:
    """model.safetensors (bf16; routers float32), config.json and generation_config.json, as transformers writes
    them: saved in float32, reloaded in bfloat16, saved again. ``order`` (layer -> expert order) renumbers the
    routed experts of the bf16 model before the second save (exact: a permutation moves bf16 values unchanged)."""
    import torch
    from transformers import AutoModelForCausalLM

    f32, bf16 = workdir / "f32", workdir / "bf16"
    model.save_pretrained(f32)
    m = AutoModelForCausalLM.from_pretrained(f32, dtype=torch.bfloat16)
    if order:
        permute_experts(m, order)
    m.save_pretrained(bf16)
    return {name: (bf16 / name).read_bytes() for name in EXPORTED}


def permute_experts(model, order: dict[int, list[int]]) -> None:
    """Renumber each MoE layer's routed experts: new expert i is old expert ``order[layer][i]`` (its gate/up/down
    matrices, router row and correction bias move together, so the model computes the same function)."""
    import torch

    with torch.no_grad():
        for L, perm in order.items():
            mlp = model.model.layers[L].mlp
            idx = torch.tensor(perm, dtype=torch.int64)
            if sorted(perm) != list(range(mlp.gate.weight.shape[0])):
                raise FqError(f"expert order of layer {L}: {perm} is not a permutation")
            for t in (mlp.experts.gate_up_proj, mlp.experts.down_proj, mlp.gate.weight, mlp.gate.e_score_correction_bias):
                t.copy_(t[idx].clone())


def expert_order(counts: dict[int, list[int]]) -> dict[int, list[int]]:
    """The demo's numbering of each MoE layer's experts by calibration usage: most used first in the first MoE
    layer, last in the others, so the hot stage's experts lie in block 0 of layer 1 and in the last block of
    layer 2 (the layer-job rules of a hot stage then differ per layer; docs/workflow.md)."""
    first = min(counts)
    out = {}
    for L, c in sorted(counts.items()):
        ranked = sorted(range(len(c)), key=lambda e: (-c[e], e))
        out[L] = ranked if L == first else ranked[::-1]
    return out


# -- evaluation --------------------------------------------------------------------------------------
def token_ids(model_dir: str | Path, text: str) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)(text, add_special_tokens=False, verbose=False)["input_ids"]


def perplexity(model_dir: str | Path, text: str, seq_len: int = EVAL_SEQ) -> dict:
    """Perplexity of the checkpoint in ``model_dir`` (loaded by transformers, computed in float32 on the CPU) on
    ``text``: non-overlapping windows of ``seq_len`` tokens, each token after a window's first predicted from
    the window before it."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = torch.tensor(token_ids(model_dir, text), dtype=torch.int64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    nll, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(ids), seq_len):
            w = ids[i:i + seq_len]
            if len(w) < 2:
                continue
            logits = model(input_ids=w[None]).logits[0, :-1].to(torch.float64)
            nll += float(torch.nn.functional.cross_entropy(logits, w[1:], reduction="sum"))
            count += len(w) - 1
    return {"tokens": len(ids), "predicted": count, "seq_len": seq_len, "nll": nll / count,
            "perplexity": math.exp(nll / count), "uniform_perplexity": VOCAB}


# -- the whole run -----------------------------------------------------------------------------------
def machine() -> dict:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "threads": THREADS, "python": platform.python_version(),
            "system": f"{platform.system()} {platform.machine()}"}


def _xz(text: str) -> bytes:
    return lzma.compress(text.encode("utf-8"), format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC64, preset=9 | lzma.PRESET_EXTREME)


def run(out_dir: str | Path = DATA, *, steps: int = STEPS, progress: bool = True, log=print,
        trained: str | Path | None = None) -> dict:
    """Build corpus and tokenizer, train, export, evaluate and measure expert usage; write every data file and
    the manifest into ``out_dir``. Returns the manifest. ``trained``: a directory to keep the float32 model in
    after training (and to take it from instead of training, when it holds one)."""
    import tokenizers
    import torch
    import transformers

    from fq.model.usage import measure_usage

    t_start = time.monotonic()
    torch.set_num_threads(THREADS)
    out_dir = Path(out_dir)
    docs = documents()
    names = split_corpus(docs)
    texts = {s: join([docs[k] for k in names[s]]) for s in TEXT_SPLITS}
    log("corpus: " + ", ".join(f"{s} {len(names[s])} documents, {len(texts[s])} chars" for s in TEXT_SPLITS))
    tok = train_tokenizer([docs[k] for k in names["train"]])
    train_ids = torch.tensor(tok.encode(texts["train"]).ids, dtype=torch.int64)
    log(f"tokenizer: {tok.get_vocab_size()} entries; train split {len(train_ids)} tokens "
        f"({len(texts['train']) / len(train_ids):.2f} chars/token)")
    if trained is not None and (Path(trained) / "config.json").is_file():  # a finished training run, reused
        from transformers import Glm4MoeForCausalLM

        model = Glm4MoeForCausalLM.from_pretrained(trained, dtype=torch.float32)
        record = canonical.load(Path(trained) / "record.json")
        log(f"reusing the model trained in {trained}")
    else:
        model, record = train_model(train_ids, steps=steps, progress=progress, log=log)
        if trained is not None:
            model.save_pretrained(trained)
            (Path(trained) / "record.json").write_text(canonical.pretty(record))

    files: dict[str, bytes] = {}
    files["tokenizer.json"] = tok.to_str(pretty=True).encode("utf-8") + b"\n"
    files["tokenizer_config.json"] = canonical.pretty(TOKENIZER_CONFIG).encode()
    for s in TEXT_SPLITS:
        files[text_file(s)] = _xz(texts[s])

    def checkpoint(tmp: str) -> Path:
        ckpt = Path(tmp) / "ckpt"
        ckpt.mkdir()
        for name, b in checkpoint_files(files).items():
            (ckpt / name).write_bytes(b)
        return ckpt

    with tempfile.TemporaryDirectory() as tmp:
        files.update(export_weights(model, Path(tmp) / "w"))
        before = measure_usage(checkpoint(tmp), texts["calibration"], text_name="calibration.txt")
    order = expert_order({int(L): c for L, c in before["layers"].items()})
    log("expert order by calibration usage: " + "; ".join(f"layer {L}: {o}" for L, o in order.items()))
    record["expert_order"] = {str(L): o for L, o in order.items()}
    with tempfile.TemporaryDirectory() as tmp:
        files.update(export_weights(model, Path(tmp) / "w", order))
        ckpt = checkpoint(tmp)
        held = perplexity(ckpt, texts["heldout"])
        log(f"held-out perplexity {held['perplexity']:.3f} over {held['predicted']} tokens (uniform: {VOCAB})")
        usage = measure_usage(ckpt, texts["calibration"], text_name="calibration.txt", progress=progress)
    files["usage.json"] = canonical.pretty(usage).encode()
    files["training.json"] = canonical.pretty({
        "format": "fq-demo-training/1",
        "seed": SEED,
        # as the committed training.json records it (the module is fq.model.demo_train now)
        "script": "tools/train_demo_model.py (fq.demo_train)",
        "corpus": {s: {"documents": len(names[s]), "chars": len(texts[s]), "sha256": hashlib.sha256(texts[s].encode()).hexdigest(),
                       "names": names[s] if s != "train" else None} for s in TEXT_SPLITS},
        "train_tokens": len(train_ids),
        "training": record,
        "heldout": held,
        "total_wall_s": round(time.monotonic() - t_start, 1),
        "machine": machine(),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
    }).encode()
    if sorted(files) != sorted(DATA_FILES):
        raise FqError(f"demo training wrote {sorted(files)}, expected {sorted(DATA_FILES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, b in files.items():
        (out_dir / name).write_bytes(b)
    manifest = {"format": "fq-demo-data/1", "files": {n: hashlib.sha256(b).hexdigest() for n, b in sorted(files.items())}}
    raw = canonical.pretty(manifest).encode()
    (out_dir / MANIFEST).write_bytes(raw)
    load_data(out_dir, hashlib.sha256(raw).hexdigest())  # reads back what the package will check
    log(f"manifest sha256 {hashlib.sha256(raw).hexdigest()} (set fq.model.demo_model.MANIFEST_SHA256 to it)")
    return manifest
