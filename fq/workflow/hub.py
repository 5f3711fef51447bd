"""Hugging Face hub sources: shard digests from the hub's file metadata, downloads into a local
directory as real files (``local_dir``, never cache symlinks), verified against those digests, and the
source metadata kept in the campaign (``OUT/meta``) so that planning and finalize need no hub later."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fq.core import atomic, canonical
from fq.core.atomic import fsync_dir
from fq.errors import FqError
from fq.workflow.common import INDEX, SIDE_FILES, verify_file

META_DOC = "fq-source-meta.json"
META_FORMAT = "fq-source-meta/1"


def shard_digests(c) -> dict[str, dict]:
    from huggingface_hub import HfApi

    info = HfApi().model_info(c.config["source"]["repo"], revision=c.source.revision, files_metadata=True)
    out = {}
    for f in info.siblings or []:
        if f.rfilename in c.source.shards:
            if not f.lfs or not getattr(f.lfs, "sha256", None):
                raise FqError(f"{c.source_repo}@{c.source.revision}: {f.rfilename} has no LFS sha256 on the hub")
            out[f.rfilename] = {"size": int(f.size), "sha256": f.lfs.sha256}
    missing = sorted(set(c.source.shards) - set(out))
    if missing:
        raise FqError(f"{c.source_repo}@{c.source.revision}: the hub lists no {', '.join(missing)}")
    return out


def download_shard(repo: str, revision: str, shard: str, dst: Path, sha256: str, size: int) -> dict | None:
    """The shard downloaded to ``dst``, verified; returns its range index, made in the verifying pass."""
    from huggingface_hub import hf_hub_download

    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # each shard is fetched once; the chunk cache would only grow
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=f".tmp-download-{shard}.") as tmp:
        path = Path(hf_hub_download(repo, shard, revision=revision, local_dir=tmp))
        if path.is_symlink() or not path.is_file():
            raise FqError(f"{repo}@{revision}: {shard} did not arrive as a regular file")
        index = verify_file(path, sha256, size, f"{repo}@{revision}/{shard}", shard)
        os.replace(path, dst)  # same filesystem: the verified bytes take their name in one step
        fsync_dir(dst.parent)
    return index


def persist_metadata(c, meta_dir: str | os.PathLike, *, listing=None, fetch=None) -> Path:
    """At init: store config.json, the index, the side files a published base carries (tokenizer, generation
    config, ...) and the shard sizes of the bound revision in ``OUT/meta``. The Snakefile then plans from
    them (load_persisted) instead of asking the hub at every parse, so finalize runs on a machine without
    hub access after the GPU fleet is released (``fq gate`` checks they are on the campaign volume), and
    finalize publishes the side files beside each base. config.json and the index are verified against
    the digests the campaign was planned from. ``listing``/``fetch(name) -> bytes``: for tests."""
    repo, rev = c.config["source"]["repo"], c.source.revision
    if listing is None:
        from huggingface_hub import HfApi

        listing = HfApi().list_repo_files(repo, revision=rev)
    if fetch is None:
        def fetch(name: str) -> bytes:
            from huggingface_hub import hf_hub_download

            with tempfile.TemporaryDirectory(prefix=".tmp-meta-") as tmp:
                return Path(hf_hub_download(repo, name, revision=rev, local_dir=tmp)).read_bytes()
    meta = Path(meta_dir)
    names = ["config.json", INDEX] + [s for s in SIDE_FILES if s != "config.json" and s in set(listing)]
    want = {"config.json": c.source.config_sha256, INDEX: c.source.index_sha256}
    for name in names:
        data = fetch(name)
        if name in want and canonical.sha256_hex(data) != want[name]:
            raise FqError(f"{repo}@{rev}/{name}: sha256 {canonical.sha256_hex(data)} differs from the one the campaign "
                          f"was planned from ({want[name]})")
        atomic.write_bytes(meta / name, data)
    doc = {"format": META_FORMAT, "repo": repo, "revision": rev, "files": names,
           "shard_sizes": dict(sorted(c.source.shard_sizes.items()))}
    atomic.write_text(meta / META_DOC, canonical.pretty(doc))
    return meta


def load_persisted(meta_dir: str | os.PathLike, repo: str, revision: str | None):
    """The SourceModel from ``OUT/meta`` when init stored it for this very repo and revision; else None."""
    from fq.model.source import load_source

    meta = Path(meta_dir)
    if not (meta / META_DOC).is_file() or not (meta / "config.json").is_file() or not (meta / INDEX).is_file():
        return None
    doc = canonical.load(meta / META_DOC)
    if doc.get("format") != META_FORMAT or doc.get("repo") != repo or doc.get("revision") != revision:
        return None
    return load_source(meta, revision=revision, sizes=doc["shard_sizes"])
