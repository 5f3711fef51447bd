"""benchmarks/calib_price_fit.py: a rehearsal run's chain jobs read back (walls less their GPU waits, CUDA processes
matched in chain order) and the rates refitted; checked on a run made up from known rates, which the fit returns."""
from __future__ import annotations

import datetime as dt
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import calib_price_fit as fit  # noqa: E402

HEAD = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
RATES = {"read_mb_s": 200.0, "write_mb_s": 400.0, "tflops": 20.0, "setup_s": 5.0}


def _stamp(t: float) -> str:
    return dt.datetime.fromtimestamp(t).strftime("%Y/%m/%d %H:%M:%S.%f")


def made_up_run(d: Path) -> None:
    """plan.json of the full-width rehearsal at 16 experts, and its chain as if run at RATES: benchmark walls (plus
    a GPU wait for layer 2), logs, one CUDA process a GPU job spanning its priced GPU seconds."""
    from fq.model import rehearsal
    from fq.model.source import load_sizes, load_source
    from fq.planning.calibration_cost import price_calibration, price_chain
    from fq.planning.recipe import load_recipe

    meta = d / "meta"
    rehearsal.write_metadata(meta, replace(rehearsal.GLM5, experts=16))
    src = load_source(meta, sizes=load_sizes(meta / "sizes.json"))
    (d / "plan.json").write_text(json.dumps({"source": src.summary() | {"dense_layers": [0], "moe_layers": [1, 2]}}))
    chain = price_chain(price_calibration(src, 250, 2048, **RATES), src,
                        load_recipe(ROOT / "recipes" / "rehearsal-glm5.json"))
    pids, smi, t = [], [], 1_800_000_000.0
    for i, j in enumerate(chain.jobs):
        leaf = "embed" if j.kind == "embed" else "head" if j.kind == "head" else f"layer{j.layer:03d}"
        wait = 30.0 if j.layer == 2 else 0.0
        (d / "benchmarks" / "calibration").mkdir(parents=True, exist_ok=True)
        (d / "logs" / "calibration").mkdir(parents=True, exist_ok=True)
        (d / "benchmarks" / "calibration" / f"{leaf}.tsv").write_text(
            HEAD + f"{j.seconds + wait}\t0\t1\t1\t1\t1\t0\t0\t0\t1\n")
        (d / "logs" / "calibration" / f"{leaf}.log").write_text(
            f"fq: claimed cuda:0 after {wait:.2f} s waiting\n" if j.kind != "embed" else "")
        if j.kind != "embed":
            pid = str(100 + i)
            pids.append(f"{pid}\tpython3 /x/tmpab.calib_{'head' if j.kind == 'head' else 'layer'}.py")
            smi += [f"{_stamp(t)}, {pid}, 10", f"{_stamp(t + j.gpu_seconds)}, {pid}, 10"]
        t += j.seconds + wait + 1
    (d / "pids.tsv").write_text("\n".join(pids) + "\n")
    (d / "smi_apps.csv").write_text("\n".join(smi) + "\n")


def test_the_fit_returns_the_rates_a_run_was_made_with(tmp_path, capsys):
    made_up_run(tmp_path)
    got = fit.measured(tmp_path)
    assert sorted(got) == ["embed", "head", "layer 0", "layer 1", "layer 2"]
    assert got["embed"]["gpu_s"] is None and got["layer 1"]["gpu_s"] > 0
    assert fit.main([str(tmp_path), "--fit", "--setup-s", "5"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("fitted: "))
    rates = dict(kv.rsplit(" ", 1) for kv in line.removeprefix("fitted: ").split(", "))
    for k, v in RATES.items():
        assert float(rates[k]) == pytest.approx(v, rel=0.01), k
    assert "| layer 2 | 1.485 |" in out


def test_a_run_of_another_source_is_refused(tmp_path, capsys):
    made_up_run(tmp_path)
    plan = json.loads((tmp_path / "plan.json").read_text())
    plan["source"]["revision"] = "local:sha256:" + "0" * 64
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    assert fit.main([str(tmp_path)]) == 1
    assert "not a full-width rehearsal" in capsys.readouterr().err
