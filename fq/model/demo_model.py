"""The embedded demo model: a small, *trained* GLM-4-MoE checkpoint in Hugging Face layout.

``Glm4MoeForCausalLM`` (what transformers 5.x and exllamav3 both load; same expert, shared-expert and router
names as GLM-5): 3 layers, layer 0 dense, layers 1-2 MoE with 8 routed experts (gate/up 128x256, down 256x128),
a shared expert and a sigmoid router with ``e_score_correction_bias``; vocabulary 512 (a byte-level BPE
``tokenizer.json``). It was trained on the CPU on text that ships with Python (``tools/train_demo_model.py``,
logic in ``fq.model.demo_train``; docs/demo_model.md says how long it took and what its held-out perplexity is).

Its weights (bf16; the routers and their correction bias float32, as transformers saves them), tokenizer,
config and the three text splits (train / calibration / held-out) are package data under ``fq/data/demo/``,
each checked against ``manifest.json``, whose own sha256 is pinned here. ``write`` lays them out as a
checkpoint (config, generation config, tokenizer files, shard index, shards), byte for byte the same every
time, without torch. Four shards, chosen to exercise the planner: one skeleton-only shard (embeddings, the
dense layer 0, the final norm) and one whose experts span layers 1 and 2, which the demo's window partition
(1 | 2) puts in different windows.
"""
from __future__ import annotations

import argparse
import functools
import hashlib
import lzma
import os
import stat
from pathlib import Path

from fq.core import atomic, canonical
from fq.core.paths import check_output_dir
from fq.errors import FqError

DATA = Path(__file__).resolve().parents[1] / "data" / "demo"  # fq/data/demo
MANIFEST = "manifest.json"
# sha256 of fq/data/demo/manifest.json: pins every data file (tools/train_demo_model.py prints the new value)
MANIFEST_SHA256 = "8b31dfff6ae25f8644cc599568e5055cf9a3d303b8ec6dcf19d1b9315410ee64"

SEED = 20261129
HIDDEN = 256
MOE_INTERMEDIATE = 128
DENSE_INTERMEDIATE = 512
N_EXPERTS = 8
N_LAYERS = 3
FIRST_DENSE = 1
VOCAB = 512
EOS = "<|endoftext|>"

# Glm4MoeConfig arguments (../shared/EXL3-RUNTIME.md's tiny config that transformers 5.x and exllamav3 1.6.5 load)
MODEL_CONFIG = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": DENSE_INTERMEDIATE,
    "moe_intermediate_size": MOE_INTERMEDIATE,
    "num_hidden_layers": N_LAYERS,
    "first_k_dense_replace": FIRST_DENSE,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "partial_rotary_factor": 0.5,
    "n_routed_experts": N_EXPERTS,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.0,
    "num_nextn_predict_layers": 0,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "max_position_embeddings": 2048,
    "eos_token_id": 0,
    "pad_token_id": 0,
}
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "eos_token": EOS,
    "pad_token": EOS,
    "model_max_length": 2048,
    "clean_up_tokenization_spaces": False,
}

# The checkpoint's non-weight files, verbatim from fq/data/demo/
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")
WEIGHTS = "model.safetensors"
TEXT_SPLITS = ("train", "calibration", "heldout")
DATA_FILES = (WEIGHTS, *SIDE_FILES, *(f"text-{s}.txt.xz" for s in TEXT_SPLITS), "usage.json", "training.json")


def text_file(split: str) -> str:
    if split not in TEXT_SPLITS:
        raise FqError(f"demo text: split {split!r}, expected one of {', '.join(TEXT_SPLITS)}")
    return f"text-{split}.txt.xz"


# -- the package data, checked ---------------------------------------------------------------------
def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def load_data(data_dir: str | Path = DATA, manifest_sha256: str | None = MANIFEST_SHA256) -> dict[str, bytes]:
    """Every data file, name -> bytes, each checked against the manifest (and the manifest against
    ``manifest_sha256``; None: trust the manifest, for the training script's own fresh output)."""
    data_dir = Path(data_dir)
    try:
        raw = (data_dir / MANIFEST).read_bytes()
    except OSError as e:
        raise FqError(f"{data_dir / MANIFEST}: cannot read the demo model's manifest: {e.strerror}") from None
    if manifest_sha256 is not None and _sha(raw) != manifest_sha256:
        raise FqError(f"{data_dir / MANIFEST}: sha256 {_sha(raw)}, expected {manifest_sha256} "
                      f"(fq.model.demo_model.MANIFEST_SHA256)")
    files = canonical.loads(raw, str(data_dir / MANIFEST)).get("files", {})
    if sorted(files) != sorted(DATA_FILES):
        raise FqError(f"{data_dir / MANIFEST}: lists {sorted(files)}, expected {sorted(DATA_FILES)}")
    out = {}
    for name in DATA_FILES:
        try:
            data = (data_dir / name).read_bytes()
        except OSError as e:
            raise FqError(f"{data_dir / name}: cannot read demo model data: {e.strerror}") from None
        if _sha(data) != files[name]:
            raise FqError(f"{data_dir / name}: sha256 {_sha(data)}, the manifest says {files[name]}: damaged package data")
        out[name] = data
    return out


@functools.lru_cache(maxsize=1)
def data() -> dict[str, bytes]:
    return load_data()


def text(split: str) -> str:
    """One of the committed text splits (train, calibration, heldout), as str."""
    return lzma.decompress(data()[text_file(split)]).decode("utf-8")


def training_record() -> dict:
    """What the training script recorded: corpus, steps, time, machine, losses, held-out perplexity."""
    return canonical.loads(data()["training.json"], "fq/data/demo/training.json")


def usage() -> dict:
    """fq-expert-usage/1 recorded with the model: its routers' top-k selections over the calibration split
    (``fq usage``, measured by the training script; the workflow's usage rule measures it again)."""
    return canonical.loads(data()["usage.json"], "fq/data/demo/usage.json")


# -- the checkpoint --------------------------------------------------------------------------------
def _shard_of(name: str) -> int:
    """1: skeleton only (embeddings, dense layer 0, final norm); 2: layer 1 but its experts 6-7;
    3: layer 1 experts 6-7 + layer 2 experts 0-3 (straddles the 1 | 2 window boundary);
    4: the rest of layer 2 and lm_head."""
    if not name.startswith("model.layers.") or name.startswith("model.layers.0."):
        return 4 if name == "lm_head.weight" else 1
    layer = int(name.split(".")[2])
    expert = int(name.split(".")[5]) if ".mlp.experts." in name else None
    if layer == 1:
        return 3 if expert is not None and expert >= 6 else 2
    return 3 if expert is not None and expert < 4 else 4


SHARDS = 4


def shard_name(i: int) -> str:
    return f"model-{i:05d}-of-{SHARDS:05d}.safetensors"


def _tensors(blob: bytes, source: str) -> list:
    """The tensors of a safetensors file held in memory, by name (fq.model.shards.RawTensor; payloads are views)."""
    import json
    import struct

    from fq.model.shards import DTYPES, RawTensor

    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n])
    header.pop("__metadata__", None)
    view = memoryview(blob)[8 + n:]
    out = []
    for name in sorted(header):
        spec = header[name]
        begin, end = spec["data_offsets"]
        size = DTYPES[spec["dtype"]][0]
        for dim in spec["shape"]:
            size *= dim
        if end - begin != size or end > len(view):
            raise FqError(f"{source}: tensor {name!r}: data_offsets {spec['data_offsets']} do not fit its shape or the file")
        out.append(RawTensor(name, spec["dtype"], tuple(spec["shape"]), view[begin:end]))
    return out


def checkpoint_files(d: dict[str, bytes]) -> dict[str, bytes]:
    """The checkpoint's files from the data files ``d`` (name -> bytes): pure, no torch."""
    from fq.model.shards import RawTensor, encode_header

    tensors = _tensors(d[WEIGHTS], f"fq/data/demo/{WEIGHTS}")
    by_shard: dict[int, list[RawTensor]] = {i: [] for i in range(1, SHARDS + 1)}
    for t in tensors:
        by_shard[_shard_of(t.name)].append(t)
    out = {}
    for i, ts in by_shard.items():
        out[shard_name(i)] = encode_header(ts, {"format": "pt"}) + b"".join(bytes(t.data) for t in ts)
    weight_map = {t.name: shard_name(_shard_of(t.name)) for t in tensors}
    total = sum(len(t.data) for t in tensors)
    out["model.safetensors.index.json"] = canonical.pretty({"metadata": {"total_size": total}, "weight_map": weight_map}).encode()
    for name in SIDE_FILES:
        out[name] = d[name]
    return out


@functools.lru_cache(maxsize=1)
def files() -> dict[str, bytes]:
    """Every file of the checkpoint, name -> bytes (deterministic)."""
    return checkpoint_files(data())


def metadata() -> tuple[dict, dict, dict[str, int]]:
    """(config, index, shard sizes) without writing anything: what a campaign plans from."""
    f = files()
    sizes = {name: len(b) for name, b in f.items() if name.endswith(".safetensors")}
    return (canonical.loads(f["config.json"]), canonical.loads(f["model.safetensors.index.json"]), sizes)


@functools.lru_cache(maxsize=1)
def text_files() -> dict[str, bytes]:
    """The text splits as written: ``train.txt``, ``calibration.txt``, ``heldout.txt``."""
    return {f"{split}.txt": text(split).encode("utf-8") for split in TEXT_SPLITS}


def check_target(out_dir: str | Path, expected: dict[str, bytes], what: str) -> Path:
    """``out_dir`` may receive the files ``expected`` (name -> bytes): it is new, empty, or holds only those files
    with those bytes (a rerun, or one a crash interrupted: rewriting them loses nothing). Anything else -- someone's
    config.json, another checkpoint's shards under the same standard names, an earlier demo model -- is refused
    rather than overwritten; so is a regular file or an unwritable directory."""
    d = check_output_dir(out_dir, what)
    if not d.is_dir():
        return d
    for entry in sorted(os.listdir(d)):
        if any(entry.startswith(f".tmp-{name}.") for name in expected):
            continue  # fq.core.atomic's temp file of an interrupted write
        if entry not in expected:
            raise FqError(f"{what} {out_dir}: holds {entry}, which the demo model does not write; refusing to write "
                          f"into a directory with other files (use a new or empty one)")
        if not stat.S_ISREG(os.lstat(d / entry).st_mode) or (d / entry).read_bytes() != expected[entry]:
            raise FqError(f"{what} {out_dir}: {entry} is not the demo model's {entry} (another file, or an earlier "
                          f"demo model); refusing to overwrite it (remove it, or use a new or empty directory)")
    return d


def write(out_dir: str | Path, text_dir: str | Path | None = None, *, out_what: str = "demo model directory",
          text_what: str = "demo text directory") -> Path:
    """Write the checkpoint atomically into ``out_dir`` (and, with ``text_dir``, the text splits as
    ``train.txt``, ``calibration.txt``, ``heldout.txt``); returns ``out_dir``. Both directories are checked
    (``check_target``, named ``out_what`` and ``text_what`` in a refusal) before anything is written."""
    out_dir = Path(out_dir)
    model = files()
    check_target(out_dir, model, out_what)
    if text_dir is not None:
        check_target(text_dir, text_files(), text_what)
    for name, b in model.items():
        atomic.write_bytes(out_dir / name, b)
    if text_dir is not None:
        write_text(text_dir)
    return out_dir


def write_text(text_dir: str | Path) -> Path:
    text_dir = Path(text_dir)
    for name, b in text_files().items():
        atomic.write_bytes(text_dir / name, b)
    return text_dir


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="directory to write the checkpoint into")
    ap.add_argument("--text", metavar="DIR", help="also write the train/calibration/heldout text splits into DIR")
    args = ap.parse_args(argv)
    d = write(args.out, args.text)
    print(f"demo model written to {d}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
