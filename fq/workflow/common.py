"""What several campaign steps share, kept below all of them so that the steps import it and not each other.

    INDEX, SIDE_FILES, SUMMARY   names of the campaign's files: the checkpoint index, the non-weight files a
                                 published base carries verbatim, the campaign summary
    check_signer                 the key a step signs with is the one bound at init
    recorded_shards              the source shards' sha256 as ``fq init`` recorded them in campaign.json
    verify_file, copy_verified   a source shard's bytes against the size and sha256 bound at init

It imports nothing from ``fq.workflow`` (tests/test_layering.py holds the modules of fq.workflow acyclic):
init, staging, hub and finalize used to take these from one another, which made campaign -> hub -> finalize
-> campaign and hub <-> staging import circles.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from fq.core import atomic, canonical
from fq.errors import FqError

SUMMARY = "campaign_summary.json"
INDEX = "model.safetensors.index.json"
# Non-weight files of a checkpoint that a loadable base carries verbatim (config.json as source_config.json:
# the base's config.json is derived from it, fq.provenance.exl3config); a vision-language checkpoint's processor
# configs too (exllamav3's Qwen3.5-MoE VL class opens preprocessor_config.json even to run text).
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
              "preprocessor_config.json", "video_preprocessor_config.json")

CHUNK = 1 << 22


def check_signer(doc: dict, pub, key_path: str) -> None:
    """The key a step signs with must be the campaign's bound signer (fail in seconds, not at finalize)."""
    from fq.provenance.attest import keys

    fp = keys.fingerprint(pub)
    bound = doc["identity"]["signer"]
    if fp != bound:
        raise FqError(f"{key_path}: key {fp[:16]}… is not this campaign's signer {bound[:16]}… (bound at init); "
                      f"pass the campaign's key as signer_key, or start a fresh campaign directory")


def recorded_shards(path: str) -> dict[str, str]:
    """shard name -> sha256 that ``fq init`` recorded in campaign.json."""
    doc = canonical.load(path)
    try:
        return {name: e["sha256"] for name, e in doc["source"]["shards"].items()}
    except (KeyError, TypeError, AttributeError):
        raise FqError(f"{path}: no source.shards with sha256 (not a campaign.json written by fq init)") from None


def _mismatch(what: str, n: int, got: str, size: int, sha256: str) -> FqError:
    return FqError(f"{what}: {n} bytes with sha256 {got}, but the campaign bound {size} bytes with sha256 "
                   f"{sha256} at init; the source changed under the campaign")


def verify_file(path: Path, sha256: str, size: int, what: str) -> None:
    h = hashlib.sha256()
    n = 0
    with open(path, "rb") as fh:
        while data := fh.read(CHUNK):
            h.update(data)
            n += len(data)
    if n != size or h.hexdigest() != sha256:
        raise _mismatch(what, n, h.hexdigest(), size, sha256)


def copy_verified(src: Path, dst: Path, sha256: str, size: int) -> None:
    """Copy src to dst through a temp name, hashing on the way; refuse a mismatch before dst exists."""
    if not src.is_file():
        raise FqError(f"{src}: source shard missing")
    h = hashlib.sha256()
    n = 0
    with open(src, "rb") as fin, atomic.atomic_open(dst, "wb") as fout:
        while data := fin.read(CHUNK):
            h.update(data)
            n += len(data)
            fout.write(data)
        if n != size or h.hexdigest() != sha256:
            raise _mismatch(str(src), n, h.hexdigest(), size, sha256)
