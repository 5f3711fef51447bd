"""Codec -> fragments -> attestations -> assembly -> verify -> combine -> reconstruct, and the CLI."""
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open

from tests.kits import provkit
from fq.cli import main
from fq.codec import quantize, quantize_residual, reconstruct, reconstruct_chain
from fq.model.experts import STANDARD
from fq.provenance.adapter import read_adapter
from fq.provenance.assembly import PlanState, read_assembly
from fq.provenance.attest import dsse, keys
from fq.provenance.attest.statement import ADAPTER, parse_statement
from fq.provenance.combine import combine
from fq.provenance.fragments import fragment_filename
from fq.provenance.verify import verify_path

NOW = provkit.NOW


def base_set(c, layer, expert, proj):
    """The base's tensor set of one linear, as the consumer loads it from the base fragment."""
    path = c.root / "base/k2" / fragment_filename("k2", layer, expert // provkit.BLOCK)
    with safe_open(path, "pt") as f:
        return {s: f.get_tensor(STANDARD.key(layer, expert, proj, s)) for s in ("trellis", "suh", "svh", "mul1")}


@pytest.fixture(scope="module")
def codec_campaign(tmp_path_factory):
    """Layer 1 expert 1 gate_proj encoded by the real codec along the whole chain k2 -> r1 -> r2."""
    dims = {p: (128, 128) for p in provkit.DIMS}
    W = torch.randn(128, 128, generator=torch.Generator().manual_seed(7)) * 0.02
    k2 = quantize(W, 2, "mul1", seed=0)
    r1 = quantize_residual(W, [k2], 1, "mcg", seed=1)
    r2 = quantize_residual(W, [k2, r1], 2, "3inst", seed=2)
    sets = {("k2", 1, 1, "gate_proj"): k2, ("r1", 1, 1, "gate_proj"): r1, ("r2", 1, 1, "gate_proj"): r2}
    c = provkit.build_campaign(tmp_path_factory.mktemp("codec"), codec_sets=sets, dims=dims)
    return c, W, sets


def test_round_trip_with_the_real_codec(codec_campaign, tmp_path):
    c, W, sets = codec_campaign
    report = verify_path(c.root, c.pub, now=NOW)
    assert report.ok, report.problems
    assert (report.shards, report.manifests, report.assemblies) == (13, 1, 2)
    out = tmp_path / "k2r1r2-e1.safetensors"
    res = combine(c.plans["k2r1r2"], c.pub, out, experts="1:1", now=NOW)
    assert res.experts == [(1, 1)]
    adapter = read_adapter(out)
    chain = adapter.chain(1, 1, "gate_proj", base_set(c, 1, 1, "gate_proj"))
    direct = reconstruct_chain([sets["k2", 1, 1, "gate_proj"], sets["r1", 1, 1, "gate_proj"],
                                sets["r2", 1, 1, "gate_proj"]])
    assert torch.equal(reconstruct_chain(chain), direct)
    assert torch.equal(sum(reconstruct(t) for t in chain), direct)
    # and the chain does what residual stages are for
    errs = [float((reconstruct_chain(chain[:n]) - W).square().sum() / W.square().sum()) for n in (1, 2, 3)]
    assert errs[0] > errs[1] > errs[2]


def test_combine_equals_the_chain_for_every_chosen_expert(tmp_path, campaign_copy):
    c = campaign_copy
    out = tmp_path / "a.safetensors"
    res = combine(c.plans["k2r1r2"], c.pub, out, experts="0-2,5", now=NOW)
    assert res.experts == [(layer, e) for layer in provkit.LAYERS for e in (0, 1, 2, 5)]
    adapter = read_adapter(out)
    assert [s["node"] for s in adapter.stages] == ["r1", "r2"]
    for layer in provkit.LAYERS:
        for e in (0, 1, 2, 5):
            for proj in STANDARD.projections:
                chain = adapter.chain(layer, e, proj, base_set(c, layer, e, proj))
                want = [c.sets["k2", layer, e, proj], c.sets["r1", layer, e, proj]]
                if e in provkit.HOT:
                    want.append(c.sets["r2", layer, e, proj])
                assert len(chain) == len(want)
                for got, exp in zip(chain, want):
                    assert got.keys() == exp.keys() and all(torch.equal(got[k], exp[k]) for k in got)
                assert torch.equal(reconstruct_chain(chain), reconstruct_chain(want))
    with safe_open(out, "pt") as f:
        keys_ = set(f.keys())
        assert "model.layers.1.mlp.experts.0.gate_proj.stage1.mcg" in keys_
        assert "model.layers.1.mlp.experts.0.gate_proj.stage2.trellis" not in keys_  # 0 is not hot
        assert "model.layers.3.mlp.experts.5.down_proj.stage2.svh" in keys_
        assert f.metadata()["product"] == "k2r1r2"


def test_adapter_attestation_names_plan_and_bytes(tmp_path, campaign_copy):
    c = campaign_copy
    out = tmp_path / "a.safetensors"
    res = combine(c.plans["k2r1"], c.pub, out, experts="3:4-7", now=NOW, sign_key=c.priv)
    line = res.attestation.read_bytes()
    subjects, pred = parse_statement(dsse.open_envelope(line, c.pub, "adapter"), "adapter", ADAPTER)
    import hashlib
    assert subjects == [(out.name, hashlib.sha256(out.read_bytes()).hexdigest())]
    plan = read_assembly(c.plans["k2r1"], c.pub, now=NOW)
    assert pred["plan_sha256"] == plan.sha256 and pred["product"] == "k2r1"
    assert [(e["layer"], e["expert"]) for e in pred["experts"]] == [(3, 4), (3, 5), (3, 6), (3, 7)]
    assert pred["stages"] == [{"index": 1, "node": "r1", "K": 1, "codebook": "mcg"}]


def test_combine_is_deterministic(tmp_path, campaign_copy):
    c = campaign_copy
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    combine(c.plans["k2r1r2"], c.pub, a, now=NOW)
    combine(c.plans["k2r1r2"], c.pub, b, now=NOW)
    assert a.read_bytes() == b.read_bytes()


def test_campaign_rebuild_is_byte_identical(tmp_path):
    """Shards carry no timestamps: the same inputs give the same fragment bytes (keys differ, so the
    attestations do not, but the signed payload about the fragment does only in the signer)."""
    a = provkit.build_campaign(tmp_path / "a", seed=3)
    b = provkit.build_campaign(tmp_path / "b", seed=3)
    for p in sorted(a.root.rglob("*.safetensors")):
        assert p.read_bytes() == (b.root / p.relative_to(a.root)).read_bytes(), p


def test_narrowing_never_reads_unchosen_payload(tmp_path, campaign_copy):
    """Corrupt expert 7's bytes in every fragment: a selection without it still combines, reading only
    the chosen ranges; a selection with it is refused."""
    c = campaign_copy
    plan = read_assembly(c.plans["k2r1r2"], c.pub, now=NOW).predicate
    for f in plan["fragments"]:
        for e in f["experts"]:
            if e["expert"] == 7:
                p = c.root / f["name"]
                data = bytearray(p.read_bytes())
                data[e["offset"] + 10] ^= 0xFF
                p.write_bytes(bytes(data))
    res = combine(c.plans["k2r1r2"], c.pub, tmp_path / "ok.safetensors", experts="1:1,2", now=NOW)
    chosen = [e for f in plan["fragments"] if f["node"] != "k2" and f["layer"] == 1 for e in f["experts"]
              if e["expert"] in (1, 2)]
    assert res.payload_bytes_read == sum(e["length"] for e in chosen)
    assert not any("block001" in p for p in res.fragments_opened)  # block 1 holds no chosen expert
    with pytest.raises(Exception, match="bytes of expert 7 do not match"):
        combine(c.plans["k2r1r2"], c.pub, tmp_path / "bad.safetensors", experts="7", now=NOW)


def test_combine_with_base_compares_the_checkpoint_on_disk(tmp_path, campaign_copy):
    c = campaign_copy
    res = combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", experts="0", base_dir=c.root / "base/k2", now=NOW)
    base_ranges = [e for f in read_assembly(c.plans["k2r1"], c.pub, now=NOW).predicate["fragments"]
                   for e in f["experts"] if e["expert"] == 0]
    assert res.payload_bytes_read == sum(e["length"] for e in base_ranges)  # base + stage ranges of expert 0


def test_plan_state_records_and_accepts_newer(tmp_path, campaign_copy):
    c = campaign_copy
    state = PlanState(tmp_path / "state.json")
    combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, state=state)
    combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, state=state)  # same plan again: fine
    c.replan("k2r1", 2)
    combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, state=state)
    assert '"version": 2' in (tmp_path / "state.json").read_text()


# --- CLI ---
def test_cli_keygen_verify_combine(tmp_path, capsys, campaign_copy):
    assert main(["keygen", "--out", str(tmp_path / "k")]) == 0
    assert "fingerprint:" in capsys.readouterr().out
    assert main(["keygen", "--out", str(tmp_path / "k")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already exists" in err

    c = campaign_copy
    fp = keys.fingerprint(c.pub)
    assert main(["verify", str(c.root), "--key", str(c.pub_path), "--fingerprint", fp]) == 0
    assert "13 shards, 1 base manifests, 2 plans" in capsys.readouterr().out
    frag = c.root / c.frag("r1", 1, 0)
    assert main(["verify", str(frag), "--key", str(c.pub_path)]) == 0
    capsys.readouterr()
    out = tmp_path / "adapter.safetensors"
    rc = main(["combine", "--key", str(c.pub_path), "--plan", str(c.plans["k2r1r2"]), "--experts", "1,2",
               "--base", str(c.root / "base/k2"), "--out", str(out), "--state", str(tmp_path / "st.json")])
    assert rc == 0 and out.exists() and "stages: r1 (K=1 mcg), r2 (K=2 3inst)" in capsys.readouterr().out

    # wrong key: one line (not one per signed document; issue 15), exit 1
    assert main(["keygen", "--out", str(tmp_path / "other")]) == 0
    capsys.readouterr()
    assert main(["verify", str(c.root), "--key", str(tmp_path / "other.pub")]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fq verify: ") and "none of the 17 signed documents" in lines[0]
    assert main(["verify", str(c.root), "--key", str(c.pub_path), "--fingerprint", "ab" * 32]) == 2
    assert main(["combine", "--key", str(c.pub_path), "--plan", str(c.plans["k2r1"]), "--experts", "1-",
                 "--out", str(out), "--no-state"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("fq combine: --experts: '1-' is not a list")


def test_cli_errors_are_one_line_without_traceback(tmp_path, campaign_copy):
    c = campaign_copy
    frag = c.root / c.frag("r1", 1, 0)
    frag.write_bytes(frag.read_bytes()[:-5])
    r = subprocess.run([sys.executable, "-m", "fq", "combine", "--key", str(c.pub_path), "--plan",
                        str(c.plans["k2r1"]), "--out", str(tmp_path / "x.safetensors"), "--no-state"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "truncated" in r.stderr


def test_changing_one_stage_reencodes_only_that_node(tmp_path, campaign_copy):
    """The recipe changes r2 (K=2 -> K=3): r2's node digest changes, k2's and r1's do not, and the campaign
    identity does not name the recipe, so only r2 is re-encoded; every untouched fragment, the base
    manifest and the k2r1 plan stay valid next to a k2r1r2 plan of the new recipe."""
    from fq.core.canonical import sha256_hex
    from fq.provenance.assembly import build_assembly, write_assembly
    from fq.provenance.attest.fragment import attest_fragment
    from fq.provenance.fragments import write_fragment
    c = campaign_copy
    assert set(c.campaign) == {"name", "source", "block_size", "signer", "encoder"}
    untouched = {p: p.read_bytes() for p in c.root.rglob("*") if p.is_file() and "stages/r2" not in p.as_posix()
                 and "assemblies/k2r1r2" not in p.as_posix() and p.name != "publication.intoto.jsonl"}
    new_def = {**provkit.DEFINITIONS["r2"], "K": 3}
    digests = {n: provkit.node_digest(n, {"r2": new_def}) for n in provkit.NODES}
    assert digests["k2"] == provkit.NODES["k2"]["digest"] and digests["r1"] == provkit.NODES["r1"]["digest"]
    assert digests["r2"] != provkit.NODES["r2"]["digest"]
    gen = torch.Generator().manual_seed(11)
    for layer in provkit.LAYERS:
        for b in range(provkit.N_EXPERTS // provkit.BLOCK):
            experts = {e: {pr: provkit.random_set(o, i, 3, "3inst", gen) for pr, (o, i) in provkit.DIMS.items()}
                       for e in provkit.experts_of("r2", b)}
            if not experts:
                continue
            path = c.root / c.frag("r2", layer, b)
            write_fragment(path, layout=STANDARD, node="r2", role="stage", layer=layer, block=b, K=3,
                           codebook="3inst", experts=experts)
            parent = c.root / c.frag("r1", layer, b)
            attest_fragment(path, key=c.priv, campaign=c.campaign, source=c.source, encoder=provkit.encoder(),
                            quant_args={"seed": 0, "K": 3, "codebook": "3inst"}, node_digest=digests["r2"],
                            parent={"name": parent.name, "sha256": sha256_hex(parent.read_bytes())})
    recipe = provkit.recipe({"r2": new_def}).sha256
    chain = [{**provkit.NODES["k2"]}, {**provkit.NODES["r1"]}, {**new_def, "digest": digests["r2"]}]
    names = [n.relative_to(c.root).as_posix() for d in ("base/k2", "stages/r1", "stages/r2")
             for n in sorted((c.root / d).glob("*-layer*.safetensors"))]
    plan = build_assembly(c.root, product="k2r1r2", chain=chain, fragments=names, base_dir="base/k2",
                          campaign=c.campaign, recipe_sha256=recipe, version=2, expires=provkit.EXPIRES,
                          public_key=c.pub)
    write_assembly(c.root, plan, c.priv)
    assert all(p.read_bytes() == data for p, data in untouched.items())
    assert not verify_path(c.root, c.pub, now=NOW).ok  # the publication statement still lists the old r2 and plan
    # what finalize signs after re-planning: every plan at the publication's version (k2r1's fragments and recipe
    # digest unchanged), then the statement
    provkit._plan(c, "k2r1", 2, provkit.EXPIRES, c.priv)
    provkit.publish(c)
    report = verify_path(c.root, c.pub, now=NOW)
    assert report.ok, report.problems
    assert (report.shards, report.assemblies) == (13, 2)
    res = combine(c.plans["k2r1r2"], c.pub, tmp_path / "a.safetensors", experts="1", now=NOW)
    assert [s["K"] for s in res.stages] == [1, 3]
    assert read_assembly(c.plans["k2r1"], c.pub, now=NOW).predicate["recipe_sha256"] == provkit.RECIPE_SHA256
    assert read_assembly(c.plans["k2r1r2"], c.pub, now=NOW).predicate["recipe_sha256"] == recipe
