"""The workflow's eval job: ``fq.runtime.evaluate`` on the campaign's published tree, its source (each shard checked
against the sha256 ``fq init`` recorded in campaign.json) its native comparison encodes and
weight-only twins."""
from __future__ import annotations

import sys

from fq.provenance.attest import keys
from fq.workflow.common import recorded_shards


def run_eval(*, published: str, pub: str, campaign_json: str, source: str, text: str, native: str, tokens: int,
             seq_len: int, out_json: str, out_tsv: str, weight_only: str | None = None,
             twin_aliases: dict | None = None) -> dict:
    from fq.runtime.evaluate import evaluate

    return evaluate(published, keys.load_public(pub), source=source, text=text, out_json=out_json, native_dir=native,
                    weight_only_dir=weight_only, twin_aliases=twin_aliases,
                    source_sha256=recorded_shards(campaign_json), tokens=tokens, seq_len=seq_len, out_tsv=out_tsv,
                    progress=lambda m: print(m, file=sys.stderr, flush=True))
