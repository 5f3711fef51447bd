"""docs/runbook.md stays runnable: every `fq` command it shows exists with the options it uses, and the
Snakemake options it relies on are real. (The procedure itself is exercised by tests/test_crash.py.)"""
from __future__ import annotations

import re
import shlex
from pathlib import Path

from fq.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
RUNBOOK = (REPO / "docs" / "runbook.md").read_text()


def _commands(prefix: str) -> list[list[str]]:
    """Every command line in the runbook's code (fenced blocks and `inline` spans) starting with ``prefix``."""
    blocks, inside, lang = [], False, ""
    for line in RUNBOOK.splitlines():
        if line.startswith("```"):
            inside, lang = not inside, line[3:].strip()
        elif inside and lang in ("", "sh"):
            blocks.append(line)
    text = "\n".join(blocks + re.findall(r"`([^`\n]+)`", RUNBOOK)).replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        for part in re.split(r"&&|;|\|", line.split("#", 1)[0]):
            part = part.strip()
            if part.startswith(prefix + " "):
                out.append(shlex.split(part.replace("$(", "(").replace("<", "").replace(">", ""), posix=True))
    return out


def test_every_fq_command_in_the_runbook_exists_with_its_options():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    cmds = _commands("fq")
    assert {c[1] for c in cmds} >= {"keygen", "price", "gate", "verify", "promote"}, cmds
    for c in cmds:
        if c[1] == "--help":
            continue
        assert c[1] in sub.choices, c
        opts = {o for a in sub.choices[c[1]]._actions for o in a.option_strings}
        for word in c[2:]:
            if word.startswith("--"):
                assert word.split("=")[0] in opts, (c, word)


def test_runbook_snakemake_options_and_gate_contract():
    for opt in ("--profile", "--until retire", "-n", "--configfile", "--cores"):
        assert opt in RUNBOOK
    assert "--rehearsal 1" in RUNBOOK and "exactly `0` or" in RUNBOOK
    assert "cannot tell" in RUNBOOK or "look identical" in RUNBOOK  # the gate's documented blind spot
    assert "Ctrl-C **once**" in RUNBOOK and "No `--unlock` is needed" in RUNBOOK
    for name in ("campaign.lock", "workers.lock", "claims/"):
        assert name in RUNBOOK
