"""Calibration tokens: ``rows × cols`` token ids, deterministic, and a digest that binds everything computed from them.

Two sources:

- a UTF-8 text file with its expected sha256 (refused if the file's differs), tokenized with the source model's
  ``tokenizer.json`` (``tokenizers``, no special tokens, as ``fq eval`` and ``fq usage`` tokenize); the id stream
  is cut into ``rows`` consecutive windows of ``cols`` ids: row r is ids[r·cols : (r+1)·cols] (each row its own
  context, position 0 at its first id). Text too short for rows × cols ids is refused, never padded.
- a token file (``save_tokens``' output, or any safetensors file whose only tensor ``tokens`` is an I64/I32 id array,
  1-D or 2-D): its first rows × cols ids in row-major order.

Sizes: exllamav3's converter uses 250 × 2048 (``EXLLAMA_ROWS``, ``EXLLAMA_COLS``; its mix is about a quarter
random ids, which fq does not add); the demo model uses 16 × 128 (``DEMO_ROWS``, ``DEMO_COLS``) of its calibration
split (``fq.demo_model.text("calibration")``, separate from the held-out split ``fq eval`` measures on).

The digest (``token_digest``) is sha256 over ``b"fq-calibration-tokens/1 {rows}x{cols}\\n"`` followed by the ids
as int64 little-endian, row-major: the same ids in another shape are another calibration.

    from_text(path, sha256, tokenizer, rows, cols) -> CalibrationTokens
    from_tokens(path, rows, cols, sha256=None) -> CalibrationTokens
    save_tokens(path, calibration)                       # atomic; from_tokens reads it back (same digest)
    token_digest(tokens) -> str
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fq.core import canonical
from fq.errors import FqError

if TYPE_CHECKING:
    import torch

FORMAT = "fq-calibration-tokens/1"
EXLLAMA_ROWS, EXLLAMA_COLS = 250, 2048
DEMO_ROWS, DEMO_COLS = 16, 128
TOKENS = "tokens"


@dataclass(frozen=True, eq=False)
class CalibrationTokens:
    tokens: "torch.Tensor"  # int64 [rows, cols]
    digest: str  # token_digest(tokens)
    source: dict = field(default_factory=dict)  # where the ids came from (kind, file, sha256, tokenizer_sha256)

    @property
    def rows(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def cols(self) -> int:
        return int(self.tokens.shape[1])


def _shape(rows: object, cols: object) -> tuple[int, int]:
    for name, v in (("rows", rows), ("cols", cols)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise FqError(f"calibration: {name} must be a positive integer, got {v!r}")
    return rows, cols


def token_digest(tokens: "torch.Tensor") -> str:
    """sha256 of b"fq-calibration-tokens/1 {rows}x{cols}\\n" + the ids as int64 little-endian, row-major."""
    import torch

    if tokens.dim() != 2:
        raise FqError(f"calibration tokens: expected a [rows, cols] tensor, got shape {list(tokens.shape)}")
    t = tokens.detach().to("cpu", torch.int64).contiguous()
    head = f"{FORMAT} {t.shape[0]}x{t.shape[1]}\n".encode()
    body = t.reshape(-1).numpy().astype("<i8", copy=False).tobytes()
    return canonical.sha256_hex(head + body)


def _calibration(ids: "torch.Tensor", rows: int, cols: int, where: str, source: dict) -> CalibrationTokens:
    need = rows * cols
    if ids.numel() < need:
        raise FqError(f"{where}: {ids.numel()} tokens, fewer than the {need} that rows x cols = {rows} x {cols} needs")
    if ids.numel() and int(ids.min()) < 0:
        raise FqError(f"{where}: negative token id {int(ids.min())}")
    tokens = ids.reshape(-1)[:need].clone().reshape(rows, cols)
    return CalibrationTokens(tokens, token_digest(tokens), dict(source, tokens_available=int(ids.numel())))


def _tokenizer_file(tokenizer: str | os.PathLike) -> Path:
    p = Path(tokenizer)
    return p / "tokenizer.json" if p.is_dir() else p


def from_text(path: str | os.PathLike, sha256: str, tokenizer: str | os.PathLike, rows: int, cols: int) -> CalibrationTokens:
    """CalibrationTokens from a text file whose sha256 must be ``sha256``; ``tokenizer``: a tokenizer.json or the
    checkpoint directory holding one."""
    import torch
    from tokenizers import Tokenizer

    rows, cols = _shape(rows, cols)
    path = Path(path)
    if not isinstance(sha256, str) or len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise FqError(f"{path}: the expected text_sha256 must be 64 lowercase hex digits, got {sha256!r}")
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise FqError(f"{path}: cannot read the calibration text: {e.strerror}") from None
    got = canonical.sha256_hex(raw)
    if got != sha256:
        raise FqError(f"{path}: sha256 {got}, expected {sha256} (field text_sha256): not the calibration text the "
                      "campaign names")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FqError(f"{path}: not UTF-8 text (byte {e.start})") from None
    tok_path = _tokenizer_file(tokenizer)
    try:
        tok_raw = tok_path.read_bytes()
    except OSError as e:
        raise FqError(f"{tok_path}: cannot read the tokenizer: {e.strerror}") from None
    try:
        tok = Tokenizer.from_str(tok_raw.decode("utf-8"))
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        raise FqError(f"{tok_path}: not a tokenizers tokenizer.json ({e})") from None
    ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids, dtype=torch.int64)
    return _calibration(ids, rows, cols, str(path), {"kind": "text", "file": path.name, "sha256": got,
                                                     "tokenizer_sha256": canonical.sha256_hex(tok_raw)})


def from_tokens(path: str | os.PathLike, rows: int, cols: int, sha256: str | None = None) -> CalibrationTokens:
    """CalibrationTokens from a token file (safetensors, one tensor ``tokens``, I64 or I32, 1-D or 2-D): its first
    rows × cols ids. ``sha256``: the file's expected digest (refused if different)."""
    from fq.model.shards import read_whole, tensors_in_range

    rows, cols = _shape(rows, cols)
    path = Path(path)
    header, data = read_whole(path, "the token file")
    got = canonical.sha256_hex(data)
    if sha256 is not None and got != sha256:
        raise FqError(f"{path}: sha256 {got}, expected {sha256} (field tokens_sha256)")
    names = [e.name for e in header.entries]
    if names != [TOKENS]:
        raise FqError(f"{path}: tensors {names}, expected exactly one named {TOKENS!r}")
    e = header.entry(TOKENS)
    if e.dtype not in ("I64", "I32") or len(e.shape) not in (1, 2):
        raise FqError(f"{path}: tensor {TOKENS!r} is {e.dtype} {list(e.shape)}, expected I64 or I32 ids, 1-D or 2-D")
    ids = tensors_in_range(header, [TOKENS], 0, data)[TOKENS].long()
    return _calibration(ids, rows, cols, str(path), {"kind": "tokens", "file": path.name, "sha256": got})


def save_tokens(path: str | os.PathLike, cal: CalibrationTokens) -> None:
    """The calibration's [rows, cols] int64 ids as a token file (atomic; deterministic bytes)."""
    from fq.model.shards import RawTensor, write_shard

    meta = {"format": FORMAT, "digest": cal.digest, "rows": str(cal.rows), "cols": str(cal.cols),
            "source": canonical.dumps(cal.source).decode("utf-8")}
    write_shard(path, [RawTensor.of(TOKENS, cal.tokens.to("cpu").long().contiguous())], dict(sorted(meta.items())))
