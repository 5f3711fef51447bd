"""fq's per-user cache: results that are pure functions of their key, kept between processes.

Under ``$XDG_CACHE_HOME/fq`` (default ``~/.cache/fq``): the CUDA Viterbi library builds (``cuda/``,
fq.codec.viterbi_cuda) and small JSON documents (``json``/``put_json``), each under a key that hashes everything its
value depends on, so an entry is never stale, only unused. A cache that cannot be read or written is skipped: the
value is computed again, never refused. ``FQ_CACHE=off`` turns the JSON cache off.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from fq.core import atomic


def root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "fq"


def _path(kind: str, key: str) -> Path | None:
    if os.environ.get("FQ_CACHE", "on") == "off":
        return None
    return root() / kind / f"{key}.json"


def get_json(kind: str, key: str):
    """The document cached under (kind, key), or None (absent, unreadable, not JSON, or the cache off)."""
    path = _path(kind, key)
    if path is None:
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def put_json(kind: str, key: str, doc) -> None:
    """Cache ``doc`` under (kind, key), atomically; silently nothing where the cache cannot be written."""
    path = _path(kind, key)
    if path is None:
        return
    try:
        atomic.write_text(path, json.dumps(doc, sort_keys=True, separators=(",", ":")))
    except OSError:
        pass
