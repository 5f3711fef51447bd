"""Staging: one source shard becomes a real file in the campaign's staging directory.

Local (and demo) sources are copied, never linked: a link into a checkpoint or into the hub cache
would make "deleting a retired window" free nothing, and a hard link would let a later write reach
the source. Hub sources are downloaded into a local directory (real files, not cache symlinks).
Either way the bytes are verified against the sha256 bound at init before the file takes its name.
A stage job is a campaign writer: it holds ``workers.lock`` shared and the claim ``stage-SHARD`` for its
lifetime (fq.workflow.locks), and removes the leftovers of an interrupted copy of its own shard.
Every staging and retirement appends the set of shards then on disk to ``staging.log``, which is
how a run shows that no more than W windows of source were ever present.
"""
from __future__ import annotations

import fcntl
import os
import sys
import time
from pathlib import Path

from fq.core import atomic, canonical
from fq.errors import FqError
from fq.model import shard_index
from fq.workflow.common import copy_verified

def log_event(staging_dir: Path, event: str, **fields) -> None:
    """Append one JSON line (event, the shards present now, fields) to staging.log, under a lock."""
    staging_dir.mkdir(parents=True, exist_ok=True)
    present = sorted(p.name for p in staging_dir.iterdir() if p.suffix == ".safetensors" and not p.name.startswith(".tmp-"))
    line = canonical.dumps({"event": event, "present": present, "t": round(time.time(), 3), **fields}) + b"\n"
    with open(staging_dir.parent / "staging.log", "ab") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        fh.write(line)
        fh.flush()
        os.fsync(fh.fileno())


def stage_shard(campaign_json: str, source_kind: str, source_dir: str, shard: str, window: int, out: str,
                repo: str | None = None, revision: str | None = None, lock_dir: str | None = None,
                out_index: str | None = None) -> None:
    """``out_index``: where the shard's range index goes (``fq.model.shard_index``: the sha256 of its header and of
    each tensor, made in the pass that verifies the whole shard), so that chain jobs read only their tensors."""
    from fq.workflow import locks

    if lock_dir is not None:
        locks.hold_worker(lock_dir, f"stage-{shard}", f"stage {shard}")
        names = [shard, f"download-{shard}"] + ([Path(out_index).name] if out_index else [])
        for p in locks.remove_dead_temps(Path(out).parent, names):
            print(f"removed {p}: leftover of an interrupted copy of this shard", file=sys.stderr)
    doc = canonical.load(campaign_json)
    expected = doc["source"]["shards"].get(shard)
    if expected is None:
        raise FqError(f"{campaign_json}: source.shards has no entry for {shard}")
    dst = Path(out)
    if source_kind == "hub":
        from fq.workflow.hub import download_shard

        index = download_shard(repo, revision, shard, dst, expected["sha256"], expected["size"])
    else:
        index = copy_verified(Path(source_dir) / shard, dst, expected["sha256"], expected["size"])
    check_header(dst)
    if out_index is not None:
        if index is None:  # the header parsed in check_header but not in the verifying pass: it changed
            raise FqError(f"{dst}: changed while it was staged; stage it again")
        shard_index.write(out_index, index)
    log_event(dst.parent, "stage", shard=shard, window=window)


def check_header(path: Path) -> None:
    """A staged shard's header, read with fq's reader (``fq.model.shards.read_header``): a hub shard's bytes are
    first seen here, and a header that lies is refused by name now, not by safetensors in the job that reads it.
    The refused copy is removed."""
    from fq.model.shards import read_header

    try:
        with open(path, "rb") as fh:
            read_header(fh, str(path))
    except FqError:
        path.unlink(missing_ok=True)
        raise


def retire_window(staging_dir: str, window: int, retire: list[str], marker: str) -> None:
    """Every consumer of window ``window`` has committed: Snakemake has normally deleted the shards whose last
    use this was (temp()). A run killed after a consumer finished but before Snakemake's temp cleanup leaves
    the shard behind, and no later run consumes it again, so Snakemake never would: remove such leftovers
    here (no job needs them: ``retire`` lists only shards whose last consumer is in this window), then write
    the marker that opens window w+W's staging."""
    staging = Path(staging_dir)
    log_event(staging, "retire", window=window, retired=sorted(retire))
    leftovers = sorted(s for s in retire if (staging / s).exists())
    for s in leftovers:
        (staging / s).unlink(missing_ok=True)
    for s in retire:  # a range index is temp as its shard is (the chain's jobs read it)
        shard_index.index_path(staging / s).unlink(missing_ok=True)
        print(f"retire window {window}: removed {s}, left staged by an interrupted run", file=sys.stderr)
    atomic.write_text(marker, canonical.pretty({"window": window, "retired": sorted(retire),
                                                "removed_leftovers": leftovers}))


def write_repair_marker(c, marker: str) -> None:
    """Name what was missing when this run started (the marker itself is temp: gone after finalize)."""
    atomic.write_text(marker, canonical.pretty({"missing": c.missing_committed()}))
