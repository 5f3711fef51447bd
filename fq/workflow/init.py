"""Campaign init: bind source identity, signer and encoder build into ``campaign.json``.

Everything a later step must agree with is fixed here, so a wrong key or a rebuilt encoder fails in
seconds, not at finalize: the campaign identity (name, source repo and revision, block size, signer
fingerprint, encoder identity digest), the source shards' sizes and sha256, and the public key.
If ``campaign.json`` already exists it must describe the same campaign (compare-and-set under a lock).
"""
from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from fq.core import atomic, canonical
from fq.core.safepath import sha256_file
from fq.errors import FqError
from fq.provenance.attest import keys
from fq.provenance.attest.campaign import campaign_identity
from fq.provenance.identity import encoder_identity
from fq.workflow.campaign import Campaign

FORMAT = "fq-campaign/1"


def source_shards(c: Campaign) -> dict[str, dict]:
    """name -> {size, sha256} of every source shard (local sources are hashed once, here)."""
    if c.source_kind == "hub":
        from fq.workflow.hub import shard_digests

        return shard_digests(c)
    out = {}
    for shard in c.source.shards:
        path = c.source_dir / shard
        if not path.is_file():
            raise FqError(f"{path}: source shard missing (named by the checkpoint index)")
        out[shard] = {"size": path.stat().st_size, "sha256": sha256_file(path)}
    return out


def encoder_differences(bound: dict, mine: dict, ignore=()) -> str | None:
    """None when ``mine`` is the encoder build bound to the campaign; else a one-line description of the
    fields that differ (``ignore``: fields not to compare, e.g. device_arch on a launcher without a GPU)."""
    keys_ = sorted(k for k in set(mine) | set(bound) if k != "digest" and k not in ignore)
    diff = [k for k in keys_ if mine.get(k) != bound.get(k)]
    if not diff and (ignore or mine.get("digest") == bound.get("digest")):
        return None
    if not diff:
        diff = ["digest"]
    return (f"encoder build differs from the one bound to this campaign in {', '.join(diff)} "
            f"({', '.join(f'{k}: {bound.get(k)!r} -> {mine.get(k)!r}' for k in diff)})")


def run_init(c: Campaign, key_path: str, device: str, out_path: str, devices: list[int] | None = None) -> dict:
    """``devices``: the GPUs named for the campaign; the bound architecture is the first one's (every encode
    job checks its own GPU's against it), and no other GPU is touched."""
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    encoder = encoder_identity(f"cuda:{devices[0]}" if device == "cuda" and devices else device)
    ident = campaign_identity(name=c.name, source_repo=c.source_repo, source_revision=c.source.revision,
                              block_size=c.plan.block_size, signer=keys.fingerprint(pub), encoder=encoder["digest"])
    doc = {
        "format": FORMAT,
        "identity": ident,
        "encoder": encoder,
        "device": device,
        "public_key": Path(key_path).with_suffix(".pub").name,
        "source": {"kind": c.source_kind, "repo": c.source_repo, "revision": c.source.revision,
                   "shards": source_shards(c)},
    }
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    # compare-and-set: two launchers (or a relaunch with another key or encoder) cannot both bind
    with open(out.parent / ".campaign.bind.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        from fq.workflow.locks import remove_dead_temps

        remove_dead_temps(out.parent, [out.name, "signer.pub"])  # a killed init's halves (we hold the bind lock)
        if out.exists():
            bound = canonical.load(out).get("identity", {})
            if bound != ident:
                diff = sorted(k for k in set(ident) | set(bound) if ident.get(k) != bound.get(k))
                was = ", ".join(f"{k}={bound.get(k)!r} (now {ident.get(k)!r})" for k in diff)
                raise FqError(f"{out}: campaign already bound to another {', '.join(diff)}: {was}; "
                              f"use the same key and encoder build, or a fresh campaign directory")
        # campaign.json is the commit point: what init writes beside it is in place before it exists
        if c.source_kind == "hub":
            from fq.workflow.hub import persist_metadata

            persist_metadata(c, out.parent / "meta")
        pub_src = Path(key_path).with_suffix(".pub")
        pub_dst = out.parent / "signer.pub"
        if pub_src.is_file() and (not pub_dst.exists() or pub_dst.read_bytes() != pub_src.read_bytes()):
            atomic.write_bytes(pub_dst, pub_src.read_bytes())
        atomic.write_text(out, canonical.pretty(doc))
    return doc


def ensure_key(prefix: str) -> None:
    """Generate the campaign's own signing key (demo campaigns; real ones pass --config signer_key=...)."""
    p = Path(prefix)
    if not Path(f"{prefix}.key").exists():
        keys.generate(str(p))
