"""A calibrated campaign (config ``calibration:``), run for real by Snakemake on the demo model (cut to its 4 most used
experts a layer: tests/kits/demokit.py, the demo's trained weights, text and usage; half its routed-expert encodes and
twins): the calibration
chain, Hessian artifacts bound per layer, LDLQ fragments whose attestations name the bound Hessian, and the
refusals that keep a campaign from mixing Hessians (a re-capture that differs, a swapped Hessian file, a fragment
attesting another Hessian).

Its base is a whole-model base (recipe ``skeleton``): attention, the shared experts, the dense MLP and lm_head are
quantized too. One linear node per (class, K, codebook) shared by the bases that name it, LDLQ against the linears'
own input Hessians, fragments attested and verified by every consumer, the quantized tensors replacing the bf16 ones
in the base directory, the derived config's whole-model bits, and the CPU runtime loading it (the tests after the
calibration ones; one campaign for both keeps the suite inside its budget)."""
from __future__ import annotations

import base64
import re
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fq.core import canonical
from fq.errors import FqError
from safetensors import safe_open

from tests.test_workflow import REPO, RECIPE, campaign, job_counts, smk, write_config

pytestmark = pytest.mark.slow

CALIBRATION = {"text": None, "sha256": None, "rows": 4, "columns": 64, "capture": "all-experts",
               "compare_weight_only": True}
EVAL = {"text": None, "tokens": 512, "seq_len": 128}  # 4 windows: small, the twins are measured beside each product
# the base and one stage on its 2 hottest experts per layer: a stage's Hessian and twin, with few encodes. The base
# is a whole-model one (recipe skeleton: attention, the shared experts, the dense MLP and lm_head quantized too), so
# the whole-model tests (the rest of this module, after the calibration ones) share this campaign
FULL = {"attention": 4, "shared": 4, "dense": 4, "head": 6}
# the stage also corrects attention (a residual at K2 on the base's K4 linears: tests at the end of the module)
STAGE_SKELETON = {"attention": 2}
RESIDUAL = "attention-K4-mul1+K2-mul1"
# Beside it an experts-only base "e" of the same K and codebook: the two share one encoding of the routed experts
# (recipe Node.experts_from: "e" encodes them, "a" publishes a copy of each of its fragments), so the stage on "a"
# chains on the shared bytes (tests at the end of the module)
EXPERTS_ONLY = {"name": "e", "kind": "base", "K": 3, "codebook": "mul1"}
RECIPE2 = dict(RECIPE, nodes=[dict(RECIPE["nodes"][0], skeleton=FULL),
                              dict(RECIPE["nodes"][1], experts={"hot": 2}, skeleton=STAGE_SKELETON), EXPERTS_ONLY],
               products=[*RECIPE["products"][:2], {"name": "e", "chain": ["e"]}])
# The campaign plans the stage's experts from the usage recorded with the demo model (config usage:) instead of
# measuring it again (the usage job: test_workflow.py). USAGE and BLOCK are the demo's own (a campaign on source: demo);
# the module's campaign is on demokit's cut of it (small_campaign: its usage, its experts a block)
USAGE = str(REPO / "fq" / "data" / "demo" / "usage.json")
BLOCK = 8  # every expert of a layer in one encode job (and one weight-only twin job)


def small_campaign(src: Path) -> dict:
    """The module campaign's config (but its recipe) on demokit's checkpoint ``src``: its calibration and held-out
    text and its usage (the demo's, of the experts it keeps), one window, one block a layer."""
    from tests.kits import demokit

    text = {s: src / "text" / f"{s}.txt" for s in ("calibration", "heldout")}
    return dict(source=demokit.local_source(src), windows="1-2", usage=str(src / "usage.json"),
                block_size=demokit.EXPERTS, eval=dict(EVAL, text=str(text["heldout"])),
                calibration=dict(CALIBRATION, text=str(text["calibration"]), sha256=sha256(text["calibration"])))


def sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def statement(p: Path) -> dict:
    env = canonical.loads(p.with_name(p.name + ".intoto.jsonl").read_bytes())
    return canonical.loads(base64.b64decode(env["payload"]))


@pytest.fixture(scope="module")
def cal(tmp_path_factory):
    from tests.kits import demokit

    d = tmp_path_factory.mktemp("cal")
    # one window, and one block per layer: fewer jobs
    write_config(d, RECIPE2, **small_campaign(demokit.write(tmp_path_factory.mktemp("demo4"))))
    p = smk(d)
    JOBS.update(job_counts(p.stdout + p.stderr))
    return d


# the fresh campaign's jobs per rule: the table Snakemake prints before the first job (what a dry run lists)
JOBS: dict[str, int] = {}


def test_a_calibrated_campaign_binds_its_hessians_and_every_fragment_names_its_own(cal):
    out = cal / "campaign"
    c = campaign(cal)
    assert c.calib.calibrated_layers == (1, 2) and c.calib.chain_layers == (0, 1, 2)
    for layer in c.calib.calibrated_layers:
        h = Path(c.calib.hessian(layer))
        bound = canonical.load(c.calib.hessian_binding(layer))
        assert bound["sha256"] == sha256(h) and bound["layer"] == layer and bound["capture"] == "all-experts"
        record = canonical.load(c.calib.record(layer))
        assert record["hessian_sha256"] == bound["sha256"]
    assert not list((out / "calibration").glob("hidden-*")), "the chain's hidden states are temp"
    for f in c.fragments:
        path = Path(c.fragment(f.node, f.block))
        qa = statement(path)["predicate"]["quant_args"]
        bound = canonical.load(c.calib.hessian_binding(f.block.layer))
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
    assert sorted(proxy) == ["a", "a.r1", "e"] and sorted(proxy["a"]) == ["down", "gate", "up"]
    assert sorted(proxy["a"]["gate"]) == [1, 2] and len(proxy["a"]["gate"][1]) == c.source.n_experts


def test_a_recapture_that_differs_from_the_bound_hessian_is_refused(cal):
    """A resumed campaign whose Hessian file is gone re-captures it when an encode of its layer must run (the whole
    chain up to it runs again: its hidden states were temp); a capture that is not byte-identical to the bound one
    (another machine, another torch) is refused, and the binding is left as it was."""
    c = campaign(cal)
    h, binding = Path(c.calib.hessian(2)), Path(c.calib.hessian_binding(2))
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
    swapped = tmp_path / Path(c.calib.hessian(1)).name
    shutil.copyfile(c.calib.hessian(2), swapped)
    bound = canonical.load(c.calib.hessian_binding(1))["sha256"]
    with pytest.raises(FqError, match=bound):
        _Hessians({"path": str(swapped), "binding": c.calib.hessian_binding(1)}, 1)
    h, b = bound_hessians(c.calib.hessian(1), c.calib.hessian_binding(1), 1)
    assert h.layer == 1 and b["sha256"] == bound == sha256(Path(c.calib.hessian(1)))


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
    from fq.codec import encode, encode_residual
    from fq.model.source import PROJECTIONS
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.provenance.summary import summary_view
    from fq.hessian.store import OBJECTIVE_WEIGHT
    from fq.workflow.encode import load_sets, matrix_seed

    out = cal / "campaign"
    c = campaign(cal)
    # one twin per encoded fragment: "a" publishes the experts of "e", whose twins are its own
    assert c.compare.weight_only_jobs == c.encoded_fragments and c.compare.twin_aliases == {"a": "e"}
    assert c.compare.weight_only_tensors("a", c.fragments[0].block) == c.compare.weight_only_tensors("e", c.fragments[0].block)
    for f in c.compare.weight_only_jobs:
        twin, real = Path(c.compare.weight_only_tensors(f.node, f.block)), Path(c.fragment(f.node, f.block))
        assert twin.is_file() and not twin.with_name(twin.name + ".intoto.jsonl").exists()
        with safe_open(str(twin), "pt") as a, safe_open(str(real), "pt") as b:
            assert a.metadata() == b.metadata() and sorted(a.keys()) == sorted(b.keys())
        m = canonical.load(c.compare.weight_only_metrics(f.node, f.block))
        assert m["objective"] == OBJECTIVE_WEIGHT and m["node_digest"] == c.recipe.node_digest(f.node)
    assert not any("weight-only" in str(p) for p in (out / "published").rglob("*"))

    # the base's twin is exactly a direct weight-only encode of the source matrix (same seed: the encoding base's,
    # "e"); the stage's twin the residual against the base's twin
    stage = next(f for f in c.fragments if f.node == "a.r1")
    base = next(f for f in c.fragments if f.node == "a" and f.block == stage.block)
    layer, e = stage.block.layer, stage.experts[0]
    lp = dict(zip(PROJECTIONS, c.layout.projections))
    twin_a = load_sets(Path(c.compare.weight_only_tensors("a", base.block)), c.layout, layer, [e], "mul1")[e]
    twin_r = load_sets(Path(c.compare.weight_only_tensors("a.r1", base.block)), c.layout, layer, [e], "mul1")[e]
    real_a = load_sets(Path(c.fragment("a", base.block)), c.layout, layer, [e], "mul1")[e]
    for p in ("gate", "down"):
        name = c.source.expert_tensor(layer, e, p)
        with safe_open(str(c.source_dir / c.source.weight_map[name]), "pt") as fh:
            w = fh.get_tensor(name).to(torch.float32)
        direct = encode(w, 3, "mul1", matrix_seed(0, "e", layer, e, p), "cpu").tensors
        assert set(direct) == set(twin_a[p]) and all(torch.equal(direct[k], twin_a[p][k]) for k in direct)
        assert not torch.equal(real_a[p]["trellis"], twin_a[p]["trellis"])  # the calibrated encode is another one
        res = encode_residual(w, [twin_a[p]], 3, "mul1", matrix_seed(0, "a.r1", layer, e, p), "cpu").tensors
        assert all(torch.equal(res[k], twin_r[p][k]) for k in res)
    assert set(stage.experts) < set(base.experts)  # the stage's hot experts of the base's block

    # eval: one weight-only row per product, paired with it; the report's columns; the summary without eval numbers
    doc = canonical.load(out / "eval" / "eval.json")
    assert set(doc["weight_only"]) == {f"{p} (weight-only)" for p in doc["products"]} == {
        "a (weight-only)", "a.r1 (weight-only)", "e (weight-only)"}
    for p, row in doc["products"].items():
        twin = doc["weight_only"][row["weight_only"]]
        assert row["weight_only"] == f"{p} (weight-only)" and twin["product"] == p and twin["chain"] == row["chain"]
        assert len(twin["kl_windows"]) == len(row["kl_windows"]) == 4
        assert row["kl_minus_weight_only"] == pytest.approx(row["kl"] - twin["kl"])
        print(f"{p}: calibrated KL {row['kl']:.6g}, weight-only KL {twin['kl']:.6g}")
    assert doc["weight_only"]["a (weight-only)"]["kl"] > doc["products"]["a"]["kl"]  # measured on the K3 base
    tsv = (out / "eval" / "eval.tsv").read_text().splitlines()
    assert sum(line.split("\t")[1] == "weight-only" for line in tsv[1:]) == 3
    rows = {r["product"]: r for r in canonical.load(out / "report" / "products.json")}
    for p, row in doc["products"].items():
        twin = doc["weight_only"][row["weight_only"]]
        assert rows[p]["weight_only_kl"] == twin["kl"] and rows[p]["weight_only_top1"] == twin["top1"]
    assert {"weight_only_kl", "weight_only_top1"} <= set((out / "report" / "products.tsv").read_text().split("\n")[0].split("\t"))
    assert (out / "report" / "kl.png").stat().st_size > 0
    stmt = read_publication(out / "published", keys.load_public(out / "signer.pub"))
    assert canonical.load(out / "campaign_summary.json") == summary_view(stmt.predicate)


def test_eval_compares_only_the_products_whose_chains_have_twins(cal, tmp_path):
    """compare_weight_only naming nodes (here as if it named "e": the twins of its chain only) leaves a product
    whose chain has a node without twins (a.r1's) without a weight-only row instead of failing; "a" publishes e's
    experts, so it has e's."""
    from fq.provenance.attest import keys
    from fq.runtime.evaluate import evaluate

    out, c = cal / "campaign", campaign(cal)
    twins = tmp_path / "weight-only"
    shutil.copytree(out / "weight-only" / "e", twins / "e")
    doc = evaluate(out / "published", keys.load_public(out / "signer.pub"), source=c.source_dir,
                   text=c.evals.text, out_json=tmp_path / "eval.json", weight_only_dir=twins, tokens=256, seq_len=128,
                   twin_aliases=c.compare.twin_aliases)
    assert set(doc["weight_only"]) == {"a (weight-only)", "e (weight-only)"}
    assert doc["products"]["a.r1"]["weight_only"] is None
    assert doc["products"]["a"]["weight_only"] == "a (weight-only)"

# -- whole-model bases (the campaign's base "a" names skeleton FULL) ----------------------------------------------------
# a second base naming attention at K4 too (planned only: the dry run shows the shared node)
TWO_BASES = dict(RECIPE2, nodes=[*RECIPE2["nodes"], {"name": "v", "kind": "base", "K": 2, "codebook": "mul1",
                                                      "skeleton": {"attention": 4}}],
                 products=[*RECIPE2["products"], {"name": "v", "chain": ["v"]}])


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as f:
        return list(f.keys())


def test_one_linear_job_per_class_and_layer_shared_by_the_bases(cal, tmp_path):
    d = cal
    (tmp_path / "two").mkdir()
    counts = JOBS  # the module's campaign, as its run listed its jobs
    # attention K4 and the stage's K2 residual on it (3 layers each), shared K4 (2 MoE layers), dense K4 (layer 0),
    # head K6
    assert counts["encode_linears"] == 3 + 3 + 2 + 1 + 1 and counts["calib_head"] == 1
    c = campaign(d)
    assert [n["name"] for n in c.plan.linears] == ["attention-K4-mul1", RESIDUAL, "shared-K4-mul1", "dense-K4-mul1",
                                                   "head-K6-mul1"]
    # a K2 base naming attention K4 as well adds its experts' jobs and no linear job
    cfg = json.loads((d / "config.yaml").read_text())  # the module campaign's, but the recipe
    write_config(tmp_path / "two", TWO_BASES, **{k: v for k, v in cfg.items() if k != "recipe"})
    p = smk(tmp_path / "two", "-n")
    two = job_counts(p.stdout + p.stderr)
    assert two["encode_linears"] == counts["encode_linears"] and two["encode"] > counts["encode"]
    c2 = campaign(tmp_path / "two")
    nodes = {n["name"]: n for n in c2.plan.to_json()["nodes"]}
    assert nodes["v"]["skeleton"] == {"attention": "attention-K4-mul1"}
    assert nodes["a"]["skeleton"]["attention"] == "attention-K4-mul1"
    assert set(c2.linears.base_fragments("v")) < set(c2.linears.base_fragments("a"))


def test_linear_fragments_are_ldlq_against_their_bound_hessians(cal):
    d = cal
    c = campaign(d)
    for node, layer in c.linears.jobs:
        path = Path(c.linears.fragment(node, layer))
        pred = statement(path)["predicate"]
        bound = canonical.load(c.calib.linear_hessian_binding(layer))
        assert pred["kind"] == "linear" and pred["quant_args"]["objective"].startswith("LDLQ")
        assert pred["quant_args"]["hessian"]["sha256"] == bound["sha256"] == hashlib.sha256(
            Path(c.calib.linear_hessian(layer)).read_bytes()).hexdigest()
        metrics = canonical.load(c.linears.metrics(node, layer))
        bound = 1 if "parent" in c.plan.linear(node) else 0.05  # a residual's error is relative to the residual
        assert all(0 < m["proxy_err"] < bound for m in metrics["linears"].values()), metrics


def test_published_base_holds_the_quantized_linears_and_verifies(cal):
    d = cal
    out = d / "campaign"
    pub = out / "published"
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    index = json.loads((pub / "base" / "a" / "model.safetensors.index.json").read_text())["weight_map"]
    # no bf16 weight of a quantized linear is left; embeddings, norms and the router stay as published
    assert not [k for k in index if k.endswith("_proj.weight") and ".experts." not in k]
    assert "lm_head.weight" not in index and "lm_head.trellis" in index
    assert "model.embed_tokens.weight" in index and "model.norm.weight" in index
    assert "model.layers.1.mlp.gate.weight" in index and "model.layers.0.self_attn.q_proj.trellis" in index
    for name, shard in index.items():
        assert name in _keys(pub / "base" / "a" / shard)
    # the product's payload bytes (publication, summary) count its linear fragments beside its expert fragments
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication

    stmt = read_publication(pub, keys.load_public(out / "signer.pub"))
    plan = canonical.loads(base64.b64decode(canonical.loads((pub / "assemblies" / "a.assembly.intoto.jsonl")
                                                            .read_bytes())["payload"]))["predicate"]
    sizes = [(pub / f["name"]).stat().st_size for f in [*plan["fragments"], *plan["linears"]]]
    assert [f["size"] for f in plan["linears"]] == [(pub / f["name"]).stat().st_size for f in plan["linears"]]
    assert stmt.predicate["products"]["a"]["bytes"] == sum(sizes)
    assert canonical.load(out / "campaign_summary.json")["products"]["a"]["bytes"] == sum(sizes)


def test_derived_config_states_bits_over_the_whole_model(cal):
    d = cal
    base = d / "campaign" / "published" / "base" / "a"
    q = json.loads((base / "config.json").read_text())["quantization_config"]
    assert q["expert_bits"] == 3 and q["head_bits"] == 6 and q["linear_bits"] == FULL
    assert q["calibration"] == {"rows": CALIBRATION["rows"], "cols": CALIBRATION["columns"]}
    # bits, recomputed from the published tensors: the stored bytes of every linear but the embeddings, the head and
    # the routers over the weights they hold (exllamav3's convention: head_bits apart)
    index = json.loads((base / "model.safetensors.index.json").read_text())["weight_map"]
    mods: dict = {}
    for name, shard in index.items():
        mod, _, leaf = name.rpartition(".")
        with safe_open(str(base / shard), "pt") as f:
            t = f.get_tensor(name)
        mods.setdefault(mod, {})[leaf] = t
    n_bytes = n_weights = 0
    for mod, ts in mods.items():
        if mod == "lm_head" or mod.endswith(("embed_tokens", ".gate")):
            continue
        if "trellis" in ts:
            n_weights += ts["trellis"].shape[0] * 16 * ts["trellis"].shape[1] * 16
        elif "weight" in ts and ts["weight"].dim() == 2:
            n_weights += ts["weight"].numel()
        else:
            continue
        n_bytes += sum(t.numel() * t.element_size() for k, t in ts.items() if k != "bias")
    assert q["bits"] == round(8 * n_bytes / n_weights, 4) and 3 < q["bits"] < 4.5


def test_a_tampered_linear_fragment_is_refused_by_verify(cal, tmp_path):
    d = cal
    out = d / "campaign"
    pub = shutil.copytree(out / "published", tmp_path / "published")
    frag = pub / "base" / "a" / "shared-K4-mul1-layer002.safetensors"
    raw = bytearray(frag.read_bytes())
    raw[-3] ^= 0x40
    frag.write_bytes(bytes(raw))
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode != 0 and "shared-K4-mul1-layer002.safetensors" in p.stderr, p.stderr


def test_cpu_runtime_loads_whole_model_products(cal):
    """fq's runtime reconstructs every quantized linear from its fragment; the product's logits stay close to the
    source's and the stage still improves on its whole-model base."""
    from fq.provenance.attest import keys
    from fq.runtime.load import load_checkpoint, load_product

    d = cal
    out = d / "campaign"
    pub = keys.load_public(out / "signer.pub")
    src = load_checkpoint(campaign(d).source_dir)
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = torch.log_softmax(src(input_ids=ids).logits.float(), -1)
    kl = {}
    for p in ("a", "a.r1"):
        m = load_product(out / "published" / "assemblies" / f"{p}.assembly.intoto.jsonl", pub,
                         root=out / "published")
        tensors = m.state.tensors
        q = tensors["model.layers.0.self_attn.q_proj.weight"]
        w = src.state_dict()["model.layers.0.self_attn.q_proj.weight"].float()
        assert q.shape == w.shape and 0 < float((q - w).norm() / w.norm()) < 0.2
        with torch.no_grad():
            lp = torch.log_softmax(m.model(input_ids=ids).logits.float(), -1)
        kl[p] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    assert all(0 < v < 0.05 for v in kl.values()), kl
    assert kl["a.r1"] < kl["a"], kl


def test_tp_export_cuts_the_whole_model_bases_linears_by_whole_tiles(cal, tmp_path):
    """A whole-model base's linears in a TP export: at tp=2 (fq.tp.linears, as tp-export cuts them) each linear is
    cut by whole 128-blocks where its layer's attention (4 heads of 64 here), its MLP (the dense layer's 512) or the
    vocabulary (512) divides, and kept whole where not (the shared experts' 128); the pieces reconstruct exactly the
    whole linear's rows or columns. fq tp-export of the product (tp=1, ep=2: the demo's 128-wide experts cut no
    further) lists its linear shards in the signed index, and the loader checks them, refusing an altered byte."""
    from fq.codec import reconstruct
    from fq.provenance.attest import keys
    from fq.tp import records
    from fq.tp.export import attest_shard, shard_common, tp_export
    from fq.tp.linears import read_linear_shard, write_linears
    from fq.tp.slicing import assemble
    from fq.tp.sources import ExportSource, ProductSource

    out = cal / "campaign"
    pub, priv = keys.load_public(out / "signer.pub"), keys.load_private(out / "keys" / "signer.key")
    plan = out / "published" / "assemblies" / "a.assembly.intoto.jsonl"
    src = ProductSource(plan, pub)
    cut = tmp_path / "tp2"
    files = write_linears(src, cut, {"tp": 2, "ep": 1}, shard_common(src), priv, attest_shard)
    ranks = [{}, {}]
    for f in files:
        _, p = records.open_record((cut / (f["name"] + ".intoto.jsonl")).read_bytes(), pub, f["name"], records.SHARD)
        ranks[f["coords"]["tp"]].update(read_linear_shard(cut, f["name"], p))
    whole: dict = {}
    for frag in sorted((out / "published" / "base" / "a").glob("*-K*-mul1-*.safetensors")):
        with safe_open(str(frag), "pt") as fh:
            for k in fh.keys():
                prefix, _, suffix = k.rpartition(".")
                whole.setdefault(prefix, {})[suffix] = fh.get_tensor(k)
    assert set(ranks[0]) == set(ranks[1]) == set(whole) and len(files) == 2 * len(src.predicate["linears"])
    want = {"model.layers.0.self_attn.q_proj": 0, "model.layers.2.self_attn.o_proj": 1, "model.layers.0.mlp.up_proj": 0,
            "model.layers.0.mlp.down_proj": 1, "model.layers.1.mlp.shared_experts.gate_proj": None, "lm_head": 0}
    for prefix, dim in want.items():
        assert [r[prefix][1].dim if r[prefix][1] else None for r in ranks] == [dim, dim], prefix
    for prefix, sets in whole.items():
        full = reconstruct(sets)
        pieces = [(r[prefix][1], reconstruct(r[prefix][0])) for r in ranks]
        if pieces[0][0] is None:
            assert all(torch.equal(p, full) for _, p in pieces), prefix
        else:
            assert torch.equal(assemble(pieces), full), prefix

    res = tp_export(plan, pub, tmp_path / "ep2", tp=1, ep=2, sign_key=priv)
    ex = ExportSource(res.path, pub, product=ProductSource(plan, pub))
    assert {k: v[1] for k, v in ex.linear_sets(0).items()} == {k: None for k in whole}
    f = next((res.path / "linears-tp0").glob("*.safetensors"))
    raw = bytearray(f.read_bytes())
    raw[-5] ^= 0x10
    f.write_bytes(bytes(raw))
    with pytest.raises(FqError, match="do not match the attested sha256"):
        ExportSource(res.path, pub).linear_sets(0)


# -- a stage that also corrects attention (the stage's skeleton STAGE_SKELETON) ------------------------------------


def test_the_stages_attention_residual_is_ldlq_against_the_committed_base_linears_and_published_with_it(cal):
    """Each of the stage's residual fragments (one per layer) is attested as a stage of linear node RESIDUAL against
    the committed base linear fragment of its layer ({name, sha256}), LDLQ against the same bound linear Hessian;
    it is published in the stage's directory, listed (with its parent edge) in the stage product's plan only, counted
    in the product's payload and stored bytes and in its bits over the whole model."""
    from fq.planning.model_bits import class_bits, linear_weights

    c = campaign(cal)
    out = cal / "campaign"
    pub = out / "published"
    jobs = [(n, l) for n, l in c.linears.jobs if n == RESIDUAL]
    assert [l for _, l in jobs] == [0, 1, 2] and c.plan.linear(RESIDUAL)["parent"] == "attention-K4-mul1"
    plans = {p: canonical.loads(base64.b64decode(canonical.loads((pub / "assemblies" / f"{p}.assembly.intoto.jsonl")
                                                                 .read_bytes())["payload"]))["predicate"]
             for p in ("a", "a.r1")}
    listed = {f["name"]: f for f in plans["a.r1"]["stage_linears"]}
    assert "stage_linears" not in plans["a"] and len(listed) == 3
    for node, layer in jobs:
        path, parent = Path(c.linears.fragment(node, layer)), Path(c.linears.fragment("attention-K4-mul1", layer))
        pred, base = statement(path)["predicate"], statement(parent)["predicate"]
        assert pred["role"] == "stage" and pred["K"] == 2 and pred["parent"] == {"name": parent.name,
                                                                                 "sha256": sha256(parent)}
        assert pred["node_digest"] == c.plan.linear(node)["digest"] != base["node_digest"]
        assert pred["quant_args"]["objective"].startswith("LDLQ")
        assert pred["quant_args"]["hessian"] == base["quant_args"]["hessian"]
        assert [t["name"] for t in pred["linears"]] == [t["name"] for t in base["linears"]]
        metrics = canonical.load(c.linears.metrics(node, layer))
        assert metrics["parent"] == pred["parent"] and all(0 < m["proxy_err"] < 1 for m in metrics["linears"].values())
        published = pub / "stages" / "a.r1" / path.name
        assert published.read_bytes() == path.read_bytes() and not (pub / "base" / "a" / path.name).exists()
        f = listed[f"stages/a.r1/{path.name}"]
        assert f["parent"] == pred["parent"] and f["stage"] == "a.r1" and f["size"] == path.stat().st_size
    from fq.provenance.assembly import payload_bytes

    summary = canonical.load(out / "campaign_summary.json")["products"]
    assert summary["a.r1"]["bytes"] == payload_bytes(plans["a.r1"]) == sum(
        f["size"] for f in [*plans["a.r1"]["fragments"], *plans["a.r1"]["linears"], *listed.values()])
    rows = {r["product"]: r for r in canonical.load(out / "report" / "products.json")}
    stage_files = sorted((pub / "stages" / "a.r1").glob("*.safetensors"))
    assert sum(RESIDUAL in f.name for f in stage_files) == 3
    assert rows["a.r1"]["stored_bytes"] == rows["a"]["stored_bytes"] + sum(f.stat().st_size for f in stage_files)
    bits = class_bits(c.recipe, c.recipe.products[1])
    assert bits == {"attention": 6, "shared": 4, "dense": 4, "head": 6}
    planned = {p["name"]: p for p in c.plan.products}
    assert planned["a.r1"]["model_bpw"] == rows["a.r1"]["model_bpw"]
    # the stage adds its K3 over the routed experts (nominal) and its K2 residual over attention, in bits over every
    # linear but the head (on the demo itself more than 2 bits; on its 4-expert cut 1.8, against 1.1 without the
    # residual)
    w = linear_weights(c.source)
    added = (3 * w["experts"] + 2 * w["attention"]) / sum(w[k] for k in ("experts", "attention", "shared", "dense",
                                                                          "other"))
    assert planned["a.r1"]["model_bpw"] - planned["a"]["model_bpw"] == pytest.approx(added, abs=2e-4)


def test_eval_pairs_from_the_signed_plans_as_the_report_from_the_recipe(cal):
    """fq eval pairs a chain with a base from the signed plans, the report and the native jobs from the recipe: one
    rule (fq.planning.native) over the same facts, equal product by product (a: its linear nodes, e: none, a.r1:
    a's and the attention residual, its last node on the hot experts only: no base is its like)."""
    from fq.planning.native import native_bases, plan_likes, recipe_likes
    from fq.planning.plan import CampaignPlan
    from fq.planning.recipe import load_recipe

    out = cal / "campaign"
    plan = CampaignPlan.from_json(canonical.load(out / "plan.json"))
    plans = {p: statement(out / "published" / "assemblies" / f"{p}.assembly")["predicate"] for p in ("a", "a.r1", "e")}
    likes = plan_likes(plans)
    assert likes == recipe_likes(load_recipe(cal / "recipe.json"), plan.selections)
    assert likes["a.r1"][1].linears == likes["a"][1].linears | {plan.linear(RESIDUAL)["digest"]}
    assert likes["e"][1].linears == frozenset() and native_bases(likes) == {}


def test_the_cpu_runtime_sums_the_base_linear_and_the_stages_residual(cal, tmp_path):
    """product a.r1's attention linears are the sum of the base's reconstruction and the stage's residual (exactly
    reconstruct_chain of the two published tensor sets), closer to the source than the base's alone, and fq eval's
    one-pass point for it keeps them (it differs from the product in the last node's experts alone); consumers that
    carry routed-expert stages only (fq combine, tp-export, the exllamav3 runtime) refuse the product by name."""
    from fq.codec import reconstruct_chain
    from fq.provenance.attest import keys
    from fq.provenance.combine import combine
    from fq.runtime.load import product_state

    out = cal / "campaign"
    pub, key = out / "published", keys.load_public(out / "signer.pub")
    plan = lambda p: pub / "assemblies" / f"{p}.assembly.intoto.jsonl"  # noqa: E731
    states = {p: product_state(plan(p), key, root=pub) for p in ("a", "a.r1")}
    src = dict(safe_open_all(campaign(cal).source_dir))
    for layer in (0, 2):
        sets = []
        for f in (pub / "base" / "a" / f"attention-K4-mul1-layer{layer:03d}.safetensors",
                  pub / "stages" / "a.r1" / f"{RESIDUAL}-layer{layer:03d}.safetensors"):
            with safe_open(str(f), "pt") as fh:
                sets.append({k: fh.get_tensor(k) for k in fh.keys()})
        for lin in ("q_proj", "o_proj"):
            name = f"model.layers.{layer}.self_attn.{lin}"
            chain = [{k.rpartition(".")[2]: v for k, v in s.items() if k.rpartition(".")[0] == name} for s in sets]
            w = src[f"{name}.weight"].float()
            summed, base = states["a.r1"].tensors[f"{name}.weight"], states["a"].tensors[f"{name}.weight"]
            assert torch.equal(summed, reconstruct_chain(chain, name, tuple(w.shape)))
            assert torch.equal(base, reconstruct_chain(chain[:1], name, tuple(w.shape)))
            assert (summed - w).norm() < 0.7 * (base - w).norm()
    from fq.runtime.evaluate import native_tensors, weight_only_sets

    state = states["a.r1"]
    stand_in = weight_only_sets(out / "weight-only")["a.r1"]  # any tensor sets of the stage's experts will do
    tensors, experts = native_tensors(state, stand_in, "weight-only twins standing in for a one-pass encode")
    assert len(experts) == 2 * 2 and set(tensors) == set(state.tensors)
    changed = {k for k in tensors if not torch.equal(tensors[k], state.tensors[k])}
    assert changed == {state.expert_key(l, e, p) for l, e in experts for p in state.layout.projections}
    with pytest.raises(FqError, match="a.r1 also correct non-expert linears.*fq combine's adapter"):
        combine(plan("a.r1"), key, tmp_path / "adapter.safetensors")
    from fq.tp.sources import ProductSource

    with pytest.raises(FqError, match="TP export"):
        ProductSource(plan("a.r1"), key)
    from fq.runtime.exl3 import load_exl3_product

    with pytest.raises(FqError, match="exllamav3"):  # refused after verification, before exllamav3 is imported
        load_exl3_product(plan("a.r1"), key, root=pub)


def safe_open_all(directory: Path):
    for f in sorted(directory.glob("*.safetensors")):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                yield k, fh.get_tensor(k)


def test_a_tampered_or_re_signed_stage_residual_is_refused(cal, tmp_path):
    """A flipped byte in a published residual fragment: fq verify names it and the runtime refuses to load the
    product. An insider re-signing the residual's attestation with another parent: verify refuses it (the plan names
    another attestation, and the tree's chain edge is broken)."""
    from fq.provenance.attest import dsse, keys
    from fq.runtime.load import product_state

    out = cal / "campaign"
    key = keys.load_public(out / "signer.pub")
    pub = shutil.copytree(out / "published", tmp_path / "published")
    frag = pub / "stages" / "a.r1" / f"{RESIDUAL}-layer001.safetensors"
    raw = bytearray(frag.read_bytes())
    raw[-3] ^= 0x40
    frag.write_bytes(bytes(raw))
    verify = lambda: subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key",  # noqa: E731
                                     str(out / "signer.pub")], capture_output=True, text=True)
    p = verify()
    assert p.returncode != 0 and frag.name in p.stdout + p.stderr, p.stderr
    with pytest.raises(FqError, match=frag.name.replace("+", r"\+")):
        product_state(pub / "assemblies" / "a.r1.assembly.intoto.jsonl", key, root=pub)
    shutil.copyfile(out / "published" / "stages" / "a.r1" / frag.name, frag)
    st = statement(frag)
    st["predicate"]["parent"]["sha256"] = "0" * 64
    priv = keys.load_private(out / "keys" / "signer.key")
    frag.with_name(frag.name + ".intoto.jsonl").write_bytes(dsse.envelope_line(dsse.sign(canonical.dumps(st), priv)))
    p = verify()
    assert p.returncode != 0 and "chain edge broken" in p.stdout + p.stderr, p.stdout + p.stderr


# -- one expert encoding for the experts-only base "e" and the whole-model base "a" (recipe Node.experts_from) ------


def test_bases_of_one_K_share_one_expert_encoding_and_each_publishes_it(cal):
    """"e" (experts only) and "a" (whole-model) are both K3 mul1: their experts are encoded once, by "e"'s jobs (the
    campaign's job table: no encode job of "a", one share job per block of "a"); "a"'s fragments hold "e"'s expert
    bytes byte for byte, attest where they come from, and are published in "a"'s directory beside its linear
    fragments and skeleton variant; the stage on "a" chains on them; fq verify checks all of it; the plan and the
    price count the encode once."""
    from fq.planning.price import load_cost_table, price_recipe
    from fq.provenance.attest import keys
    from fq.provenance.attest.fragment import verify_shard

    out = cal / "campaign"
    pub = out / "published"
    c = campaign(cal)
    n_blocks = len(c.plan.blocks)  # one per MoE layer (block_size 8)
    assert JOBS["share"] == n_blocks and JOBS["encode"] == n_blocks + len(
        [f for f in c.fragments if f.node == "a.r1"])
    assert {f.node for f in c.shared_fragments} == {"a"} and not any(f.node == "a" for f in c.encoded_fragments)
    assert not list((out / "logs" / "encode").glob("a-layer*")) and len(list((out / "logs" / "share").glob("*.log"))) \
        == n_blocks
    key = keys.load_public(out / "signer.pub")
    for f in c.shared_fragments:
        mine = pub / "base" / "a" / Path(c.fragment("a", f.block)).name
        theirs = pub / "base" / "e" / Path(c.fragment("e", f.block)).name
        a, e = verify_shard(mine.parent, mine.name, key), verify_shard(theirs.parent, theirs.name, key)
        assert a.predicate["experts_from"] == {"node": "e", "name": theirs.name, "sha256": e.sha256}
        assert a.predicate["quant_args"] == e.predicate["quant_args"] and a.predicate["source"] == e.predicate["source"]
        assert a.predicate["node_digest"] == c.recipe.node_digest("a") != e.predicate["node_digest"]
        # every expert's bytes in the two base directories are identical (only the header's node differs)
        ra, re_ = mine.read_bytes(), theirs.read_bytes()
        assert [x["sha256"] for x in a.predicate["experts"]] == [x["sha256"] for x in e.predicate["experts"]]
        for x, y in zip(a.predicate["experts"], e.predicate["experts"]):
            assert ra[x["offset"]:x["offset"] + x["length"]] == re_[y["offset"]:y["offset"] + y["length"]]
        assert (pub / "base" / "a" / mine.name).read_bytes() == Path(c.fragment("a", f.block)).read_bytes()
    # the stage on "a" names "a"'s (shared) fragments as its parents
    for f in (f for f in c.fragments if f.node == "a.r1"):
        att = statement(Path(c.fragment("a.r1", f.block)))["predicate"]
        assert att["parent"]["name"] == Path(c.fragment("a", f.block)).name
    # "a"'s directory: its skeleton variant, its linear fragments, the shared expert fragments; "e"'s the whole skeleton
    names = {p.name for p in (pub / "base" / "a").glob("*.safetensors")}
    assert {Path(c.fragment("a", b)).name for b in c.plan.blocks} <= names
    assert {Path(p).name for p in c.linears.base_fragments("a")} <= names
    assert not any("K4" in p.name for p in (pub / "base" / "e").glob("*.safetensors"))
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(pub), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0 and "3 plans" in p.stdout, p.stdout + p.stderr
    # planned and priced once: passes count e and the stage; "a" costs no GPU time and publishes its bytes
    assert (c.plan.recipe["passes"], c.plan.recipe["encoded_bpw"]) == (2, 6)
    price = {n.name: n for n in price_recipe(c.recipe, c.source, load_cost_table()).nodes}
    assert (price["a"].gpu_seconds, price["a"].experts, price["a"].experts_from) == (0.0, 0, "e")
    assert price["e"].experts == c.source.n_experts * n_blocks and price["a"].output_bytes == price["e"].output_bytes


# -- every consumer checks the base as one model (fq.provenance.complete): an insider's re-signed trees -------------
# Each attack edits a copy of the published tree and re-signs everything that names the edited files with the
# campaign's own key (insiderkit: base manifests with their derived files recomputed, plans, the publication
# statement). Every file then verifies on its own; what refuses it is the check of the base as one model, which
# fq verify, the runtimes' verification (fq's CPU runtime, its exllamav3 runtime, fq eval and fq generate all open
# a product through fq.runtime.load.verify_product) and the TP source (tp-export, the TP store) all run.


def _drop(pub, priv):
    for f in (pub / "base" / "a").glob("attention-K4-mul1-layer001.safetensors*"):
        f.unlink()


def _without(tensor):
    def attack(pub, priv):
        from tests.kits import insiderkit

        base = pub / "base" / "a"
        shard = base / json.loads((base / "model.safetensors.index.json").read_text())["weight_map"][tensor]
        insiderkit.rewrite_skeleton(shard, priv, lambda t: {k: v for k, v in t.items() if k != tensor})
    return attack


def _index_names_a_missing_file(pub, priv):
    index = pub / "base" / "a" / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["model.layers.0.input_layernorm.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(doc))


def _bf16_beside(pub, priv):
    from tests.kits import insiderkit

    base = pub / "base" / "a"
    shard = base / json.loads((base / "model.safetensors.index.json").read_text())["weight_map"][
        "model.layers.0.input_layernorm.weight"]
    insiderkit.rewrite_skeleton(shard, priv, lambda t: {
        **t, "model.layers.0.self_attn.q_proj.weight": torch.zeros(256, 256, dtype=torch.bfloat16)})


def _reattest(name, edit, plan_edit=None):
    def attack(pub, priv):
        from tests.kits import insiderkit

        insiderkit.reattest(pub / "base" / "a" / name, priv, edit)
        return plan_edit
    return attack


def _swap_linears(paths, node, priv):
    """Two linear fragments of ``node`` (layers 1 and 2) written again by fq's writer, each with its own labels
    around the other's tensor sets, their attestations re-signed over the bytes."""
    from tests.kits import insiderkit
    from fq.provenance.fragments import write_linears

    sets = []
    for p in paths:
        with safe_open(str(p), "pt") as f:
            tset: dict = {}
            for k in f.keys():
                lin, _, suffix = k.rpartition(".")
                tset.setdefault(lin, {})[suffix] = f.get_tensor(k)
            sets.append(tset)
    K = statement(paths[0])["predicate"]["K"]
    for (layer, path), tset in zip(((1, paths[0]), (2, paths[1])), reversed(sets)):
        path.unlink()
        write_linears(path, node=node, cls="attention", layer=layer, K=K, codebook="mul1", linears=tset)
        insiderkit.reattest(path, priv)


def _extra_linear(pub, priv):
    """Layer 1's attention fragment written again by fq's writer with one more linear in it (a copy of its q_proj
    under the name of a projection the model does not have), its attestation re-signed over the bytes."""
    from tests.kits import insiderkit
    from fq.provenance.fragments import write_linears

    path = pub / "base" / "a" / "attention-K4-mul1-layer001.safetensors"
    with safe_open(str(path), "pt") as f:
        tset: dict = {}
        for k in f.keys():
            lin, _, suffix = k.rpartition(".")
            tset.setdefault(lin, {})[suffix] = f.get_tensor(k)
    tset["model.layers.1.self_attn.x_proj"] = dict(tset["model.layers.1.self_attn.q_proj"])
    path.unlink()
    write_linears(path, node="attention-K4-mul1", cls="attention", layer=1, K=4, codebook="mul1", linears=tset)
    insiderkit.reattest(path, priv)


def _stage_residual_of_another_layer(pub, priv):
    _swap_linears([pub / "stages" / "a.r1" / f"{RESIDUAL}-layer00{i}.safetensors" for i in (1, 2)], RESIDUAL, priv)


def _other_layers_linears(pub, priv):
    """Layers 1 and 2's attention swapped, each fragment keeping its own labels (node, class, layer): every tensor
    is stored once and every file is signed; layer 1's linears sit under layer 2's labels and the other way."""
    _swap_linears([pub / "base" / "a" / f"attention-K4-mul1-layer00{i}.safetensors" for i in (1, 2)],
                  "attention-K4-mul1", priv)


def _hessian_of_layer_2(p):
    """Layer 1's linear Hessian file named with layer 2's digest: the file name its layer's, the bytes another's."""
    p["quant_args"]["hessian"]["sha256"] = statement(Path(_ATT2))["predicate"]["quant_args"]["hessian"]["sha256"]


def _weight_only(p):
    from fq.hessian import store

    del p["quant_args"]["hessian"]
    p["quant_args"]["objective"] = store.OBJECTIVE_WEIGHT


_ATT2 = ""  # set per tree: layer 2's attention fragment (whose Hessian binding the layer-1 fragment claims)
OTHER_DIGEST = "ab" * 32


def _two_digests_plan(plan, digest=OTHER_DIGEST):
    for f in plan.get("linears", ()):
        if f["name"].endswith("attention-K4-mul1-layer001.safetensors"):
            f["digest"] = digest


def _DENSE_DIGEST() -> str:  # the dense MLP's linear node digest, as layer 0's fragment attests it
    return statement(Path(_ATT2).with_name("dense-K4-mul1-layer000.safetensors"))["predicate"]["node_digest"]


def _owner_withheld(pub, priv):
    shutil.rmtree(pub / "base" / "e")
    (pub / "assemblies" / "e.assembly.intoto.jsonl").unlink()
    from tests.kits import insiderkit

    st = insiderkit.statement_of(pub / "publication.intoto.jsonl")
    del st["predicate"]["bases"]["e"], st["predicate"]["products"]["e"]
    (pub / "publication.intoto.jsonl").write_bytes(insiderkit.sign(st, priv))


def _owner(**change):
    def edit(p):
        p["experts_from"] = {**p["experts_from"], **change}
    return edit


def _no_owner(p):
    del p["experts_from"]


ATTACKS = {  # name -> (attack, what every consumer's refusal says)
    "a linear fragment dropped": (_drop, r"layer 1 holds other tensors .*lacks self_attn\.k_proj\.weight"),
    "a layernorm dropped from the skeleton variant": (
        _without("model.layers.2.post_attention_layernorm.weight"), r"layer 2 .*lacks post_attention_layernorm"),
    "the router dropped from the skeleton variant": (
        _without("model.layers.1.mlp.gate.weight"), r"layer 1 .*lacks mlp\.gate\.weight"),
    "the index names a file that does not exist": (
        _index_names_a_missing_file, r"names 'model-00009-of-00009\.safetensors'.*which the base does not hold"),
    "a bf16 weight beside its quantized form": (
        _bf16_beside, r"q_proj\.weight is both a skeleton tensor and part of the EXL3 linear"),
    "a fragment holding another layer's linears under its own labels": (
        _other_layers_linears, r"holds model\.layers\.2\.self_attn\.\w+, which is attention layer 2, under the labels "
                               r"attention layer 1"),
    "a stage residual holding another layer's linears under its own labels": (
        _stage_residual_of_another_layer, r"holds model\.layers\.2\.self_attn\.\w+, which is attention layer 2, under the "
                                          r"labels attention layer 1"),
    "an extra linear in a linear fragment": (
        _extra_linear, r"holds model\.layers\.1\.self_attn\.x_proj, which is no linear fq quantizes"),
    "one linear node with two digests": (
        _reattest("attention-K4-mul1-layer001.safetensors", lambda p: p.update(node_digest=OTHER_DIGEST),
                  _two_digests_plan), r"linear node attention-K4-mul1's fragments attest 2 node digests"),
    "a linear fragment attesting another linear node's digest": (
        _reattest("attention-K4-mul1-layer001.safetensors", lambda p: p.update(node_digest=_DENSE_DIGEST()),
                  lambda plan: _two_digests_plan(plan, _DENSE_DIGEST())), r"attest 2 node digests"),
    "another layer's Hessian named": (
        _reattest("attention-K4-mul1-layer001.safetensors", _hessian_of_layer_2),
        r"linear fragments of layer 1 were encoded against 2 objectives"),
    "a weight-only claim inside a calibrated layer": (
        _reattest("attention-K4-mul1-layer001.safetensors", _weight_only),
        r"linear fragments of layer 1 were encoded against 2 objectives .*weight-only"),
    "the owner of the shared encoding withheld": (_owner_withheld, r"which the tree does not hold"),
    "experts_from naming a node that does not exist": (
        _reattest("a-layer001-block000.safetensors", _owner(node="k9", name="k9-layer001-block000.safetensors")),
        r"disagree on whose expert encoding they hold \(a-layer001-block000\.safetensors: k9"),
    "experts_from dropped from one fragment": (
        _reattest("a-layer001-block000.safetensors", _no_owner), r"disagree on whose expert encoding they hold"),
    "experts_from naming other bytes": (
        _reattest("a-layer001-block000.safetensors", _owner(sha256="0" * 64)), r"shared encoding broken"),
}


def consumers(pub: Path, key, product: str = "a") -> dict[str, str]:
    """What each consumer says of the product: fq verify's problems (of the tree, of the plan alone), the runtimes'
    verification, the TP source."""
    from fq.provenance.verify import verify_path
    from fq.runtime.load import verify_product
    from fq.tp.sources import ProductSource

    plan = pub / "assemblies" / f"{product}.assembly.intoto.jsonl"
    out = {"verify": "\n".join(verify_path(pub, key).problems),
           "verify the plan": "\n".join(verify_path(plan, key).problems)}
    for name, open_ in (("runtime", verify_product), ("tp", ProductSource)):
        try:
            open_(plan, key, root=pub)
            out[name] = ""
        except FqError as e:
            out[name] = str(e)
    return out


@pytest.mark.parametrize("attack", ATTACKS)
def test_every_consumer_refuses_a_re_signed_incomplete_or_inconsistent_base(cal, tmp_path, attack):
    from tests.kits import insiderkit
    from fq.provenance.attest import keys

    global _ATT2
    out = cal / "campaign"
    key, priv = keys.load_public(out / "signer.pub"), keys.load_private(out / "keys" / "signer.key")
    pub = shutil.copytree(out / "published", tmp_path / "published")
    _ATT2 = str(pub / "base" / "a" / "attention-K4-mul1-layer002.safetensors")
    edit, pattern = ATTACKS[attack]
    plan_edit = edit(pub, priv)
    if attack != "the index names a file that does not exist":
        insiderkit.write_index(pub / "base" / "a")  # as finalize writes it, over the shards as they are now
    insiderkit.resign_tree(pub, priv, plan_edit)
    stage = "stage" in attack  # the product with the stage; the TP source refuses it whole (stage_linears)
    said = consumers(pub, key, "a.r1" if stage else "a")
    for consumer, text in said.items():
        assert re.search(pattern, text) or (stage and consumer == "tp" and "routed-expert stages only" in text), \
            (consumer, said)


def test_the_re_signed_untouched_tree_passes_every_consumer(cal, tmp_path):
    """The insider's re-signing itself (no edit) leaves a tree every consumer accepts: the refusals above are the
    edits'."""
    from tests.kits import insiderkit
    from fq.provenance.attest import keys

    out = cal / "campaign"
    key, priv = keys.load_public(out / "signer.pub"), keys.load_private(out / "keys" / "signer.key")
    pub = shutil.copytree(out / "published", tmp_path / "published")
    insiderkit.resign_tree(pub, priv)
    assert consumers(pub, key) == {"verify": "", "verify the plan": "", "runtime": "", "tp": ""}


def test_an_attestation_the_plan_does_not_name_is_named_with_both_digests(cal, tmp_path):
    """A linear fragment's attestation re-signed (its bytes untouched) and the tree re-signed, the plans' entry for
    it left naming the old attestation: every consumer refuses it (the runtimes did not compare a linear fragment's
    attestation with the plan), saying it is the attestation file that differs, with the two digests, the file's
    and the plan's (not the shard's digest twice)."""
    from tests.kits import insiderkit
    from fq.provenance.attest import keys

    out = cal / "campaign"
    key, priv = keys.load_public(out / "signer.pub"), keys.load_private(out / "keys" / "signer.key")
    pub = shutil.copytree(out / "published", tmp_path / "published")
    frag = pub / "base" / "a" / "attention-K4-mul1-layer001.safetensors"
    old = hashlib.sha256(frag.with_name(frag.name + ".intoto.jsonl").read_bytes()).hexdigest()
    insiderkit.reattest(frag, priv, lambda p: p["quant_args"].update(seed=1))

    def stale(plan):  # the tree re-signed, the plans' entry for this fragment left naming the old attestation
        for f in plan.get("linears", ()):
            if f["name"].endswith(frag.name):
                f["attestation_sha256"] = old
    insiderkit.resign_tree(pub, priv, stale)
    said = consumers(pub, key)
    for consumer, text in said.items():
        m = re.search(r"attestation file is not the one the plan names \(the file's sha256 is (\w+)…, the plan names "
                      r"(\w+)…\)", text)
        assert m and m.group(1) != m.group(2), (consumer, said)


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
        assert canonical.load(c.calib.hessian_binding(f.block.layer))["sha256"] in log
    finally:
        att.write_bytes(kept)  # the module's last test: no repair run (finalize's outputs went with its failure)
