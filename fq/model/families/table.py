"""The support table of docs/families.md, generated from the registry so that it cannot drift from it.

    python -m fq.model.families.table [MEASURED.json]   # prints the markdown table

``MEASURED.json`` (docs/data/families_exl3.json, what tests/test_exl3_families.py writes on the H200):
``{campaign: {"architecture", "source", "calibrated", "bases": {node: {"kl_ref_exl3", "top1_agreement",
"max_abs_logit_diff", ...}}}}``, exllamav3 1.6.5's forward of each published base against fq's reference forward;
per family the table shows each measured source format's KL and top-1; a family without an entry says "not
measured".
"""
from __future__ import annotations

import sys

from fq.model import families
from fq.model.families.base import Family, exl3_config_asserts

HEADER = ("| architecture | releases | routed experts on disk | source formats | calibration chain | "
          "exllamav3 1.6.5 | KL(fq ‖ exllamav3), H200 unless noted |")
RULE = "| --- | --- | --- | --- | --- | --- | --- |"


def _experts(f: Family) -> str:
    if f.on_disk:
        return f.on_disk
    return f"`{f.layout.key('{L}', '{E}', '{' + ','.join(f.layout.projections) + '}', 'weight')}`"


def _exl3(f: Family) -> str:
    if f.exl3 is None:
        return "no class (refused unless `allow_unloadable`)"
    needs = f.exl3_needs
    notes = []
    if needs.stated:
        notes.append("states " + ", ".join(f"`{k}`" for k in needs.stated))
    if needs.values:
        notes.append("needs " + ", ".join(f"`{k}` ∈ {{{', '.join(map(str, v))}}}" for k, v, _ in needs.values))
    asserts = exl3_config_asserts().get(f.exl3, ())
    if asserts:  # exllamav3's assert_cfg: a stated value must be this (required: must be stated)
        notes.append("asserts " + ", ".join(f"`{a['key']}` = {a['value']}" + ("" if a["optional"] else " (required)")
                                            for a in asserts))
    if needs.all_moe:
        notes.append("every layer MoE")
    if needs.aliases or needs.computed:
        notes.append("base states " + ", ".join([f"`{k}`" for k, _ in needs.aliases]
                                                + [f"`{k}` (as transformers computes it)" for k, _ in needs.computed]))
    if needs.tensor_aliases:
        notes.append("base derives " + ", ".join(f"`{dst}` from `{src}`" for src, dst in needs.tensor_aliases)
                     + " (`tensor_aliases.safetensors`)")
    if f.layout.stored_scale_log2:  # fq.model.experts: how the runtime reads them, which fq's consumers undo
        notes.append("base stores routed " + ", ".join(f"`{proj}` × 2^{n}" for proj, n in f.layout.stored_scale_log2)
                     + " (its svh scaled), as the class reads them")
    if needs.always:
        notes.append("**not loadable as published**: " + needs.always)
    return f"`{f.exl3}`" + (" (" + "; ".join(notes) + ")" if notes else "")


def _measured(f: Family, measured: dict) -> str:
    cells = []
    for name, c in sorted(measured.items()):
        if c["architecture"] != f.architectures[0]:
            continue
        what = c["source"] + (", calibrated" if c["calibrated"] else "")
        for r in c["bases"].values():
            if r["kl_ref_exl3"] is None:
                cells.append(f"{what}: {r['note']}")
            else:
                note = f"; {c['note']}" if c.get("note") else ""  # what the measured campaign was built with
                cells.append(f"{what}: {r['kl_ref_exl3']:.1e} (top-1 {100 * r['top1_agreement']:.1f}%{note})")
    return "; ".join(cells) or "not measured"


def support_table(measured: dict | None = None) -> str:
    measured = measured or {}
    rows = [HEADER, RULE]
    for f in families.REGISTRY.values():
        fused = f.fused_experts
        formats = ("not read yet: " + f.unread if f.unread else f.published_formats if f.published_formats else
                   "bf16 (fused), MXFP4" if fused and fused.mxfp4 else
                   "bf16 / fp16 / fp32 (fused or per expert), FP8 e4m3 + block scales (per expert)"
                   if fused and fused.per_expert_too else
                   "bf16 / fp16 / fp32 (fused)" if fused else "bf16 / fp16 / fp32, FP8 e4m3 + block scales")
        cal = f"`{f.calibration.layer_class}`" if f.calibration else "—"
        rows.append(f"| `{f.architectures[0]}` | {f.title} | {_experts(f)} | {formats} | {cal} | {_exl3(f)} | "
                    f"{_measured(f, measured)} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    import json

    argv = sys.argv[1:] if argv is None else argv
    measured = json.loads(open(argv[0], encoding="utf-8").read()) if argv else None
    sys.stdout.write(support_table(measured))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
