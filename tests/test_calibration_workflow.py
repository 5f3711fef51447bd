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

from fq.core import canonical
from test_workflow import RECIPE, campaign, smk, write_config

pytestmark = pytest.mark.slow

CALIBRATION = {"text": None, "sha256": None, "rows": 4, "columns": 64, "capture": "all-experts"}
RECIPE2 = dict(RECIPE, nodes=RECIPE["nodes"][:2], products=RECIPE["products"][:2])  # base + one stage: fewer jobs


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def statement(p: Path) -> dict:
    env = canonical.loads(p.with_name(p.name + ".intoto.jsonl").read_bytes())
    return canonical.loads(base64.b64decode(env["payload"]))


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    d = tmp_path_factory.mktemp("cal")
    write_config(d, RECIPE2, calibration=CALIBRATION)
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


def test_a_calibrated_fragment_re_encodes_byte_identically(cal):
    c = campaign(cal)
    f = c.fragments[-1]
    path = Path(c.fragment(f.node, f.block))
    before = path.read_bytes(), path.with_name(path.name + ".intoto.jsonl").read_bytes()
    path.unlink()
    smk(cal)
    assert (path.read_bytes(), path.with_name(path.name + ".intoto.jsonl").read_bytes()) == before


def test_a_recapture_that_differs_from_the_bound_hessian_is_refused(cal):
    """A resumed campaign whose Hessian file is gone re-captures it when an encode of its layer must run (the whole
    chain up to it runs again: its hidden states were temp); a capture that is not byte-identical to the bound one
    (another machine, another torch) is refused, and the binding is left as it was."""
    c = campaign(cal)
    h, binding = Path(c.hessian(2)), Path(c.hessian_binding(2))
    kept, bound = h.read_bytes(), binding.read_bytes()
    f = next(f for f in c.fragments if f.block.layer == 2 and f.node == "a.r1")  # a leaf: nothing descends from it
    frag = Path(c.fragment(f.node, f.block))
    frag_bytes = frag.read_bytes()
    doc = json.loads(bound)
    binding.write_text(json.dumps(dict(doc, sha256="0" * 64)))  # as if an earlier capture had given other bytes
    h.unlink()
    frag.unlink()
    try:
        p = smk(cal, check=False)
        assert p.returncode != 0
        log = (cal / "campaign" / "logs" / "calibration" / "layer002.log").read_text()
        assert "bound layer 2's Hessian to " + "0" * 64 in log and "delete its fragments" in log
        assert json.loads(binding.read_text())["sha256"] == "0" * 64 and not h.exists()
    finally:
        binding.write_bytes(bound)
    others = {g: Path(c.fragment(g.node, g.block)).stat().st_mtime_ns for g in c.fragments if g != f}
    smk(cal)  # the same capture again: accepted; only the deleted fragment is encoded, byte-identical
    assert h.read_bytes() == kept and frag.read_bytes() == frag_bytes
    assert {g: Path(c.fragment(g.node, g.block)).stat().st_mtime_ns for g in c.fragments if g != f} == others


def test_an_encode_refuses_a_hessian_file_that_is_not_the_bound_one(cal):
    c = campaign(cal)
    h = Path(c.hessian(1))
    kept = h.read_bytes()
    f = next(f for f in c.fragments if f.block.layer == 1)
    frag = Path(c.fragment(f.node, f.block))
    saved = {p: p.read_bytes() for p in (frag, frag.with_name(frag.name + ".intoto.jsonl"))}
    shutil.copyfile(c.hessian(2), h)  # a valid Hessian file, not this layer's bound one
    frag.unlink()
    try:
        p = smk(cal, check=False)
        assert p.returncode != 0
        logs = "".join(q.read_text() for q in (cal / "campaign" / "logs" / "encode").glob("*layer001*.log"))
        assert "sha256" in logs and canonical.load(c.hessian_binding(1))["sha256"] in logs
    finally:
        h.write_bytes(kept)
        for q, data in saved.items():
            q.write_bytes(data)
    smk(cal)


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
        att.write_bytes(kept)
    smk(cal, "--forcerun", "finalize")


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
