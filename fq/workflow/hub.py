"""Hugging Face hub sources: shard digests from the hub's file metadata, and downloads into a local
directory as real files (``local_dir``, never cache symlinks), verified against those digests."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from fq.errors import FqError
from fq.atomic import fsync_dir
from fq.workflow.staging import verify_file


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


def download_shard(repo: str, revision: str, shard: str, dst: Path, sha256: str, size: int) -> None:
    from huggingface_hub import hf_hub_download

    os.environ.setdefault("HF_HUB_DISABLE_XET", "1")  # each shard is fetched once; the chunk cache would only grow
    with tempfile.TemporaryDirectory(dir=dst.parent, prefix=".tmp-download-") as tmp:
        path = Path(hf_hub_download(repo, shard, revision=revision, local_dir=tmp))
        if path.is_symlink() or not path.is_file():
            raise FqError(f"{repo}@{revision}: {shard} did not arrive as a regular file")
        verify_file(path, sha256, size, f"{repo}@{revision}/{shard}")
        os.replace(path, dst)  # same filesystem: the verified bytes take their name in one step
        fsync_dir(dst.parent)
