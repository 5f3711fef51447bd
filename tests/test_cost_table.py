"""`fq cost-table` (formerly `fq calibrate`, still an alias): timing logic with a fake encoder and clock, table
merging, refusals, one real CPU run."""
from __future__ import annotations

import importlib.util
import json

import pytest

from fq.cli import main
from fq.errors import FqError
from fq.planning.cost_table import measure, merge_table, parse_ks, parse_shapes, table_section
from fq.planning.price import default_cost_table_path, load_cost_table, parse_cost_table


def fake_encoder(cost):
    """A quantize stand-in that advances a fake clock by cost(K, codebook, shape)."""
    state = {"t": 0.0, "calls": []}

    def quantize(W, K, codebook="mul1", seed=0, device=None):
        state["calls"].append((tuple(W.shape), K, codebook, device))
        state["t"] += cost(K, codebook, tuple(W.shape))
        return {}

    return quantize, (lambda: state["t"]), state


def test_measure_takes_the_median_after_warmup():
    quantize, clock, state = fake_encoder(lambda K, cb, shape: K * shape[0] * shape[1] / 1e6)
    syncs = []
    entries = measure(quantize, ks=[2, 1], codebooks=["mul1"], shapes=[(256, 128)], device="cpu", repeats=3,
                      warmup=2, synchronize=lambda: syncs.append(1), clock=clock)
    assert [(e["K"], e["shape"]) for e in entries] == [(1, [256, 128]), (2, [256, 128])]
    assert entries[1]["seconds"] == pytest.approx(2 * 256 * 128 / 1e6)
    assert all(e["origin"] == "measured" and len(e["samples"]) == 3 for e in entries)
    assert len(state["calls"]) == 2 * (2 + 3) and state["calls"][0] == ((256, 128), 2, "mul1", "cpu")
    assert len(syncs) == 2 * (1 + 3)  # after warm-up and after every timed run


def test_measure_refuses_bad_values():
    q, clock, _ = fake_encoder(lambda *a: 1.0)
    with pytest.raises(FqError, match="K 9 out of range"):
        measure(q, ks=[9], codebooks=["mul1"], shapes=[(128, 128)], device="cpu")
    with pytest.raises(FqError, match="codebook 'int4'"):
        measure(q, ks=[2], codebooks=["int4"], shapes=[(128, 128)], device="cpu")
    with pytest.raises(FqError, match="shape 100x128 is not a multiple of 128"):
        measure(q, ks=[2], codebooks=["mul1"], shapes=[(100, 128)], device="cpu")
    assert parse_ks("1-4,8") == [1, 2, 3, 4, 8]
    with pytest.raises(FqError, match="K 9 out of range"):
        parse_ks("1-9")
    assert parse_shapes("2048x6144,6144x2048") == [(2048, 6144), (6144, 2048)]
    with pytest.raises(FqError, match="'2048' is not OUTxIN"):
        parse_shapes("2048")


def test_calibrated_table_merges_and_prices():
    q, clock, _ = fake_encoder(lambda K, cb, shape: 0.5 + K / 10)
    entries = measure(q, ks=[1, 2, 3], codebooks=["mcg"], shapes=[(2048, 6144), (6144, 2048)], device="cuda:0",
                      repeats=1, warmup=0, clock=clock)
    reference = json.loads((default_cost_table_path().parent / "cost_table_reference.json").read_text())
    doc = merge_table(reference, "Fake GPU", table_section(entries, "fake", {"repeats": 1}))
    assert set(doc["gpus"]) == {"NVIDIA H200", "Fake GPU"}
    t = parse_cost_table(doc, "merged.json", "Fake GPU")
    assert t.seconds("mcg", 2, (2048, 6144)) == (pytest.approx(0.7), False)
    assert parse_cost_table(doc, "merged.json", "NVIDIA H200").seconds("mul1", 2, (2048, 6144))[0] == 0.991


def test_cli_refuses_without_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible")
    rc = main(["cost-table", "--out", str(tmp_path / "t.json")])
    assert rc == 2
    assert "no CUDA device visible" in capsys.readouterr().err and not (tmp_path / "t.json").exists()
    rc = main(["cost-table", "--out", str(tmp_path / "t.json"), "--device", "tpu"])
    assert rc == 2 and "--device: expected cuda, cuda:N or cpu" in capsys.readouterr().err


def test_cli_cpu_keeps_other_sections(tmp_path, capsys, monkeypatch):
    import fq.codec

    q, clock, _ = fake_encoder(lambda *a: 0.0)
    monkeypatch.setattr(fq.codec, "quantize", q)
    out = tmp_path / "t.json"
    assert main(["cost-table", "--out", str(out), "--device", "cpu", "--k", "2", "--codebook", "mul1",
                 "--shape", "128x128", "--repeats", "1", "--warmup", "0", "--gpu-model", "first"]) == 0
    assert main(["cost-table", "--out", str(out), "--device", "cpu", "--k", "3", "--codebook", "mcg",
                 "--shape", "128x256", "--repeats", "1", "--warmup", "0", "--gpu-model", "second"]) == 0
    doc = json.loads(out.read_text())
    assert set(doc["gpus"]) == {"first", "second"}
    assert doc["gpus"]["second"]["entries"][0]["K"] == 3
    # the old name still runs for one release, and says it is the old name
    capsys.readouterr()
    assert main(["calibrate", "--out", str(out), "--device", "cpu", "--k", "2", "--codebook", "mul1",
                 "--shape", "128x128", "--repeats", "1", "--warmup", "0", "--gpu-model", "third"]) == 0
    assert "fq calibrate is now fq cost-table" in capsys.readouterr().err
    assert set(json.loads(out.read_text())["gpus"]) == {"first", "second", "third"}


@pytest.mark.skipif(importlib.util.find_spec("fq.codec.encoder") is None, reason="codec not built")
def test_cli_cpu_real_codec_tiny_matrix(tmp_path, capsys):
    out = tmp_path / "cpu.json"
    rc = main(["cost-table", "--out", str(out), "--device", "cpu", "--k", "1", "--codebook", "mul1",
               "--shape", "128x128", "--repeats", "1", "--warmup", "0"])
    assert rc == 0, capsys.readouterr().err
    t = load_cost_table(out)
    assert t.gpu.startswith("cpu: ")
    seconds, scaled = t.seconds("mul1", 1, (128, 128))
    assert seconds > 0 and not scaled
