"""A campaign's output-level evaluation: fq eval of every product against the source on held-out text (docs/eval.md).
``Campaign.evals``."""
from __future__ import annotations

from fq.errors import FqError


class EvalTargets:
    def __init__(self, campaign):
        self.c = campaign  # fq.workflow.campaign.Campaign: what every job shares

    @property
    def settings(self) -> dict | None:
        """``eval:`` of the config (None: no eval job). It needs the source checkpoint on disk, and text."""
        cfg = self.c.config.get("eval")
        if not cfg:
            return None
        if self.c.source_kind == "hub":
            raise FqError("eval: needs the source checkpoint on local disk (source.kind demo or local); a hub source's "
                          "shards are staged per window and deleted: set eval: null, or run fq eval where it fits")
        if not cfg.get("text") and self.c.source_kind != "demo":
            raise FqError("eval.text: name a held-out text file (only the demo source brings its own)")
        return {"tokens": cfg.get("tokens", 4096), "seq_len": cfg.get("seq_len", 256), "text": cfg.get("text")}

    @property
    def text(self) -> str:
        """The held-out text fq eval measures on: eval.text, or the demo's held-out split."""
        cfg = self.settings
        return cfg["text"] or self.c.p("demo-text", "heldout.txt")

    def files(self) -> list[str]:
        return [self.c.p("eval", "eval.json"), self.c.p("eval", "eval.tsv")] if self.settings else []
