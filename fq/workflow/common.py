"""What several campaign steps share, kept below all of them so that the steps import it and not each other.

    INDEX, SIDE_FILES, SUMMARY   names of the campaign's files: the checkpoint index, the non-weight files a
                                 published base carries verbatim, the campaign summary
    check_signer                 the key a step signs with is the one bound at init
    recorded_shards              the source shards' sha256 as ``fq init`` recorded them in campaign.json
    verify_file, copy_verified   a source shard's bytes against the size and sha256 bound at init, and in the same
                                 pass its range index (the sha256 of its header and of each tensor's bytes)

It imports nothing from ``fq.workflow`` (tests/test_layering.py holds the modules of fq.workflow acyclic):
init, staging, hub and finalize used to take these from one another, which made campaign -> hub -> finalize
-> campaign and hub <-> staging import circles.
"""
from __future__ import annotations

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


def verify_file(path: Path, sha256: str, size: int, what: str, shard: str) -> dict | None:
    """Refuse a file whose bytes are not the bound ones; return its range index (``fq.model.shard_index``), made in
    the same pass (None: its header does not parse; the staging job's header check says why)."""
    from fq.model.shard_index import index_pass

    with open(path, "rb") as fh:
        got, n, index = index_pass(fh, what, shard)
    if n != size or got != sha256:
        raise _mismatch(what, n, got, size, sha256)
    return index


def copy_verified(src: Path, dst: Path, sha256: str, size: int) -> dict | None:
    """Copy src to dst through a temp name, hashing on the way; refuse a mismatch before dst exists. Returns the
    shard's range index, made in the same pass (as ``verify_file``)."""
    from fq.model.shard_index import index_pass

    if not src.is_file():
        raise FqError(f"{src}: source shard missing")
    with open(src, "rb") as fin, atomic.atomic_open(dst, "wb") as fout:
        got, n, index = index_pass(fin, str(src), dst.name, sink=lambda at, piece: fout.write(piece))
        if n != size or got != sha256:
            raise _mismatch(str(src), n, got, size, sha256)
    return index
