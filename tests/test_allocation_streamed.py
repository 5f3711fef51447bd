"""The sensitivity measurement streamed layer by layer (fq.allocation.streamed) gives the in-memory measurement's
document (fq.workflow.allocation.measure) on the demo model: the same units, Ks, injected points, parts and
efficiency bit for bit (the same operations on the same inputs, one layer at a time), the experts' forms to float
tolerance (computed from activations, not weight gradients)."""
from __future__ import annotations

import pytest
import torch

from fq.allocation import passes, streamed


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    from fq.model import demo_model

    d = tmp_path_factory.mktemp("demo")
    demo_model.write(d / "model", d / "text")
    return d


def _differences(a, b, path="", out=None):
    """(relative difference, path) of every float that differs, and every other value that differs (inf)."""
    out = [] if out is None else out
    if isinstance(a, dict) and isinstance(b, dict) and set(a) == set(b):
        for k in a:
            _differences(a[k], b[k], f"{path}/{k}", out)
    elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b)):
            _differences(x, y, f"{path}[{i}]", out)
    elif isinstance(a, float) and isinstance(b, float):
        if a != b:
            out.append((abs(a - b) / max(abs(a), abs(b)), path))
    elif a != b:
        out.append((float("inf"), path))
    return out


@pytest.mark.slow
def test_streamed_measurement_is_the_in_memory_one(demo):
    """Two windows of 32 tokens, two label samples, K2 injected (and c(K2) encoded); the streams capped at two units
    a pass, so the injection takes six passes over the layers."""
    from fq.workflow.allocation import measure

    text = (demo / "text" / "calibration.txt").read_text()
    args = dict(ks=(2, 16), rows=2, columns=32, samples=2, seed=3)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = measure(demo / "model", text, **args)
        reports = []
        got = measure(demo / "model", text, streamed=True, stream_bytes=2 * 2 * 32 * 256 * 4, report=reports.append,
                      **args)
    finally:
        torch.set_num_threads(before)
    # the forward reads 3 layers and the head, the Fisher 3 layers, each pass from its first unit's layer to the head
    assert reports == [{"layer_reads": 4 + 3 + sum(4 - s for s in (0, 1, 1, 2, 2, 3)), "passes": 6}]
    assert len(ref["units"]) == 11 and ref["experts"] and ref["injected"]["L0.attention"]["2"] > 0
    diffs = sorted(_differences(ref, got), reverse=True)
    # the experts' forms come from their inputs and output gradients in float64 (the in-memory path rounds each
    # weight gradient to float32 first): equal to float tolerance; every other value bit for bit
    others = [d for d in diffs if not d[1].startswith("/experts/")]
    assert not others, f"{len(others)} values differ, the largest: {others[:5]}"
    assert all(r < 1e-5 for r, _ in diffs), f"the experts' forms differ by up to {diffs[:3]}"


def test_passes_group_units_in_layer_order_within_the_cap():
    layers = {"L0.attention": 0, "L0.dense": 0, "L1.attention": 1, "head": 3}
    assert passes.plan(layers, 4, 100, 800) == [["L0.attention", "L0.dense"], ["L1.attention", "head"]]
    assert passes.plan(layers, 4, 100, 1) == [[u] for u in layers]  # at least one unit a pass
    assert passes.layer_reads(3, [["L0.attention", "L0.dense"], ["L1.attention", "head"]], layers) == 4 + 3 + 4 + 3


def test_a_family_without_a_chain_is_refused_by_name(tmp_path):
    """DeepSeek-V4 has no calibration chain: the streamed measurement says so before reading a weight."""
    import json
    import struct

    from fq.errors import FqError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV4ForCausalLM"],
                                                      "model_type": "deepseek_v4"}))
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 2) + b"{}")
    with pytest.raises(FqError, match="DeepseekV4ForCausalLM .DeepSeek-V4. has no calibration chain.*fq allocate"):
        streamed.Source(tmp_path, 8)


def test_a_budgeted_campaign_on_a_family_without_a_chain_is_refused_when_the_config_is_read():
    from types import SimpleNamespace

    from fq.errors import FqError
    from fq.workflow.campaign import _check_streamable

    recipe = SimpleNamespace(source="budget.json")
    with pytest.raises(FqError, match="DeepseekV4ForCausalLM .DeepSeek-V4. has no calibration chain.*fq allocate"):
        _check_streamable(recipe, SimpleNamespace(family="deepseek_v4"))
    _check_streamable(recipe, SimpleNamespace(family="glm4_moe"))


def test_fq_allocate_takes_the_stream_options_with_streamed_only(demo, tmp_path, capsys):
    from fq.cli import main

    base = ["allocate", "--model", str(demo / "model"), "--text", str(demo / "text" / "calibration.txt"),
            "--out", str(tmp_path / "a.json"), "--bits", "3", "--rows", "1", "--columns", "16"]
    assert main(base + ["--stream-gib", "1"]) == 2
    assert "--stream-gib 1.0: a positive size, with --streamed" in capsys.readouterr().err
    assert main(base + ["--device", "cuda:0"]) == 2
    assert "--device cuda:0: with --streamed" in capsys.readouterr().err
    assert not (tmp_path / "a.json").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixtral"])
def test_other_families_stream_as_they_run_in_memory(case, tmp_path):
    """A tiny random Mixtral (checkpoint names renamed to the module's, sliding attention), as
    tests/test_hessian_families.py saves it: the streamed measurement equals the in-memory one, every value bit for
    bit but the experts' forms (float tolerance). DeepSeek-V3 (MLA, a dense first layer, group-limited routing) and
    Qwen3-MoE pass too (13 s and 8 s: left out of CI)."""
    import json

    from transformers import AutoModelForCausalLM

    from fq.allocation import measure
    from tests.test_hessian_families import VOCAB, _save_tiny

    d = _save_tiny(case, tmp_path / "model")
    windows = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        runs = [measure.unit_options(model, windows, [2, 16], samples=1, seed=0),
                streamed.unit_options(d, windows, [2, 16], samples=1, seed=0)]
    finally:
        torch.set_num_threads(before)
    a, b = (json.loads(json.dumps({"options": o, "weights": w, "injected": fit["injected"],
                                   "efficiency": fit["efficiency"],
                                   "quad": {n: s.quad for n, s in sens.linears.items()}}, default=str))
            for o, w, sens, fit in runs)
    diffs = sorted(_differences(a, b), reverse=True)
    others = [x for x in diffs if not (x[1].startswith("/quad/") and ".experts." in x[1])]
    assert not others and len(a["options"]) >= 10, others[:5]
    assert all(r < 1e-4 for r, _ in diffs), diffs[:3]


def test_a_streamed_measurement_from_scratch_is_byte_identical(demo):
    """The campaign's sensitivity job twice from the same inputs: the same bytes (one window of 16 tokens; K16
    alone, so no encode and no injection: the forward and the Fisher pass, whose experts' forms are the streamed
    path's own)."""
    from fq.core import canonical
    from fq.workflow.allocation import measure

    text = (demo / "text" / "calibration.txt").read_text()
    a, b = (canonical.dumps(measure(demo / "model", text, ks=(16,), rows=1, columns=16, samples=1, seed=3,
                                    streamed=True)) for _ in range(2))
    assert a == b and b'"experts"' in a
