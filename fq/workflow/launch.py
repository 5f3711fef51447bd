"""The launcher's share of crash safety: what the Snakefile's ``onstart:`` handler runs.

Snakemake's own lock (``.snakemake/locks``) covers one working directory and is a file's existence:
two working directories can point ``out`` at one campaign, and a SIGKILLed Snakemake leaves its lock
behind (``snakemake --unlock`` removes it). fq's launcher lock is an flock on
``OUT/locks/campaign.lock``, held by the Snakemake process from ``onstart`` until it exits, however it
exits, so a second launcher on the same campaign is refused with one line, from any directory.

``onstart`` runs only when Snakemake is about to execute jobs: ``snakemake -n``, ``--lint``,
``--summary`` and a run with nothing to do never take the lock and are never blocked by it. Jobs that
Snakemake spawns as sub-processes (cluster executors) run with ``--no-hooks`` and do not take it either.

Before the first job starts, the launcher also checks the campaign's bindings (``campaign.json``): the
signer key must be the bound one, and when encode jobs are pending the encoder build must be the bound
one, so a wrong key or a rebuilt encoder is refused in seconds, before a window is staged.
"""
from __future__ import annotations

import sys
from pathlib import Path

from fq.core import canonical
from fq.errors import FqError
from fq.provenance.attest import keys
from fq.workflow import locks
from fq.workflow.campaign import is_encode_rule
from fq.workflow.common import check_signer
from fq.workflow.init import encoder_differences


def check_launch(c, key_path: str, device: str, pending: set[str] | None) -> None:
    """Refuse (FqError) a launch whose key or encoder build contradicts campaign.json (if bound yet).
    ``pending``: the rules with jobs to run (None: unknown, then only the key is checked here; every
    encode job checks the encoder itself)."""
    if not Path(c.campaign_json).is_file():
        return
    doc = canonical.load(c.campaign_json)
    if Path(key_path).is_file():
        check_signer(doc, keys.load_private(key_path).public_key(), key_path)
    if pending is not None and any(is_encode_rule(r) for r in pending):
        from fq.provenance.identity import encoder_identity

        # on a GPU campaign everything but the GPU's architecture: the launcher never touches a GPU (it would hold
        # a CUDA context on one for the whole campaign); each encode job checks its GPU's after claiming it
        problem = encoder_differences(doc["encoder"], encoder_identity("cpu"),
                                      ignore=() if device == "cpu" else ("device_arch",))
        if problem:
            raise FqError(f"{c.campaign_json}: {problem}; encode with the bound build or start a new campaign")


def on_start(c, key_path: str, device: str, pending: set[str] | None = None) -> Path:
    """Take the campaign lock for the life of this process and check the bindings; on refusal print one
    line and exit 1 (before any job has started)."""
    try:
        path = locks.hold_campaign(c.out)
        check_launch(c, key_path, device, pending)
    except FqError as e:
        print(f"fq: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    print(f"fq: this launcher holds {path} until it exits", file=sys.stderr, flush=True)
    return path
