"""A calibrated campaign (config ``calibration:``), run for real by Snakemake on the demo model: the calibration
chain, Hessian artifacts bound per layer, LDLQ fragments whose attestations name the bound Hessian, and the
refusals that keep a campaign from mixing Hessians (a re-capture that differs, a swapped Hessian file, a fragment
attesting another Hessian)."""
from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fq.core import canonical
from test_workflow import REPO, RECIPE, campaign, smk, write_config

pytestmark = pytest.mark.slow

CALIBRATION = {"text": None, "sha256": None, "rows": 4, "columns": 64, "capture": "all-experts",
               "compare_weight_only": True}
EVAL = {"text": None, "tokens": 512, "seq_len": 128}  # 4 windows: small, the twins are measured beside each product
# the base and one stage on its 2 hottest experts per layer: a stage's Hessian and twin, with few encodes
RECIPE2 = dict(RECIPE, nodes=[RECIPE["nodes"][0], dict(RECIPE["nodes"][1], experts={"hot": 2})],
               products=RECIPE["products"][:2])
# The campaign plans the stage's experts from the usage recorded with the demo model (config usage:) instead of
# measuring it again (the usage job: test_workflow.py)
USAGE = str(REPO / "fq" / "data" / "demo" / "usage.json")


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def statement(p: Path) -> dict:
    env = canonical.loads(p.with_name(p.name + ".intoto.jsonl").read_bytes())
    return canonical.loads(base64.b64decode(env["payload"]))


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    write_config(d, RECIPE2, calibration=CALIBRATION, eval=EVAL, windows="1-2", usage=USAGE)  # one window: fewer jobs
    smk(d)
    return d


def test_a_calibrated_campaign_binds_its_hessians_and_every_fragment_names_its_own(cal):
    out = cal / "campaign"
    c = campaign(cal)
    assert c.calibrated_layers == (1, 2) and c.calibration_layers == (0, 1, 2)
    for layer in c.calibrated_layers:
        h = Path(c.hessian(layer))
        bound = canonical.load(c.hessian_binding(layer))
        assert bound["sha256"] == sha256(h) and bound["layer"] == layer and bound["capture"] == "all-experts"
        record = canonical.load(c.calib_record(layer))
        assert record["hessian_sha256"] == bound["sha256"]
    assert not list((out / "calibration").glob("hidden-*")), "the chain's hidden states are temp"
    for f in c.fragments:
        path = Path(c.fragment(f.node, f.block))
        qa = statement(path)["predicate"]["quant_args"]
        bound = canonical.load(c.hessian_binding(f.block.layer))
        assert qa["objective"].startswith("LDLQ") and qa["hessian"] == {
            "file": bound["file"], "sha256": bound["sha256"], "calibration": bound["calibration"],
            "capture": "all-experts"}
        metrics = canonical.load(c.metrics(f.node, f.block))
        assert all(0 < m["proxy_err"] < 1 for e in metrics["experts"].values() for m in e.values())
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(out / "published"), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert (out / "report" / "proxy.png").stat().st_size > 0  # the proxy errors, plotted per node and layer
    # the base's derived config says what its Hessians were captured from (exllamav3's rows and cols)
    for name, at in (("config.json", ("quantization_config", "calibration")), ("quantization_config.json", ("calibration",))):
        doc = json.loads((out / "published" / "base" / "a" / name).read_text())
        for k in at:
            doc = doc[k]
        assert doc == {"rows": CALIBRATION["rows"], "cols": CALIBRATION["columns"]}
    from fq.workflow.report import load_proxy

    proxy = load_proxy(c)
    assert sorted(proxy) == ["a", "a.r1"] and sorted(proxy["a"]) == ["down", "gate", "up"]
    assert sorted(proxy["a"]["gate"]) == [1, 2] and len(proxy["a"]["gate"][1]) == 8


def test_a_recapture_that_differs_from_the_bound_hessian_is_refused(cal):
    """A resumed campaign whose Hessian file is gone re-captures it when an encode of its layer must run (the whole
    chain up to it runs again: its hidden states were temp); a capture that is not byte-identical to the bound one
    (another machine, another torch) is refused, and the binding is left as it was."""
    c = campaign(cal)
    h, binding = Path(c.hessian(2)), Path(c.hessian_binding(2))
    kept, bound = h.read_bytes(), binding.read_bytes()
    f = next(f for f in c.fragments if f.block.layer == 2 and f.node == "a.r1")  # a leaf: nothing descends from it
    frag = Path(c.fragment(f.node, f.block))
    frag_bytes, att_bytes = frag.read_bytes(), frag.with_name(frag.name + ".intoto.jsonl").read_bytes()
    doc = json.loads(bound)
    binding.write_text(json.dumps(dict(doc, sha256="0" * 64)))  # as if an earlier capture had given other bytes
    h.unlink()
    frag.unlink()
    try:
        p = smk(cal, str(frag.relative_to(cal)), check=False)
        assert p.returncode != 0
        log = (cal / "campaign" / "logs" / "calibration" / "layer002.log").read_text()
        assert "bound layer 2's Hessian to " + "0" * 64 in log and "delete its fragments" in log
        assert json.loads(binding.read_text())["sha256"] == "0" * 64 and not h.exists()
    finally:
        binding.write_bytes(bound)
    others = {g: Path(c.fragment(g.node, g.block)).stat().st_mtime_ns for g in c.fragments if g != f}
    smk(cal, str(frag.relative_to(cal)))  # the same capture again: accepted; only that fragment is encoded, the same
    # a calibrated re-encode is byte-identical: the fragment and its attestation
    assert h.read_bytes() == kept and frag.read_bytes() == frag_bytes
    assert frag.with_name(frag.name + ".intoto.jsonl").read_bytes() == att_bytes
    assert {g: Path(c.fragment(g.node, g.block)).stat().st_mtime_ns for g in c.fragments if g != f} == others


def test_an_encode_refuses_a_hessian_file_that_is_not_the_bound_one(cal, tmp_path):
    """What every encode job reads its Hessian through (fq.workflow.encode._Hessians -> bound_hessians): a valid
    Hessian file that is not the layer's bound one (here layer 2's, in layer 1's place) is refused, naming the
    bound sha256; the bound one is read."""
    from fq.errors import FqError
    from fq.workflow.calibration import bound_hessians
    from fq.workflow.encode import _Hessians

    c = campaign(cal)
    swapped = tmp_path / Path(c.hessian(1)).name
    shutil.copyfile(c.hessian(2), swapped)
    bound = canonical.load(c.hessian_binding(1))["sha256"]
    with pytest.raises(FqError, match=bound):
        _Hessians({"path": str(swapped), "binding": c.hessian_binding(1)}, 1)
    h, b = bound_hessians(c.hessian(1), c.hessian_binding(1), 1)
    assert h.layer == 1 and b["sha256"] == bound == sha256(Path(c.hessian(1)))


def test_fq_verify_refuses_a_published_layer_with_two_hessians(cal, tmp_path):
    """The consumer's side of the binding: in a published tree (copied), one fragment re-signed by an insider as
    encoded against another Hessian; fq verify names the layer and both objectives."""
    from fq.provenance.attest import dsse, keys

    root = tmp_path / "published"
    shutil.copytree(cal / "campaign" / "published", root)
    frag = sorted(root.glob("base/*/a-layer001-block000.safetensors"))[0]
    st = statement(frag)
    st["predicate"]["quant_args"]["hessian"]["sha256"] = "e" * 64
    priv = keys.load_private(cal / "campaign" / "keys" / "signer.key")
    frag.with_name(frag.name + ".intoto.jsonl").write_bytes(dsse.envelope_line(dsse.sign(canonical.dumps(st), priv)))
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(root), "--key",
                        str(cal / "campaign" / "signer.pub")], capture_output=True, text=True)
    assert p.returncode != 0
    assert "layer 1: its fragments were encoded against 2 different objectives" in p.stdout + p.stderr
    assert "Hessian " + "e" * 64 in p.stdout + p.stderr


def test_weight_only_twins_are_unsigned_reproducible_and_measured_beside_each_product(cal):
    """calibration.compare_weight_only: every fragment also encoded weight-only (a stage against its parent's twin),
    unsigned, never published; fq eval measures each product's twin with the same windows, the report shows both."""
    from safetensors import safe_open

    from fq.codec import encode, encode_residual
    from fq.model.source import PROJECTIONS
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.provenance.summary import summary_view
    from fq.hessian.store import OBJECTIVE_WEIGHT
    from fq.workflow.encode import load_sets, matrix_seed

    out = cal / "campaign"
    c = campaign(cal)
    assert c.weight_only_jobs == c.fragments
    for f in c.fragments:
        twin, real = Path(c.weight_only_tensors(f.node, f.block)), Path(c.fragment(f.node, f.block))
        assert twin.is_file() and not twin.with_name(twin.name + ".intoto.jsonl").exists()
        with safe_open(str(twin), "pt") as a, safe_open(str(real), "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        m = canonical.load(c.weight_only_metrics(f.node, f.block))
        assert m["objective"] == OBJECTIVE_WEIGHT and m["node_digest"] == c.recipe.node_digest(f.node)
    assert not any("weight-only" in str(p) for p in (out / "published").rglob("*"))

    # the base's twin is exactly a direct weight-only encode of the source matrix (same seed); the stage's twin the
    # residual against the base's twin
    stage = next(f for f in c.fragments if f.node == "a.r1")
    base = next(f for f in c.fragments if f.node == "a" and f.block == stage.block)
    layer, e = stage.block.layer, stage.experts[0]
    lp = dict(zip(PROJECTIONS, c.layout.projections))
    twin_a = load_sets(Path(c.weight_only_tensors("a", base.block)), c.layout, layer, [e], "mul1")[e]
    twin_r = load_sets(Path(c.weight_only_tensors("a.r1", base.block)), c.layout, layer, [e], "mul1")[e]
    real_a = load_sets(Path(c.fragment("a", base.block)), c.layout, layer, [e], "mul1")[e]
    for p in ("gate", "down"):
        name = c.source.expert_tensor(layer, e, p)
        with safe_open(str(c.source_dir / c.source.weight_map[name]), "pt") as fh:
            w = fh.get_tensor(name).to(torch.float32)
        direct = encode(w, 3, "mul1", matrix_seed(0, "a", layer, e, p), "cpu").tensors
        assert set(direct) == set(twin_a[p]) and all(torch.equal(direct[k], twin_a[p][k]) for k in direct)
        assert not torch.equal(real_a[p]["trellis"], twin_a[p]["trellis"])  # the calibrated encode is another one
        res = encode_residual(w, [twin_a[p]], 3, "mul1", matrix_seed(0, "a.r1", layer, e, p), "cpu").tensors
        assert all(torch.equal(res[k], twin_r[p][k]) for k in res)
    assert set(stage.experts) < set(base.experts)  # the stage's hot experts of the base's block

    # eval: one weight-only row per product, paired with it; the report's columns; the summary without eval numbers
    doc = canonical.load(out / "eval" / "eval.json")
    assert set(doc["weight_only"]) == {f"{p} (weight-only)" for p in doc["products"]} == {"a (weight-only)",
                                                                                         "a.r1 (weight-only)"}
    for p, row in doc["products"].items():
        twin = doc["weight_only"][row["weight_only"]]
        assert row["weight_only"] == f"{p} (weight-only)" and twin["product"] == p and twin["chain"] == row["chain"]
        assert len(twin["kl_windows"]) == len(row["kl_windows"]) == 4
        assert row["kl_minus_weight_only"] == pytest.approx(row["kl"] - twin["kl"])
        print(f"{p}: calibrated KL {row['kl']:.6g}, weight-only KL {twin['kl']:.6g}")
    assert doc["weight_only"]["a (weight-only)"]["kl"] > doc["products"]["a"]["kl"]  # measured on the K3 base
    tsv = (out / "eval" / "eval.tsv").read_text().splitlines()
    assert sum(line.split("\t")[1] == "weight-only" for line in tsv[1:]) == 2
    rows = {r["product"]: r for r in canonical.load(out / "report" / "products.json")}
    for p, row in doc["products"].items():
        twin = doc["weight_only"][row["weight_only"]]
        assert rows[p]["weight_only_kl"] == twin["kl"] and rows[p]["weight_only_top1"] == twin["top1"]
    assert {"weight_only_kl", "weight_only_top1"} <= set((out / "report" / "products.tsv").read_text().split("\n")[0].split("\t"))
    assert (out / "report" / "kl.png").stat().st_size > 0
    stmt = read_publication(out / "published", keys.load_public(out / "signer.pub"))
    assert canonical.load(out / "campaign_summary.json") == summary_view(stmt.predicate)


def test_finalize_refuses_a_fragment_attesting_another_hessian(cal):
    """An insider (the campaign's own key) re-signs a fragment's attestation naming another Hessian: finalize
    refuses it, naming the fragment and the bound digest."""
    from fq.provenance.attest import dsse, keys

    c = campaign(cal)
    f = c.fragments[0]
    frag = Path(c.fragment(f.node, f.block))
    att = frag.with_name(frag.name + ".intoto.jsonl")
    kept = att.read_bytes()
    st = statement(frag)
    st["predicate"]["quant_args"]["hessian"]["sha256"] = "f" * 64
    priv = keys.load_private(cal / "campaign" / "keys" / "signer.key")
    att.write_bytes(dsse.envelope_line(dsse.sign(canonical.dumps(st), priv)))
    try:
        p = smk(cal, "--forcerun", "finalize", check=False)
        assert p.returncode != 0
        log = (cal / "campaign" / "logs" / "finalize.log").read_text()
        assert frag.name in log and "encoded against Hessian " + "f" * 64 in log
        assert canonical.load(c.hessian_binding(f.block.layer))["sha256"] in log
    finally:
        att.write_bytes(kept)  # the module's last test: no repair run (finalize's outputs went with its failure)
