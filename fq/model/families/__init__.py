"""The model families fq reads: one place that knows each checkpoint family (``fq.model.families.base.Family``).

Source reading, planning, encoding, calibration, eval, the runtime and the docs' support table all ask this
registry; nothing else matches tensor names or config keys of a family. A checkpoint is matched by its
``config.json`` ``architectures[0]`` (or, without one, its ``model_type``); anything else is refused by name,
with the list of supported architectures.

    for_config(config, where) -> Family          # refuses an unregistered architecture
    transformers_model_type(config) -> str       # the model_type transformers knows (kimi_k2 -> deepseek_v3)
    by_name(name) -> Family
    REGISTRY: {name: Family}, in the support table's order
    check_publishable(family, problems, allow, where)  # a base no EXL3 runtime loads is refused unless allowed
    check_calibration(family, where)                     # calibration needs the family's transformers layer class
"""
from __future__ import annotations

from fq.core.targets import EXLLAMAV3
from fq.errors import FqError
from fq.model.families import (afmoe, deepseek, dots, ernie, glm, gpt_oss, hunyuan, kimi, laguna, lfm2, mimo, mixtral,
                               qwen, solar)
from fq.model.families.base import Calibration, Family

REGISTRY: dict[str, Family] = {f.name: f for f in (
    glm.GLM4_MOE, glm.GLM4_MOE_LITE, glm.GLM_MOE_DSA,
    deepseek.DEEPSEEK_V3, deepseek.DEEPSEEK_V32, deepseek.DEEPSEEK_V2,
    qwen.QWEN3_MOE, qwen.QWEN3_NEXT, qwen.QWEN3_5_MOE_VL, qwen.QWEN3_5_MOE, qwen.QWEN2_MOE,
    mixtral.MIXTRAL, mixtral.MINIMAX_M2, mixtral.MINIMAX, mixtral.PHIMOE,
    gpt_oss.GPT_OSS, dots.DOTS1, ernie.ERNIE4_5_MOE, solar.SOLAR_OPEN,
    afmoe.AFMOE, laguna.LAGUNA, hunyuan.HY_V3, mimo.MIMO_V2_FLASH, lfm2.LFM2_MOE, kimi.KIMI_LINEAR,
    deepseek.DEEPSEEK_V4, qwen.QWEN3_VL_MOE, glm.GLM4V_MOE,
)}
_BY_ARCH = {a: f for f in REGISTRY.values() for a in f.architectures}
_BY_MODEL_TYPE = {t: f for f in REGISTRY.values() for t in f.model_types}
assert len(_BY_ARCH) == sum(len(f.architectures) for f in REGISTRY.values()), "an architecture in two families"
assert len(_BY_MODEL_TYPE) == sum(len(f.model_types) for f in REGISTRY.values()), "a model_type in two families"

__all__ = ["REGISTRY", "Family", "Calibration", "for_config", "by_name", "check_publishable", "check_calibration",
           "supported", "transformers_model_type"]


def supported() -> str:
    return ", ".join(sorted(_BY_ARCH))


def for_config(config: dict, where: str) -> Family:
    """The family of a parsed ``config.json`` (``where``: its path, for messages)."""
    arch = config.get("architectures")
    model_type = config.get("model_type")
    if arch is not None:
        if not isinstance(arch, list) or len(arch) != 1 or not isinstance(arch[0], str):
            raise FqError(f"{where}: architectures: expected exactly one model class name, got {arch!r}")
        family = _BY_ARCH.get(arch[0])
        if family is None:
            raise FqError(f"{where}: architecture {arch[0]!r} is not a model family fq reads; supported: {supported()}")
        if model_type is not None and model_type not in family.model_types:
            raise FqError(f"{where}: model_type {model_type!r} is not one of {arch[0]}'s "
                          f"({', '.join(family.model_types)})")
        return family
    family = _BY_MODEL_TYPE.get(model_type) if isinstance(model_type, str) else None
    if family is None:
        raise FqError(f"{where}: no architectures field, and model_type {model_type!r} is not a model family fq reads; "
                      f"supported architectures: {supported()}")
    return family


def transformers_model_type(config: dict) -> str | None:
    """The model_type transformers builds a config of (Kimi-K2's kimi_k2 is deepseek_v3); others as they are."""
    t = config.get("model_type")
    family = _BY_MODEL_TYPE.get(t) if isinstance(t, str) else None
    return family.transformers_model_type if family is not None else t


def by_name(name: str) -> Family:
    try:
        return REGISTRY[name]
    except KeyError:
        raise FqError(f"model family {name!r} is not registered; expected one of {', '.join(REGISTRY)}") from None


def check_publishable(family: Family, problems, allow_unloadable: bool, where: str) -> None:
    """A base that no EXL3 runtime loads (``problems``: SourceModel.exl3_problems) is published only when the
    operator says so."""
    if problems and not allow_unloadable:
        raise FqError(f"{where}: exllamav3 {EXLLAMAV3} would not load a {family.architectures[0]} ({family.title}) base of "
                      f"this checkpoint: {'; '.join(problems)}. Set allow_unloadable: true (fq plan/price: "
                      f"--allow-unloadable) to publish it anyway")


def check_calibration(family: Family, where: str) -> Calibration:
    if family.calibration is None:
        have = ", ".join(sorted(f.architectures[0] for f in REGISTRY.values() if f.calibration))
        raise FqError(f"{where}: calibration: {family.architectures[0]} ({family.title}) has no calibration chain "
                      f"(a transformers decoder layer checked against the full model); calibrated families: {have}. "
                      f"Remove calibration: to encode weight-only")
    return family.calibration
