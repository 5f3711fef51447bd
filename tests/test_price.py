"""Pricing: the packaged H200 cost table, dag vs lean on GLM-5, wall time and storage, `fq price`."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fq.cli import main
from fq.errors import FqError
from fq.model.source_synth import glm5_like, synthetic_checkpoint, write_synthetic
from fq.planning.calibration_cost import DEFAULT_LDLQ_FACTOR, DEFAULT_TFLOPS
from fq.planning.plan import encoded_expert_bytes, make_plan
from fq.planning.price import load_cost_table, parse_cost_table, price_recipe, price_table
from fq.planning.recipe import load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
GOLDEN = ROOT / "tests" / "data" / "exl3_matrix_golden.json"
TB = 10**12


@pytest.fixture(scope="module")
def table():
    return load_cost_table()


@pytest.fixture(scope="module")
def priced(glm5, table):
    return {name: price_recipe(load_recipe(RECIPES / f"glm52-k2k3-{name}.json"), glm5, table, gpus=8,
                               disk_budget=int(1.6 * TB)) for name in ("dag", "lean")}


REFERENCE_TABLE = ROOT / "fq" / "data" / "cost_table_reference.json"


def test_default_table_is_fq_measured_on_the_h200(table):
    # fq calibrate on an H200 (docs/benchmarks.md): every codebook x K 1..8 x GLM-5 shape, measured whole
    doc = json.loads((ROOT / "fq" / "data" / "cost_table.json").read_text())
    section = doc["gpus"]["NVIDIA H200"]
    assert section["encoder"].startswith("fq.codec.quantize")
    assert table.gpu == "NVIDIA H200" and table.measured_share == (3 * 8 * 2, 3 * 8 * 2)
    for e in section["entries"]:
        assert e["origin"] == "measured" and "fq calibrate" in e["basis"] and len(e["samples"]) == 3
    # fq's whole pipeline beats the reference's on every measured GLM-5 matrix
    for run in json.loads(GOLDEN.read_text())["pipeline_speed_h200"]:
        assert table.seconds("mul1", run["K"], tuple(run["shape_out_in"]))[0] < run["pipeline_s"]


def test_reference_table_measured_entries_are_the_reference_timings():
    ref = load_cost_table(REFERENCE_TABLE)
    golden = json.loads(GOLDEN.read_text())["pipeline_speed_h200"]
    assert ref.gpu == "NVIDIA H200"
    for run in golden:
        assert ref.seconds("mul1", run["K"], tuple(run["shape_out_in"])) == (run["pipeline_s"], False)
        assert ref.origin_by_key[("mul1", run["K"], *run["shape_out_in"])] == "measured"
    measured, total = ref.measured_share
    assert measured == len(golden) and total == 3 * 8 * 2


def test_reference_table_says_what_is_derived():
    doc = json.loads(REFERENCE_TABLE.read_text())
    section = doc["gpus"]["NVIDIA H200"]
    for e in section["entries"]:
        assert e["origin"] in ("measured", "derived") and e["basis"]
    tps = section["inputs"]["tiles_per_s"]
    assert tps["mcg"]["2"] == {**tps["mcg"]["2"], "value": 74289, "origin": "measured"}  # anchors, default kernel
    assert tps["mul1"]["8"]["origin"] == "derived" and "K4" in tps["mul1"]["8"]["basis"]
    assert tps["3inst"]["1"]["origin"] == "derived"
    # derived = overhead(shape) + tiles / tiles_per_s
    ov = section["inputs"]["overhead_s"]["2048x6144"]["value"]
    k1 = next(e for e in section["entries"] if (e["codebook"], e["K"], e["shape"]) == ("mcg", 1, [2048, 6144]))
    assert k1["seconds"] == pytest.approx(ov + 49152 / tps["mcg"]["1"]["value"], abs=1e-4)


def test_dag_vs_lean(priced):
    dag, lean = priced["dag"], priced["lean"]
    assert (dag.recipe["passes"], dag.recipe["encoded_bpw"], dag.recipe["nominal_bpw"]) == (9, 14, 35)
    assert (lean.recipe["passes"], lean.recipe["encoded_bpw"], lean.recipe["nominal_bpw"]) == (7, 12, 26)
    # every node encodes 75 layers x 256 experts x 3 matrices
    assert all(3 * n.experts == 57600 for n in dag.nodes)
    ratio = lean.gpu_seconds / dag.gpu_seconds
    # lean drops two K1 passes: (3 c1 + 3 c2 + c3) / (5 c1 + 3 c2 + c3) with the table's per-K costs
    c = {n.K: n.seconds_per_expert for n in dag.nodes}
    assert ratio == pytest.approx((3 * c[1] + 3 * c[2] + c[3]) / (5 * c[1] + 3 * c[2] + c[3]))
    assert 0.70 < ratio < 0.78  # the seed measured 0.7093 on its own encoder; fq's H200 table gives 0.75
    assert dag.gpu_hours == pytest.approx(sum(n.gpu_seconds for n in dag.nodes) / 3600)
    assert lean.published_bytes < dag.published_bytes


def test_storage(glm5, priced):
    dag = priced["dag"]
    node = {n.name: n for n in dag.nodes}
    assert node["k2"].output_bytes == 19200 * encoded_expert_bytes(glm5, 2)
    # 2 bits/weight of trellis plus fp16 suh/svh (16 bits x (in+out)) and the int32 marker per matrix
    assert node["k2"].output_bytes * 8 / (19200 * glm5.expert_params) == pytest.approx(2 + (16 * 8192 + 32) / (2048 * 6144), abs=1e-9)
    prod = {p.name: p for p in dag.products}
    assert prod["k2.r2.r1"].bytes == glm5.skeleton_bytes + sum(node[n].output_bytes for n in ("k2", "k2.r2", "k2.r2.r1"))
    assert prod["k2.r2.r1"].increment_bytes == node["k2.r2.r1"].output_bytes
    assert dag.published_bytes == 2 * glm5.skeleton_bytes + sum(n.output_bytes for n in dag.nodes)


def test_wall_time_and_billing(glm5, table, priced):
    lean = priced["lean"]
    one, eight = lean.option(1), lean.option(8)
    # the first window's download and the final verify overlap nothing
    assert one.first_window_s > 0 and one.first_window_s == eight.first_window_s
    assert eight.verify_s == pytest.approx(lean.published_bytes / 908e6)
    assert eight.wall_s == pytest.approx(eight.encode_done_s + eight.verify_s)
    # (relative 1e-12: the model sums the same seconds in another order)
    assert one.encode_done_s >= (one.first_window_s + lean.gpu_seconds) * (1 - 1e-12)
    assert eight.encode_done_s >= (eight.first_window_s + lean.gpu_seconds / 8) * (1 - 1e-12)
    # more GPUs: shorter wall, never cheaper (idle staging is billed on every GPU)
    walls = [o.wall_s for o in lean.options]
    usd = [o.usd for o in lean.options]
    assert walls == sorted(walls, reverse=True) and usd == sorted(usd)
    assert one.usd == pytest.approx(one.billed_gpu_hours * 3.0)
    # a slow link: later windows cannot be hidden behind encode and wall time grows
    slow = price_recipe(load_recipe(RECIPES / "glm52-k2k3-lean.json"), glm5, table, gpus=8,
                        download_bytes_per_s=10e6, disk_budget=int(1.6 * TB))
    assert slow.option(8).encode_done_s > eight.encode_done_s + 20 * 3600
    # windows_on_disk = 1 serialises staging and encode
    serial = price_recipe(load_recipe(RECIPES / "glm52-k2k3-lean.json"), glm5, table, gpus=8, windows_on_disk=1,
                          windows="3-40,41-77")
    assert serial.option(8).encode_done_s == pytest.approx(
        sum(w.stage_bytes for w in make_plan(load_recipe(RECIPES / "glm52-k2k3-lean.json"), glm5,
                                             windows="3-40,41-77").windows) / 125e6 + serial.gpu_seconds / 8)


def test_hot_stage_priced_by_its_experts(glm5, table):
    hot = price_recipe(load_recipe(RECIPES / "glm52-k2-hot96.json"), glm5, table, gpus=1)
    node = {n.name: n for n in hot.nodes}
    assert node["k2.r1.h96"].experts == 96 * 75 and node["k2.r1"].experts == 256 * 75


def test_price_parameters_validated(glm5, table):
    r = load_recipe(RECIPES / "glm52-k2k3-lean.json")
    for kw, needle in [({"gpus": 0}, "gpus"), ({"usd_per_gpu_hour": -1}, "usd"),
                       ({"download_bytes_per_s": 0}, "download"), ({"gpus": 2.5}, "gpus")]:
        with pytest.raises(FqError, match=needle):
            price_recipe(r, glm5, table, **kw)


def test_cost_table_errors(table):
    doc = json.loads((ROOT / "fq" / "data" / "cost_table.json").read_text())
    doc["gpus"]["Other GPU"] = {"encoder": "x", "entries": [{"codebook": "mul1", "K": 2, "shape": [128, 128],
                                                              "seconds": 0.01, "origin": "measured"}]}
    with pytest.raises(FqError, match="holds 2 GPU models.*--gpu-model"):
        parse_cost_table(doc, "t.json")
    other = parse_cost_table(doc, "t.json", "Other GPU")
    assert other.seconds("mul1", 2, (256, 128)) == (pytest.approx(0.02), True)  # scaled per tile
    with pytest.raises(FqError, match="no entry for codebook mcg K2 .*fq cost-table"):
        other.seconds("mcg", 2, (128, 128))
    with pytest.raises(FqError, match="no GPU model 'B200'"):
        parse_cost_table(doc, "t.json", "B200")
    doc["gpus"]["Other GPU"]["entries"].append(dict(doc["gpus"]["Other GPU"]["entries"][0]))
    with pytest.raises(FqError, match="repeats codebook mul1 K2 shape 128x128"):
        parse_cost_table(doc, "t.json", "Other GPU")
    doc["gpus"]["Other GPU"]["entries"][0]["shape"] = [100, 128]
    with pytest.raises(FqError, match="entries\\[0\\].shape\\[0\\]"):
        parse_cost_table(doc, "t.json", "Other GPU")


def test_fq_price_cli_two_recipes(tmp_path, capsys):
    src = write_synthetic(tmp_path / "glm5", *glm5_like())
    rc = main(["price", str(RECIPES / "glm52-k2k3-dag.json"), str(RECIPES / "glm52-k2k3-lean.json"),
               "--model", str(src), "--sizes", str(src / "sizes.json"), "--gpus", "4", "--usd-per-gpu-hour", "2.5",
               "--disk-budget", "1.6TB"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "9 passes emitting 14 bpw; 9 products spanning 35 nominal bpw" in out
    assert "7 passes emitting 12 bpw; 7 products spanning 26 nominal bpw" in out
    assert "cost ratio glm52-k2k3-lean / glm52-k2k3-dag: 0.7" in out
    assert "$2.50 per GPU-hour" in out and "NVIDIA H200" in out and "48 of 48 entries measured" in out
    assert out.count("\n   4 ") == 2  # a row for 4 GPUs per recipe
    rc = main(["price", str(RECIPES / "glm52-k2k3-dag.json"), "--model", str(src), "--sizes", str(src / "sizes.json"),
               "--gpus", "0"])
    assert rc == 2 and "gpus: expected a positive integer, got 0" in capsys.readouterr().err


def test_fq_price_small_model_scales_per_tile(tmp_path, capsys):
    c, i, s = synthetic_checkpoint("mixtral", hidden=256, inter=128, n_experts=8, n_layers=2, vocab=512,
                                   shard_bytes=1_000_000)
    src = write_synthetic(tmp_path / "mx", c, i, s)
    rc = main(["price", str(RECIPES / "demo.json"), "--model", str(src), "--sizes", str(src / "sizes.json"), "--gpus", "1"])
    captured = capsys.readouterr()
    assert rc == 0 and "demo" in captured.out  # pricing a hot stage needs only N per layer, not the statistics
    rc = main(["price", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(src), "--sizes", str(src / "sizes.json"),
               "--gpus", "1"])
    out = capsys.readouterr().out
    assert rc == 0 and "priced per tile" in out


def test_calibration_is_priced_from_the_shapes_and_shares_the_disk(glm5, table):
    """GLM-5 at exllamav3's 250 x 2048 calibration: every chain job (embed, 3 dense and 75 MoE layers; no head job
    for experts-only bases), the Hessians' bytes, the LDLQ premium, and a disk budget that now holds the Hessians
    too (fewer layers per window)."""
    from fq.hessian.store import layer_bytes
    from fq.planning.calibration_cost import attention_core_flops, price_calibration, price_chain

    recipe = load_recipe(RECIPES / "glm52-k2k3-dag.json")
    c = price_calibration(glm5, 250, 2048)
    assert c.layers == tuple(range(3, 78)) and c.hessian_bytes_per_layer == layer_bytes(6144, 2048, 256) == 2_224_041_984
    chain = price_chain(c, glm5, recipe)
    assert [j.kind for j in chain.jobs] == ["embed"] + ["dense"] * 3 + ["moe"] * 75
    t = 250 * 2048
    # MLA per layer: q_a 2048x6144, q_b 16384x2048, kv_a 576x6144, kv_b 28672x512, o 6144x16384; the DSA indexer's
    # wq_b 4096x2048, wk 128x6144, weights_proj 32x6144; the shared expert 3 x 2048x6144
    attention = 2048 * 6144 + 16384 * 2048 + 576 * 6144 + 28672 * 512 + 6144 * 16384 + 4096 * 2048 + 128 * 6144 \
        + 32 * 6144
    routed = 8 * 6 * 6144 * 2048 + 256 * (4 * 6144 * 2048 + 2 * 2048 ** 2) + 2 * 6144 ** 2
    moe = next(j for j in chain.jobs if j.kind == "moe")
    assert moe.flops == pytest.approx(2 * t * (attention + 3 * 2048 * 6144) + t * routed
                                      + attention_core_flops(glm5, 250, 2048))
    assert 8.2e15 < moe.flops < 8.5e15 and 400 < moe.seconds < 600 and moe.gpu_seconds < moe.seconds
    assert 9 * 3600 < chain.seconds < 12 * 3600 and 6.5 * 3600 < chain.gpu_seconds < 8.5 * 3600
    plain = price_recipe(recipe, glm5, table, gpus=8, disk_budget=1_600_000_000_000)
    cal = price_recipe(recipe, glm5, table, gpus=8, disk_budget=1_600_000_000_000, calibration=c)
    encode_s = sum(n.gpu_seconds for n in plain.nodes)
    assert sum(n.gpu_seconds for n in cal.nodes) == pytest.approx(DEFAULT_LDLQ_FACTOR * encode_s)
    assert cal.gpu_seconds == pytest.approx(DEFAULT_LDLQ_FACTOR * encode_s + chain.gpu_seconds)
    assert cal.chain.jobs == chain.jobs
    assert cal.peak_local_bytes <= 1_600_000_000_000 < plain.peak_local_bytes + c.disk_bytes
    assert len(cal.windows) > len(plain.windows)
    # the chain is serial (each job starts from the previous one's hidden states): no number of GPUs ends the
    # encodes before staging and the whole chain have
    eight = cal.options[-1]
    assert eight.gpus == 8 and eight.encode_done_s >= max(eight.first_window_s + chain.seconds,
                                                          plain.options[-1].encode_done_s)
    slow = price_calibration(glm5, 250, 2048, tflops=5)  # a capture slower than 8 GPUs' encodes sets the pace
    slow_cal = price_recipe(recipe, glm5, table, gpus=8, disk_budget=1_600_000_000_000, calibration=slow)
    assert slow_cal.options[-1].encode_done_s >= slow_cal.chain.seconds > plain.options[-1].encode_done_s
    assert cal.options[0].encode_done_s == pytest.approx(cal.gpu_seconds + cal.options[0].first_window_s, rel=0.05)
    with pytest.raises(FqError, match="calibration alone needs"):
        price_recipe(recipe, glm5, table, disk_budget=c.disk_bytes, calibration=c)
    with pytest.raises(FqError, match="calibration rows"):
        price_calibration(glm5, 0, 2048)


@pytest.fixture(scope="module")
def tiny_glm5(tmp_path_factory):
    """The rehearsal's CPU twin as config, index and sizes only (1 dense + 1 MoE layer of 4 experts, top-2; GLM-5's
    head dims, MLA and DSA indexer at hidden 256), every tensor in one shard."""
    from fq.model import rehearsal
    from fq.model.source import load_sizes, load_source

    d = tmp_path_factory.mktemp("tiny-glm5")
    rehearsal.write_metadata(d, rehearsal.tiny(experts=4, dense_layers=1, moe_layers=1), shard_bytes=10**9)
    return load_source(d, sizes=load_sizes(d / "sizes.json"))


def test_every_chain_job_is_counted_from_the_shapes(tiny_glm5):
    """The chain of the rehearsal's recipe (a whole-model base quantizing attention, shared, dense and head) on the
    tiny twin, 2 x 8 tokens, counted by hand: FLOPs of each job, bytes read and written, seconds at round rates."""
    from fq.hessian.store import layer_bytes, packed_len
    from fq.planning.calibration_cost import price_calibration, price_chain

    src, t, rows, cols = tiny_glm5, 16, 2, 8
    c = price_calibration(src, rows, cols, tflops=1, read_mb_s=1, write_mb_s=2, setup_s=3)
    chain = price_chain(c, src, load_recipe(RECIPES / "rehearsal-glm5.json"))
    embed, dense, moe, head = chain.jobs
    assert [(j.kind, j.layer) for j in chain.jobs] == [("embed", None), ("dense", 0), ("moe", 1), ("head", None)]
    # linears (out, in): MLA q_a, q_b (2 heads x 256), kv_a (512 + 64), kv_b (2 x (192 + 256)), o; the indexer's
    # wq_b (4 heads x 128), wk, weights_proj
    attention = [(256, 256), (512, 256), (576, 256), (896, 512), (256, 512), (512, 256), (128, 256), (4, 256)]
    dense_mlp = [(512, 256), (512, 256), (256, 512)]
    shared = [(128, 256), (128, 256), (256, 128)]
    # the core: every (query, key) pair of a row (DSA's mask is materialized), 2 heads x (256 + 256) dims; the
    # indexer's scores: 4 heads x (128 + 1)
    core = rows * (2 * cols * cols * 2 * (256 + 256) + 2 * cols * cols * 4 * (128 + 1))
    linear = lambda shapes: sum(2 * t * o * i for o, i in shapes)  # noqa: E731
    sums = lambda widths: sum(2 * t * n * n for n in widths)  # noqa: E731
    attention_groups = [256, 256, 512, 512]  # q_a + kv_a (one input), q_b, kv_b, o (heads x v_head)
    assert dense.flops == linear(attention + dense_mlp) + core + sums(attention_groups + [256, 512])
    routed = 2 * t * 6 * 256 * 128 + 4 * t * 4 * 256 * 128 + 4 * 2 * t * 128 ** 2 + 2 * t * 256 ** 2
    assert moe.flops == linear(attention + shared) + core + routed + sums(attention_groups + [256, 128])
    assert (embed.flops, head.flops) == (0, 2 * t * 256 ** 2)
    hidden, (shard,) = t * 256 * 4, src.shards
    # a layer job reads its own tensors' ranges (checked against the staged shard's range index), not the shard:
    # FP8 linears, a byte a weight and a float32 scale a 128 x 128 block; the embeddings (512 x 256) in bf16
    stored = lambda shapes: sum(o * i + 4 * -(-o // 128) * -(-i // 128) for o, i in shapes)  # noqa: E731
    experts = 4 * stored([(128, 256), (128, 256), (256, 128)])
    assert (embed.read_bytes, embed.written_bytes) == (512 * 256 * 2, hidden)
    dense_hessians = 4 * sum(packed_len(n) for n in attention_groups + [256, 512])
    moe_hessians = 4 * sum(packed_len(n) for n in attention_groups + [256, 128]) + layer_bytes(256, 128, 4)
    assert (dense.read_bytes, dense.written_bytes) == (hidden + stored(attention + dense_mlp), hidden + dense_hessians)
    assert (moe.read_bytes, moe.written_bytes) == (hidden + stored(attention + shared) + experts, hidden + moe_hessians)
    assert moe.read_bytes < hidden + src.shard_sizes[shard]
    # the head job verifies the committed skeleton shard holding the final norm, then reads it
    assert (head.read_bytes, head.written_bytes) == (hidden + 2 * src.shard_skeleton_bytes(shard), 4 * packed_len(256))
    for j in chain.jobs:
        assert j.seconds == pytest.approx(3 + j.read_bytes / 1e6 + j.written_bytes / 2e6 + j.flops / 1e12)
        assert j.gpu_seconds == (0 if j is embed else pytest.approx(j.written_bytes / 2e6 + j.flops / 1e12))
    # an experts-only recipe captures no linear: no head job, the chain ends at the last calibrated layer
    lean = price_chain(c, src, load_recipe(RECIPES / "glm52-k2k3-lean.json"))
    assert [j.kind for j in lean.jobs] == ["embed", "dense", "moe"]
    assert lean.jobs[1].flops == linear(attention + dense_mlp) + core


def test_the_whole_chain_is_on_the_critical_path_and_in_the_gpu_hours(tiny_glm5, table):
    """embed -> layers -> head, one after the other, before the last window's encodes can end, whatever the GPUs;
    the chain's GPU-held seconds in the GPU-hours and, with one GPU, in its load."""
    from fq.planning.calibration_cost import price_calibration

    recipe = load_recipe(RECIPES / "rehearsal-glm5.json")
    c = price_calibration(tiny_glm5, 250, 2048)
    p = price_recipe(recipe, tiny_glm5, table, gpus=8, calibration=c)
    chain = p.chain
    assert [j.kind for j in chain.jobs] == ["embed", "dense", "moe", "head"]
    assert p.gpu_seconds == pytest.approx(sum(n.gpu_seconds for n in p.nodes) + sum(ln.gpu_seconds for ln in p.linears)
                                          + chain.gpu_seconds)
    for o in p.options:
        assert o.encode_done_s >= o.first_window_s + chain.seconds
    assert p.options[0].encode_done_s >= p.options[0].first_window_s + p.gpu_seconds
    assert "through 4 chain jobs, one after the other" in price_table(p)


# What the GLM-5-size rehearsal measured on one H100 80GB (/work/rehearsal-h100-run1: Snakemake's benchmark walls
# less each job's wait for the GPU lock; recipes/rehearsal-glm5.json, 250 x 2048 tokens, 16 experts a MoE layer)
REHEARSAL_H100_WALL_S = {"embed": 40.2, "layer 0": 133.4, "layer 1": 148.9, "layer 2": 182.0 - 33.5,
                         "head": 127.2 - 64.7}


def test_the_default_rates_price_the_rehearsals_chain_within_20_percent(tmp_path):
    """Issue 43: the price within +-20% of every chain job's measured wall, at the defaults fitted to that run."""
    from dataclasses import replace

    from fq.model import rehearsal
    from fq.model.source import load_sizes, load_source
    from fq.planning.calibration_cost import price_calibration, price_chain

    rehearsal.write_metadata(tmp_path, replace(rehearsal.GLM5, experts=16))
    src = load_source(tmp_path, sizes=load_sizes(tmp_path / "sizes.json"))
    chain = price_chain(price_calibration(src, 250, 2048), src, load_recipe(RECIPES / "rehearsal-glm5.json"))
    priced = {j.name: j.seconds for j in chain.jobs}
    assert priced.keys() == REHEARSAL_H100_WALL_S.keys()
    for name, measured in REHEARSAL_H100_WALL_S.items():
        assert 0.8 * measured <= priced[name] <= 1.2 * measured, (name, priced[name], measured)


def test_fq_price_calibration_flag(tmp_path, capsys):
    d = write_synthetic(tmp_path / "glm5", *glm5_like())
    assert main(["price", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(d), "--sizes", str(d / "sizes.json"),
                 "--calibration", "250x2048"]) == 0
    out = capsys.readouterr().out
    assert "calibration (projected, all-experts capture): 250 x 2048 tokens through 79 chain jobs" in out
    assert "MoE layers    75 jobs" in out
    assert "LDLQ encodes priced at 1.35x" in out
    assert main(["price", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(d), "--sizes", str(d / "sizes.json"),
                 "--calibration", "lots"]) == 2


@pytest.mark.parametrize("args,message", [
    (["--calibration", "\u00b2x2048"], "--calibration: expected ROWSxCOLS"),  # superscript two passes str.isdigit
    (["--calibration", "9" * 30 + "x" + "9" * 30], "calibration rows: expected an integer in 1..1000000"),
    (["--calibration", "250x2000000"], "calibration columns: expected an integer in 1..1048576"),
    (["--calibration", "250x2048", "--ldlq-factor", "inf"], "LDLQ encode factor: expected a number above 0 and at most 100"),
    (["--calibration", "250x2048", "--ldlq-factor", "nan"], "LDLQ encode factor: expected"),
    (["--calibration", "250x2048", "--calib-tflops", "1e9"], "calibration TFLOP/s: expected a number above 0 and at most"),
    (["--calibration", "250x2048", "--calib-read-mb-s", "0"], "calibration read MB/s: expected a number above 0"),
    (["--calibration", "250x2048", "--calib-write-mb-s", "nan"], "calibration write MB/s: expected a number above 0"),
    (["--calibration", "250x2048", "--calib-setup-s", "-1"], "calibration job setup seconds: expected a number from 0"),
])
def test_fq_price_refuses_numbers_no_one_means(tmp_path, capsys, args, message):
    """Out-of-range or non-ASCII numbers get one line naming the option and its bound, never a price of 1e30 hours
    or a traceback."""
    d = write_synthetic(tmp_path / "glm5", *glm5_like())
    assert main(["price", str(RECIPES / "glm52-k2k3-lean.json"), "--model", str(d), "--sizes", str(d / "sizes.json"),
                 *args]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and err.count("\n") == 1, err


@pytest.mark.parametrize("value", ["-1", "\u00b2", "1.5"])
def test_min_version_is_a_non_negative_integer(value, capsys):
    with pytest.raises(SystemExit) as e:
        main(["combine", "--key", "k.pub", "--plan", "p", "--out", "o", "--min-version", value])
    assert e.value.code == 2 and f"--min-version: {value!r} is not a non-negative integer" in capsys.readouterr().err


def test_fq_plan_calibration_flag_reserves_the_hessians_disk(tmp_path, capsys):
    """fq plan with --calibration chooses windows from the disk budget less calibration's, as fq price does."""
    d = write_synthetic(tmp_path / "glm5", *glm5_like())
    args = ["plan", str(RECIPES / "glm52-k2k3-dag.json"), "--model", str(d), "--sizes", str(d / "sizes.json"),
            "--disk-budget", "1.6TB"]
    assert main(args) == 0
    plain = capsys.readouterr().out
    assert main(args + ["--calibration", "250x2048"]) == 0
    cal = capsys.readouterr().out
    assert "Hessians 2.2 GB per layer, 166.8 GB in all" in cal and "peak local with calibration: 1.590 TB" in cal
    assert "peak local with calibration" not in plain and plain.count("\n") < cal.count("\n")  # more, smaller windows


def test_a_campaign_disk_budget_reserves_calibration_disk_before_choosing_windows(tmp_path):
    """A calibrated campaign's config disk_budget is shared with its Hessians and hidden states, as fq plan and
    fq price count it: more, smaller windows than the weight-only campaign; a budget calibration alone exceeds
    is refused at parse time, naming the setting."""
    from fq.model.source import load_source
    from fq.workflow.campaign import campaign_plan

    d = write_synthetic(tmp_path / "glm5", *glm5_like())
    source = load_source(d, sizes=json.loads((d / "sizes.json").read_text()))
    recipe = load_recipe(RECIPES / "glm52-k2k3-dag.json")
    cfg = {"block_size": 32, "windows_on_disk": 2, "disk_budget": int(1.6 * TB)}
    plain = campaign_plan(cfg, recipe, source)
    cal = campaign_plan(dict(cfg, calibration={"tokens": "t.safetensors", "sha256": "0" * 64}), recipe, source)
    need = 166_800_000_000  # every Hessian: 2.2 GB x 75 layers (the two hidden-state files come on top)
    assert len(cal.windows) > len(plain.windows)
    assert cal.bytes["peak_local"] <= int(1.6 * TB) - need < plain.bytes["peak_local"]
    assert campaign_plan(dict(cfg, calibration=None), recipe, source).windows == plain.windows
    with pytest.raises(FqError, match="config disk_budget: .*calibration alone needs"):
        campaign_plan(dict(cfg, disk_budget=100 * 10**9, calibration={"rows": 250}), recipe, source)


def test_whole_model_bases_are_priced_with_their_linears(glm5, table):
    """A K2 base with attention, shared and dense at K4 and the head at K6, beside an experts-only K2 base, on
    GLM-5's shapes (transformers' own GlmMoeDsa layer on the meta device): bits over the model and over the experts
    side by side, the linear encodes in the GPU-hours, the skeleton bytes they replace out of the stored size."""
    from fq.planning.model_bits import linear_weights
    from fq.planning.price import price_table
    from fq.planning.recipe import parse_recipe

    skel = {"attention": 4, "shared": 4, "dense": 4, "head": 6}
    r = parse_recipe({"format": "fq-cartridge/2", "name": "glm5-whole", "nodes": [
        {"name": "k2", "kind": "base", "K": 2, "codebook": "mcg"},
        {"name": "w2", "kind": "base", "K": 2, "codebook": "mcg", "skeleton": skel}],
        "products": [{"name": "k2", "chain": ["k2"]}, {"name": "w2", "chain": ["w2"]}]}, "r.json")
    w = linear_weights(glm5)
    # MLA per layer: q_a 2048x6144, q_b 16384x2048, kv_a 576x6144, kv_b 28672x512, o 6144x16384
    assert w["attention"] == 78 * (2048 * 6144 + 16384 * 2048 + 576 * 6144 + 28672 * 512 + 6144 * 16384)
    assert w["shared"] == 75 * 3 * 2048 * 6144 and w["dense"] == 3 * 3 * 12288 * 6144
    assert w["head"] == 154880 * 6144 and w["experts"] == 75 * 256 * 3 * 2048 * 6144
    p = price_recipe(r, glm5, table)
    k2, w2 = p.products
    lin = {ln.name: ln for ln in p.linears}
    assert sorted(lin) == ["attention-K4-mcg", "dense-K4-mcg", "head-K6-mcg", "shared-K4-mcg"]
    assert lin["attention-K4-mcg"].matrices == 78 * 5 and lin["head-K6-mcg"].matrices == 1
    assert lin["attention-K4-mcg"].replaced_bytes == 2 * w["attention"]
    assert w2.bytes == k2.bytes - sum(ln.replaced_bytes for ln in p.linears) + sum(ln.output_bytes for ln in p.linears)
    assert (k2.model_bpw, k2.head_bits, w2.head_bits) == (pytest.approx(2.3229, abs=1e-4), 16, 6)
    assert 2 < w2.model_bpw < k2.model_bpw and k2.bpw == w2.bpw == 2
    assert p.gpu_seconds == pytest.approx(sum(n.gpu_seconds for n in p.nodes) + sum(ln.gpu_seconds for ln in p.linears))
    # w2's experts are k2's encoding (same K and codebook): priced once, published in both bases
    nodes = {n.name: n for n in p.nodes}
    assert (nodes["w2"].experts_from, nodes["w2"].experts, nodes["w2"].gpu_seconds) == ("k2", 0, 0.0)
    assert nodes["k2"].gpu_seconds > 0 and nodes["w2"].output_bytes == nodes["k2"].output_bytes
    alone = price_recipe(parse_recipe({"format": "fq-cartridge/2", "name": "k2", "nodes": [
        {"name": "k2", "kind": "base", "K": 2, "codebook": "mcg"}], "products": [{"name": "k2", "chain": ["k2"]}]},
        "k2.json"), glm5, table)
    assert p.gpu_seconds == pytest.approx(alone.gpu_seconds + sum(ln.gpu_seconds for ln in p.linears))
    assert p.published_bytes == alone.published_bytes + w2.bytes and p.recipe["passes"] == 1
    text = price_table(p)
    assert "(the experts of k2, encoded once)" in text
    assert "bpw experts" in text and "bpw model" in text and "attention-K4-mcg" in text
    # calibrated: each linear encodes alone, its LDLQ paying the table's seconds times the LDLQ factor and a
    # per-input-channel term (fitted on the H200: GLM-5's added jobs measured 0.32 GPU-h; docs/benchmarks.md)
    from fq.planning.calibration_cost import price_calibration
    from fq.planning.model_bits import linear_shapes
    from fq.codec.shape import padded_shape
    from fq.planning.price import LINEAR_LDLQ_S_PER_INPUT

    cal = price_calibration(glm5, 250, 2048)
    pc = price_recipe(r, glm5, table, calibration=cal)
    shapes = linear_shapes(glm5)
    for ln in pc.linears:
        mine = [s for c, s in shapes.values() if c == ln.name.split("-")[0]]
        want = sum(table.seconds("mcg", ln.K, padded_shape(s))[0] * cal.ldlq_factor + LINEAR_LDLQ_S_PER_INPUT * s[1]
                   for s in mine)
        assert ln.gpu_seconds == pytest.approx(want)
    assert 0.25 < sum(ln.gpu_seconds for ln in pc.linears) / 3600 < 0.45


def test_a_half_integer_k_adds_its_search_on_the_hosts_cores(table):
    """No CUDA frac kernel: K1.5 is the K2 entry plus tiles x passes / the host's rate on an encode job's threads, at
    a GLM-5 expert shape minutes against K2's fraction of a second, and marked scaled."""
    from fq.planning.price import FRAC_PASSES_PER_TILE, HOST_FRAC_TILES_S

    shape = (2048, 6144)
    k2, scaled2 = table.seconds("mul1", 2, shape)
    half, scaled = table.seconds("mul1", 1.5, shape)
    host = 2048 * 6144 / 256 * FRAC_PASSES_PER_TILE / HOST_FRAC_TILES_S
    assert scaled and not scaled2 and half == pytest.approx(k2 + host)
    assert 300 < host < 500 and k2 < 1


def test_the_half_integer_price_assumes_the_gpu_profiles_encode_threads():
    """ENCODE_THREADS copies profiles/local-gpu's set-threads for encode: the two change together."""
    import yaml

    from fq.planning.price import ENCODE_THREADS

    profile = yaml.safe_load((ROOT / "profiles" / "local-gpu" / "config.yaml").read_text())
    threads = dict(item.split("=") for item in profile["set-threads"])
    assert int(threads["encode"]) == ENCODE_THREADS
