"""What a process imports at start-up. torch is most of a CLI's or a Snakemake job's start-up time (about 1.5 s of
CPU each, paid by every job of a campaign); commands and jobs that never touch a tensor must not load it."""
from __future__ import annotations

import subprocess
import sys

NO_TORCH = ["fq.cli", "fq.provenance.verify", "fq.workflow.finalize", "fq.workflow.skeleton", "fq.workflow.report",
            "fq.workflow.init", "fq.workflow.campaign", "fq.workflow.common", "fq.provenance.assembly",
            "fq.provenance.attest.fragment", "fq.model.shards", "fq.provenance.fragments", "fq.planning.plan",
            "fq.planning.price", "fq.promote.local"]


def test_torch_free_commands_and_jobs_do_not_import_torch():
    code = ("import importlib, sys\n"
            f"for m in {NO_TORCH!r}:\n"
            "    importlib.import_module(m)\n"
            "import fq.cli\n"
            "fq.cli.build_parser()\n"  # imports every command module, as every `fq` start does
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_codec_api_still_resolves_lazily():
    code = ("import sys, fq.codec\n"
            "assert 'torch' not in sys.modules\n"
            "from fq.codec import reconstruct_chain, encode, Geometry, CODEBOOKS\n"
            "assert 'torch' in sys.modules and callable(reconstruct_chain) and callable(encode)\n"
            "try:\n"
            "    fq.codec.no_such_name\n"
            "except AttributeError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "no_such_name" in out


def test_checking_a_base_without_fused_expert_biases_imports_no_torch(tmp_path):
    """finalize, verify_published and fq verify ask every base whether it needs the derived expert-bias file; a base
    without fused expert biases (every family but gpt-oss) is answered from the shard headers, without torch."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.layers.1.mlp.experts.0.up_proj.weight": torch.zeros(2, 2)}, str(tmp_path / "model.safetensors"))
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from fq.provenance.exl3config import RULE_EXPERT_BIAS, RULES\n"
            "rule = RULES[RULE_EXPERT_BIAS]\n"
            f"print(rule.needed(Path({str(tmp_path)!r}), rule.inputs(['model.safetensors'])), 'torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
