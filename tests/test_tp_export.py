"""fq tp-export: per-rank shards by whole tiles, attestations naming the unsliced fragments, the signed
index, refusals, and the tp-export / mesh-plan commands."""
import json
import shutil

import pytest
import torch
from safetensors import safe_open

from tests.kits import provkit
from tests.kits import tpkit
from fq.cli import main
from fq.core.canonical import loads, sha256_hex
from fq.errors import FqError
from fq.model.experts import STANDARD
from fq.provenance.attest import dsse, keys
from fq.tp import records
from fq.tp.mesh import Slice
from fq.tp.slicing import slice_exl3
from fq.tp.sources import ExportSource
from tests.kits.tpkit import one_thread  # noqa: F401  (autouse fixture)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tp-export")
    c = tpkit.build(tmp)
    return c, tmp, tpkit.export(c, tmp / "tp2-ep2", 2, 2)


def predicate(path):
    env = loads(path.read_bytes())
    return json.loads(dsse.b64decode(env["payload"], "x"))["predicate"]


def test_layout_and_attestations_name_the_unsliced_fragments(world):
    c, _, res = world
    out = res.path
    names = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert names[:4] == ["export.intoto.jsonl", "rank-ep0-tp0/k2-layer001-block000.safetensors",
                         "rank-ep0-tp0/k2-layer001-block000.safetensors.intoto.jsonl",
                         "rank-ep0-tp0/k2-layer003-block000.safetensors"]
    assert "replicated.safetensors" in names and not any(".tmp-" in n for n in names)
    # ep 0 owns experts 0-3 (block 0), ep 1 experts 4-7 (block 1); r2 only corrects hot experts 1, 2, 5
    assert sorted(n for n in names if n.startswith("rank-ep1-tp0/") and n.endswith(".safetensors")) == [
        f"rank-ep1-tp0/{n}-layer00{L}-block001.safetensors" for n in ("k2", "r1", "r2") for L in (1, 3)]
    assert res.bytes_per_rank[(0, 0)] == res.bytes_per_rank[(0, 1)]
    plan = tpkit.product_source(c).predicate
    frags = {f["name"]: f for f in plan["fragments"]}
    index = predicate(out / "export.intoto.jsonl")
    assert index["mesh"] == {"tp": 2, "ep": 2} and index["plan_sha256"] == sha256_hex(c.plans["k2r1r2"].read_bytes())
    assert len(index["files"]) == res.files == 1 + 4 * 6  # routers + per rank: k2, r1, r2 for two layers
    for f in index["files"]:
        p = predicate(out / (f["name"] + ".intoto.jsonl"))
        assert sha256_hex((out / (f["name"] + ".intoto.jsonl")).read_bytes()) == f["attestation_sha256"]
        assert sha256_hex((out / f["name"]).read_bytes()) == f["sha256"]
        if p["kind"] == "replicated":
            assert [t["name"] for t in p["tensors"]] == [tpkit.rname(1), tpkit.rname(3)]
            assert all(t["source"]["name"] == f"base/k2/{provkit.SOURCE_SHARD}" for t in p["tensors"])
            continue
        src = frags[p["source"]["name"]]
        assert (p["source"]["sha256"], p["source"]["attestation_sha256"]) == (src["sha256"], src["attestation_sha256"])
        unsliced = {e["expert"]: e["sha256"] for e in src["experts"]}
        t = p["coords"]["tp"]
        for e in p["experts"]:
            assert e["source_sha256"] == unsliced[e["expert"]]
            assert e["slices"] == {"gate_proj": {"dim": 0, "start": 256 * t, "stop": 256 * (t + 1)},
                                   "up_proj": {"dim": 0, "start": 256 * t, "stop": 256 * (t + 1)},
                                   "down_proj": {"dim": 1, "start": 256 * t, "stop": 256 * (t + 1)}}


def test_rank_shards_hold_the_fragments_own_words_cut_by_tiles(world):
    c, _, res = world
    path = res.path / "rank-ep1-tp1/r2-layer003-block001.safetensors"
    with safe_open(path, "pt") as f:  # a plain safetensors reader loads it; keys are the fragment's
        meta = f.metadata()
        assert meta["kind"] == "expert" and json.loads(meta["coords"]) == {"ep": 1, "tp": 1}
        for proj in ("gate_proj", "down_proj"):
            got = {s: f.get_tensor(STANDARD.key(3, 5, proj, s)) for s in ("trellis", "suh", "svh")}
            dim = 0 if proj == "gate_proj" else 1
            want = slice_exl3(c.sets[("r2", 3, 5, proj)], Slice(dim, 256, 512))
            assert all(torch.equal(got[s], want[s]) for s in got)
        assert got["trellis"].shape == (256 // 16, 128 // 16, 32)  # down: rows of tiles cut (in 512 -> 256)


def test_same_inputs_same_bytes_and_refusals(world, tmp_path):
    c, tmp, res = world
    again = tpkit.export(c, tmp_path / "again", 2, 2)
    for p in res.path.rglob("*"):
        if p.is_file():
            assert p.read_bytes() == (again.path / p.relative_to(res.path)).read_bytes()
    assert again.index_sha256 == res.index_sha256
    with pytest.raises(FqError, match="exists; an export is written once"):
        tpkit.export(c, tmp_path / "again", 2, 2)
    with pytest.raises(FqError, match=r"out 512 / 8 = 64 is not a multiple of 128 .*TP sizes that work for this "
                                      r"manifest: 1, 2, 4; or use expert parallelism"):
        tpkit.export(c, tmp_path / "tp8", 8)
    with pytest.raises(FqError, match="8 experts do not divide over ep=3"):
        tpkit.export(c, tmp_path / "ep3", 1, 3)
    assert not (tmp_path / "tp8").exists() and not list(tmp_path.glob(".tmp-*"))


def test_loader_refuses_tampered_exports(world, tmp_path):
    c, _, res = world
    other, _, _ = keys.generate(tmp_path / "other")
    with pytest.raises(FqError, match="no valid signature by the pinned key"):
        ExportSource(res.path, keys.load_public(str(other).replace(".key", ".pub")))
    bad = tmp_path / "bad"
    shutil.copytree(res.path, bad)
    a, b = bad / "rank-ep0-tp0/k2-layer001-block000.safetensors.intoto.jsonl", \
        bad / "rank-ep0-tp1/k2-layer001-block000.safetensors.intoto.jsonl"
    a.write_bytes(b.read_bytes())  # a validly signed attestation of another rank's shard
    src = ExportSource(bad, c.pub)
    p = tpkit.mesh_plan(src, 2, 2)
    with pytest.raises(FqError, match="not the attestation the export index names"):
        src.admit(p, [0])
    src.admit(p, [1, 2, 3])


def test_records_schema(world):
    c, _, res = world
    p = predicate(res.path / "replicated.safetensors.intoto.jsonl")
    with pytest.raises(FqError, match=r"predicate.tensors\[0\].length"):
        records.sign([("x", "0" * 64)], records.SHARD, {**p, "tensors": [{**p["tensors"][0], "length": 1.0}]}, c.priv)
    with pytest.raises(FqError, match="unknown .* record kind 'other'"):
        records.validate(records.SHARD, {**p, "kind": "other"}, "x")


def test_cli(world, tmp_path, capsys):
    c, _, _ = world
    base = ["--key", str(c.pub_path), str(c.plans["k2r1r2"])]
    assert main(["mesh-plan", *base, "--tp", "2", "--ep", "2", "--pp", "2", "--epoch", "3"]) == 0
    out = capsys.readouterr().out
    assert "mesh tp=2 ep=2 pp=2 epoch 3: 8 ranks" in out and "boundary: stage 0 -> 1 after layer 1" in out
    assert "rank 7 (pp 1 ep 1 tp 1):" in out and "layer 3 down experts 4-7: in[256:512] [Shard(expert), Shard(1)]" in out
    assert "#1 all_reduce model.layers.3.mlp.experts.down_reduce (layer 3, stage 1) over tpxep: groups [[4, 5, 6, 7]]" in out
    assert main(["mesh-plan", *base, "--tp", "4", "--json"]) == 0
    j = json.loads(capsys.readouterr().out)
    assert j["format"] == "fq-mesh-plan/1" and len(j["schedule"]) == 2 and len(j["devices"]) == 4
    state = tmp_path / "state.json"
    assert main(["tp-export", *base, "--tp", "2", "--sign-key", str(c.key_path), "--out", str(tmp_path / "x"),
                 "--state", str(state)]) == 0
    out = capsys.readouterr().out
    assert f"wrote {tmp_path / 'x'}: 25 shards for tp=2 ep=1 (contiguous)" in out and "rank-ep0-tp1: " in out
    assert json.loads(state.read_text())  # the plan version was recorded
    assert main(["tp-export", *base, "--tp", "8", "--sign-key", str(c.key_path), "--out", str(tmp_path / "y"),
                 "--no-state"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fq tp-export: model.layers.1.mlp.experts.0.gate_proj.weight: "
                                                   "out 512 / 8 = 64 is not a multiple of 128")
    with pytest.raises(SystemExit):
        main(["tp-export", *base, "--tp", "0", "--sign-key", str(c.key_path), "--out", str(tmp_path / "z")])
    assert "'0' is not a positive integer" in capsys.readouterr().err


def test_an_export_can_be_bound_to_the_signed_product_plan(world, tmp_path):
    """The exporter's key vouches for the export; pinning the product plan as well checks every claim about
    the unsliced fragments against the campaign's signed plan (without reading unsliced payload)."""
    c, _, _ = world
    key_path, pub_path, _ = keys.generate(tmp_path / "exporter")
    priv, pub = keys.load_private(key_path), keys.load_public(pub_path)
    from fq.tp.export import tp_export
    out = tp_export(c.plans["k2r1r2"], c.pub, tmp_path / "x", tp=2, sign_key=priv, now=provkit.NOW).path
    product = tpkit.product_source(c)
    p = tpkit.mesh_plan(product, 2)
    ExportSource(out, pub, product=product).admit(p, [0, 1])
    with pytest.raises(FqError, match="not the pinned product plan"):
        ExportSource(out, pub, product=tpkit.product_source(c, "k2r1"))

    # an exporter that lies about a source digest (validly signed with its own key)
    att = out / "rank-ep0-tp0/r1-layer001-block000.safetensors.intoto.jsonl"
    env = loads(att.read_bytes())
    st = json.loads(dsse.b64decode(env["payload"], "x"))
    st["predicate"]["experts"][0]["source_sha256"] = "0" * 64
    line = records.sign([(s["name"], s["digest"]["sha256"]) for s in st["subject"]], records.SHARD, st["predicate"], priv)
    att.write_bytes(line)
    index = predicate(out / "export.intoto.jsonl")
    for f in index["files"]:
        if f["name"] == "rank-ep0-tp0/r1-layer001-block000.safetensors":
            f["attestation_sha256"] = sha256_hex(line)
    (out / "export.intoto.jsonl").write_bytes(
        records.sign([(f["name"], f["sha256"]) for f in index["files"]], records.EXPORT, index, priv))
    ExportSource(out, pub).admit(p, [0, 1])  # consistent under the exporter's key alone
    with pytest.raises(FqError, match="expert 0 names an unsliced digest the pinned plan does not"):
        ExportSource(out, pub, product=product).admit(p, [0, 1])
