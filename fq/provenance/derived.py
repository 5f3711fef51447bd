"""Every rule a base manifest may declare a derived file by: the EXL3 config files (``fq.provenance.exl3config``) and
the model card (``fq.provenance.model_card``), in the order they are derived (a rule's inputs before its output).

    RULES: rule name -> Rule;  DERIVED_ORDER: output names, in derivation order;  OPTIONAL: outputs a base may omit
    rule_inputs(rule, listed) -> [name];  check_derived(base_dir, entry, where) -> (problem | None, sha256, size)
"""
from __future__ import annotations

import os

from fq.provenance import exl3config
from fq.provenance.model_card import CARD_RULE, README, RULE as RULE_CARD

RULES = {**exl3config.RULES, RULE_CARD: CARD_RULE}
DERIVED_ORDER = (*exl3config.DERIVED_ORDER, README)  # the card reads quantization_config.json: derived last
OPTIONAL = (*exl3config.TENSOR_OUTPUTS, README)  # a base of an earlier campaign has no card


def rule_inputs(rule: str, listed: list[str]) -> list[str]:
    return RULES[rule].inputs(sorted(listed))


def check_derived(base_dir: str | os.PathLike, entry: dict, where: str) -> tuple[str | None, str, int]:
    return exl3config.check_derived(base_dir, entry, where, RULES)
