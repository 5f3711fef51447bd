"""The Snakemake campaign workflow, run for real (Snakemake as a subprocess) on the embedded demo model.

One campaign is built once per module (K3 nodes: on the CPU the cheapest Viterbi per tile, about 25% under K1) and then poked: a second run,
a deleted fragment, a recipe change (on a copy of the campaign), finalize twice, a stray shard, fq combine, the staging log.
Its source is the demo model cut to 4 routed experts a layer (tests/kits/demokit.py: the demo's trained weights, text
and recorded usage, half its expert matrices to encode; blocks of 2, so still two blocks a layer). The demo source
itself (``source: {kind: demo}``: the demo_model and usage jobs) is the ``demo`` campaign's: the same recipe, dry-run,
then run up to its plan.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fq.codec import reconstruct_chain
from fq.core import canonical
from fq.workflow.campaign import load_campaign

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

RECIPE = {
    "format": "fq-cartridge/2", "name": "wftest", "description": "workflow tests (K3 nodes encode fastest on the CPU)",
    "nodes": [
        {"name": "a", "kind": "base", "K": 3, "codebook": "mul1"},
        {"name": "a.r1", "kind": "stage", "K": 3, "codebook": "mul1", "parent": "a", "experts": "all"},
        {"name": "a.r1.h2", "kind": "stage", "K": 3, "codebook": "mul1", "parent": "a.r1", "experts": {"hot": 2}},
    ],
    "products": [{"name": "a", "chain": ["a"]}, {"name": "a.r1", "chain": ["a", "a.r1"]},
                 {"name": "a.r1.h2", "chain": ["a", "a.r1", "a.r1.h2"]}],
}
BASE_ONLY = dict(RECIPE, nodes=RECIPE["nodes"][:1], products=RECIPE["products"][:1])


def write_config(d: Path, recipe: dict, **over) -> Path:
    (d / "recipe.json").write_text(json.dumps(recipe))
    cfg = {"campaign": "wftest", "out": "campaign", "source": {"kind": "demo"}, "recipe": str(d / "recipe.json"),
           "block_size": 4, "windows": "1,2", "windows_on_disk": 1,
           "encode": {"device": "cpu", "devices": [], "threads": 1, "seed": 0}, "compare_native": False, "eval": None,
           "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}, **over}
    path = d / "config.yaml"
    path.write_text(json.dumps(cfg))  # YAML is a superset of JSON
    return path


def smk(d: Path, *args, check=True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(REPO / "Snakefile"), "--directory", str(d),
           "--configfile", str(d / "config.yaml"), "--cores", "2", *args]
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if check and p.returncode != 0:
        raise AssertionError(f"snakemake {' '.join(args)} failed:\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}")
    return p


def campaign(d: Path):
    from fq.workflow import campaign as cm
    import yaml

    cfg = yaml.safe_load((d / "config.yaml").read_text())
    cwd = os.getcwd()
    os.chdir(d)
    try:
        c = cm.load_campaign(cfg)
        c.out = d / c.out
        return c
    finally:
        os.chdir(cwd)


def copy_campaign(d: Path, to: Path) -> Path:
    """A finished campaign's working directory copied whole (config, recipe, Snakemake's records, every file's
    mtime), for a test that changes it and runs Snakemake again instead of changing the module's campaign back."""
    shutil.copytree(d, to, symlinks=True)
    return to


def fragment_mtimes(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_mtime_ns for p in sorted((d / "campaign" / "fragments").rglob("*.safetensors"))}


def tree_digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def job_counts(out: str) -> dict[str, int]:
    counts, on = {}, False
    for line in out.splitlines():
        if line.startswith("job ") and "count" in line:
            on = True
            continue
        if on:
            parts = line.split()
            if not parts or parts[0].startswith("---"):
                continue
            if parts[0] == "total":
                break
            counts[parts[0]] = int(parts[1])
    return counts


EVAL = {"text": None, "tokens": 1024, "seq_len": 256}  # the demo's held-out split, a quarter of make demo's tokens
BLOCK = 2  # the module campaign's block size: two blocks a layer of demokit's 4 experts, as 4 are of the demo's 8


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The recipe on the demo source itself: its dry run (every job of the campaign), then Snakemake up to the plan
    (the demo_model, usage and plan jobs; nothing encoded)."""
    d = tmp_path_factory.mktemp("wf-demo")
    write_config(d, RECIPE, eval=EVAL)
    dry = smk(d, "-n")
    smk(d, "campaign/plan.json")
    return d, dry.stdout + dry.stderr


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """The module campaign's source: the demo model with 4 routed experts a layer, its text and usage."""
    from tests.kits import demokit

    return demokit.write(tmp_path_factory.mktemp("demo4"))


def small_config(d: Path, small: Path, recipe: dict, **over) -> Path:
    from tests.kits import demokit

    return write_config(d, recipe, **{"source": demokit.local_source(small), "block_size": BLOCK,
                                      "usage": str(small / "usage.json"), **over})


@pytest.fixture(scope="module")
def run(tmp_path_factory, small):
    d = tmp_path_factory.mktemp("wf")
    small_config(d, small, RECIPE, eval=dict(EVAL, text=str(small / "text" / "heldout.txt")))
    p = smk(d)
    return d, p.stdout + p.stderr


def test_dry_run_lists_every_job_of_the_campaign(demo):
    d, dry = demo
    c = campaign(d)
    counts = job_counts(dry)
    assert counts["encode"] == len(c.fragments) == 4 + 4 + 2  # a, a.r1 over 2 layers x 2 blocks; hot 2 of 8
    assert counts["stage"] == len(c.source.shards) == 4
    assert counts["skeleton"] == len(c.skeleton_shards) == 3
    assert counts["retire"] == 2 and counts["finalize"] == 1 and counts["report"] == 1 and counts["eval"] == 1
    assert counts["init"] == counts["plan"] == counts["demo_model"] == counts["keygen"] == counts["usage"] == 1


def test_full_run_publishes_a_verified_campaign_and_report(run):
    d, _ = run
    out = d / "campaign"
    assert (out / "published.verified").read_text().startswith("ok: ")
    p = subprocess.run([sys.executable, "-m", "fq", "verify", str(out / "published"), "--key", str(out / "signer.pub")],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    for name in ("products.tsv", "quality.png", "layers.png", "products.json"):
        assert (out / "report" / name).stat().st_size > 0
    rows = canonical.load(out / "report" / "products.json")
    by = {r["product"]: r for r in rows}
    assert by["a.r1"]["rel_mse"] < by["a"]["rel_mse"] * 0.5  # a residual stage improves its base
    assert by["a.r1.h2"]["rel_mse"] < by["a.r1"]["rel_mse"]
    assert not any((out / "staging").glob("*.safetensors")), "every staged shard is deleted after its last use"


def test_eval_measures_every_product_at_the_output_and_feeds_the_report(run):
    """The eval job (after finalize): every published product, verified and loaded by fq.runtime, against the trained
    demo model on its held-out split; the report's table gains the columns and kl.png; the summary stays the signed
    statement's view."""
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.provenance.summary import summary_view

    d, _ = run
    out = d / "campaign"
    doc = canonical.load(out / "eval" / "eval.json")
    assert doc["format"] == "fq-eval/1" and doc["text"]["file"] == "heldout.txt"
    assert doc["text"]["positions"] == 4 * 255 and doc["native"] == {}  # compare_native off here
    kl = {p: r["kl"] for p, r in doc["products"].items()}
    assert set(kl) == {"a", "a.r1", "a.r1.h2"}
    assert kl["a"] > kl["a.r1"] > kl["a.r1.h2"] > 0  # each stage brings the output closer to the source
    # (that quantizing costs perplexity, the source's below the base's, is test_workflow_budget.py's, on the demo
    # itself: the demo cut to 4 experts is off its trained optimum, and the K3 base's noise lowers it by a hair)
    rows = {r["product"]: r for r in canonical.load(out / "report" / "products.json")}
    assert all(rows[p]["kl"] == kl[p] and rows[p]["top1"] == doc["products"][p]["top1"] for p in kl)
    header = (out / "report" / "products.tsv").read_text().splitlines()[0].split("\t")
    assert {"kl", "ppl", "top1", "exl3_runtime"} <= set(header)
    assert {r["exl3_runtime"] for r in rows.values()} == {"Glm4MoeForCausalLM"}  # where the demo's bases run
    assert (out / "report" / "kl.png").stat().st_size > 0
    assert (out / "eval" / "eval.tsv").read_text().count("\n") == 1 + 3
    stmt = read_publication(out / "published", keys.load_public(out / "signer.pub"))
    assert canonical.load(out / "campaign_summary.json") == summary_view(stmt.predicate)  # no eval numbers in it


def test_finalize_signs_the_publication_statement_and_the_summary_is_its_view(run):
    """Issue 15: finalize signs what the campaign published (every file, each product's plan, each base's
    manifest) with assembly.version; campaign_summary.json is that statement's view."""
    from fq.provenance.attest import keys
    from fq.provenance.publication import read_publication
    from fq.provenance.summary import summary_view

    d, _ = run
    out = d / "campaign"
    stmt = read_publication(out / "published", keys.load_public(out / "signer.pub"))
    assert stmt.version == 1 and set(stmt.predicate["products"]) == {"a", "a.r1", "a.r1.h2"}
    assert {p: e["bpw"] for p, e in stmt.predicate["products"].items()} == {"a": 3, "a.r1": 6, "a.r1.h2": 9}
    published = {p.relative_to(out / "published").as_posix() for p in (out / "published").rglob("*") if p.is_file()}
    assert set(stmt.files) == published - {"publication.intoto.jsonl"}
    assert canonical.load(out / "campaign_summary.json") == summary_view(stmt.predicate)
    assert ", publication version 1 verified under key " in (out / "published.verified").read_text()


def test_each_published_base_carries_its_model_card(run):
    """Issue 44: finalize writes README.md into the base directory in the Hub's model-card format, declared derived in
    the signed manifest (so every consumer recomputes it); its numbers are the plan's K, the eval job's text and
    window, and the stored bytes quantization_config.json lists. (finalize twice, below, gives the same bytes.)"""
    import yaml

    from tests.kits import demokit
    from fq.provenance.attest import keys
    from fq.provenance.manifest import read_base_manifest

    d, _ = run
    out = d / "campaign"
    base = out / "published" / "base" / "a"
    text = (base / "README.md").read_text()
    head, body = text.removeprefix("---\n").split("\n---\n", 1)
    meta = yaml.safe_load(head)
    assert meta == {"base_model": demokit.REPO, "base_model_relation": "quantized", "library_name": "exllamav3",
                    "pipeline_tag": "text-generation", "quantized_by": "fq", "tags": ["exl3", "quantized", "moe", "fq"]}
    (node,) = [n for n in canonical.load(out / "plan.json")["nodes"] if n["name"] == "a"]
    assert f"| routed experts | K{node['K']} |" in body and f"Codebook `{node['codebook']}`" in body
    assert "`Glm4MoeForCausalLM`" in body
    qc = canonical.load(base / "quantization_config.json")
    stored = sum(t["n_bytes"] for e in qc["tensor_storage"].values() for t in e["stored_tensors"].values())
    assert f"| stored tensor bytes | {stored:,} (" in body and f"| bits per weight | {qc['bits']:g} (" in body
    heldout = hashlib.sha256(Path(campaign(d).evals.text).read_bytes()).hexdigest()
    assert (f"on `heldout.txt` (sha256 `{heldout}`): its first {EVAL['tokens']} tokens in windows of "
            f"{EVAL['seq_len']}, {4 * 255:,} next-token positions") in body  # what eval.json says it measured
    assert "fq verify base/a/fq-manifest.intoto.jsonl --key signer.pub" in body
    manifest = read_base_manifest(base, keys.load_public(out / "signer.pub"))
    card = [e for e in manifest.derived if e["name"] == "README.md"]
    assert [e["rule"] for e in card] == ["fq-model-card/1"] and card[0]["params"]["node"] == "a"
    assert card[0]["params"]["signer"] == manifest.campaign["signer"]


def test_the_standard_model_signing_tool_verifies_each_published_base(run, tmp_path):
    """Issue 44: the demo's bases carry model.sig (OpenSSF model signing, by the campaign's generated P-256 key, whose
    public PEM finalize writes beside signer.pub); the real model_signing 1.1.1 CLI accepts each base and refuses a
    tampered copy."""
    d, _ = run
    out = d / "campaign"
    pem = out / "model-signing.pub"
    assert pem.read_bytes() == (out / "keys" / "model-signing.pub").read_bytes()

    def tool(base: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "model_signing", "verify", "key", str(base), "--signature",
                               str(base / "model.sig"), "--public_key", str(pem)], capture_output=True, text=True)

    bases = sorted((out / "published" / "base").iterdir())
    assert [b.name for b in bases] == ["a"]
    for base in bases:
        p = tool(base)
        assert p.returncode == 0 and "Verification succeeded" in p.stdout, p.stdout + p.stderr
    copy = shutil.copytree(bases[0], tmp_path / "a")
    card = copy / "README.md"
    card.write_text(card.read_text().replace("quantized_by: \"fq\"", "quantized_by: \"someone\""))
    p = tool(copy)
    assert p.returncode == 1 and "Hash mismatch for" in p.stderr and "README.md" in p.stderr, p.stdout + p.stderr


def test_hot_stage_encodes_the_experts_the_usage_job_measured(demo, run):
    """The usage job routed the calibration text through the demo checkpoint; the plan's hot selections are that
    file's hottest experts (the same as the usage recorded with the model, which the DAG was first planned from).
    The module campaign (config usage: the recorded usage of its experts) encoded its plan's hot experts."""
    from fq.model import demo_model
    from fq.model.usage import load_usage

    d, _ = demo
    c = campaign(d)
    measured = d / "campaign" / "usage" / "expert_usage.json"
    assert measured.read_bytes() == demo_model.data()["usage.json"]
    assert (d / c.usage.source).resolve() == measured.resolve()  # planned from the measured file
    u = load_usage(measured)
    plan = canonical.load(d / "campaign" / "plan.json")
    assert plan["identity"]["usage_sha256"] == u.sha256
    for layer in (1, 2):
        assert c.plan.experts_of("a.r1.h2", layer) == u.hottest(layer, 2, 8)
    assert "usage/expert_usage.json" in (d / "campaign" / "logs" / "usage.log").read_text()
    d, _ = run
    c = campaign(d)
    u = load_usage(c.config["usage"])
    assert canonical.load(d / "campaign" / "plan.json")["identity"]["usage_sha256"] == u.sha256
    for layer in (1, 2):
        hot = c.plan.experts_of("a.r1.h2", layer)
        assert hot == u.hottest(layer, 2, c.source.n_experts)
        encoded = [f for f in c.fragments if f.node == "a.r1.h2" and f.block.layer == layer]
        assert tuple(e for f in encoded for e in f.experts) == hot and all(Path(c.fragment(f.node, f.block)).is_file()
                                                                         for f in encoded)


def test_second_run_does_nothing(run):
    d, _ = run
    p = smk(d, "-n")
    assert "Nothing to be done" in p.stdout + p.stderr


def test_snakemake_report_renders_html(run):
    """On the finished campaign, before the tests below change it (they run Snakemake up to the published tree only:
    eval and the report job are not run again)."""
    d, _ = run
    smk(d, "--report", str(d / "report.html"))
    html = (d / "report.html").read_text(errors="replace")
    assert len(html) > 10_000 and "quality.png" in html and "products.tsv" in html


def test_staging_never_holds_more_than_one_window_with_w1(run):
    d, _ = run
    c = campaign(d)
    allowed = [set(w.stage) | set(w.keep) for w in c.plan.windows]
    events = [json.loads(l) for l in (d / "campaign" / "staging.log").read_text().splitlines()]
    assert [e["event"] for e in events].count("stage") == len(c.source.shards)
    for e in events:
        assert any(set(e["present"]) <= a for a in allowed), e
    # the straddling shard is fetched once, in window 0, and serves window 1 too (Snakemake may even run
    # window 1's blocks that need only it before window 0 retires: that stages nothing new)
    straddler = next(iter(c.plan.straddling))
    assert [e.get("shard") for e in events].count(straddler) == 1
    stage1 = next(e for e in events if e["event"] == "stage" and e["window"] == 1)
    retire0 = next(i for i, e in enumerate(events) if e["event"] == "retire" and e["window"] == 0)
    assert events.index(stage1) > retire0  # window 1's own shards wait for window 0 to retire (W = 1)


def test_deleted_fragment_reruns_only_itself_and_its_descendants(run):
    """The middle of the chain (a stage with a parent and a child): its block is encoded again, and its child's
    block on it; its parent's block, which it descends from, is not."""
    d, _ = run
    victim = d / "campaign" / "fragments" / "a.r1" / "a.r1-layer001-block000.safetensors"
    before_bytes = victim.read_bytes()
    before = fragment_mtimes(d)
    victim.unlink()
    # up to the published tree (the repair marker, a target, still asks for the missing fragment); eval and the
    # report job, downstream of it, are the module campaign's first run's to test (above)
    smk(d, "--until", "verify_published")
    after = fragment_mtimes(d)
    changed = {k for k in after if after[k] != before.get(k)}
    assert changed == {"campaign/fragments/a.r1/a.r1-layer001-block000.safetensors"} | (
        {"campaign/fragments/a.r1.h2/a.r1.h2-layer001-block000.safetensors"}
        if "campaign/fragments/a.r1.h2/a.r1.h2-layer001-block000.safetensors" in after else set())
    parent = "campaign/fragments/a/a-layer001-block000.safetensors"
    assert after[parent] == before[parent]  # the block it descends from: not encoded again
    assert victim.read_bytes() == before_bytes  # deterministic re-encode (a residual on the same parent bytes)


def test_changing_a_stage_K_reruns_only_that_node_and_descendants(run, tmp_path):
    d = copy_campaign(run[0], tmp_path / "wf")  # a copy: the module's campaign keeps its recipe for the tests after
    recipe = json.loads(json.dumps(RECIPE))
    recipe["nodes"][2]["K"] = 2  # a.r1.h2: K3 -> K2
    cfg = json.loads((d / "config.yaml").read_text())
    write_config(d, recipe, **{k: v for k, v in cfg.items() if k != "recipe"})  # the recipe is the only change
    before = fragment_mtimes(d)
    smk(d, "--until", "verify_published")  # eval, downstream, is the module campaign's to test
    after = fragment_mtimes(d)
    changed = {k.split("/")[2] for k in after if after[k] != before.get(k)}
    assert changed == {"a.r1.h2"}
    assert (d / "campaign" / "published.verified").read_text().startswith("ok: ")


def test_finalize_twice_same_bytes_and_stray_refused(run):
    d, _ = run
    root = d / "campaign" / "published"
    first = tree_digest(root)
    # up to the published tree: eval and the report job, downstream of it, are the first run's to test (above)
    smk(d, "campaign/published.verified", "--forcerun", "finalize")  # the target first: --forcerun takes a list
    assert tree_digest(root) == first
    stray = d / "campaign" / "fragments" / "a" / "a-layer009-block000.safetensors"
    stray.write_bytes(b"not ours")
    try:
        p = smk(d, "--forcerun", "finalize", check=False)
        assert p.returncode != 0
        log = (d / "campaign" / "logs" / "finalize.log").read_text()
        assert "stray shard" in log and "a-layer009-block000.safetensors" in log
    finally:
        stray.unlink()
    smk(d, "campaign/campaign_summary.json", "campaign/published.verified")  # the failed finalize's outputs are gone
    assert tree_digest(root) == first


def test_combine_equals_the_chain_reconstruction(run, tmp_path):
    d, _ = run
    out = d / "campaign"
    c = campaign(d)
    n = c.source.n_experts
    adapter = tmp_path / "a.r1.h2.safetensors"
    p = subprocess.run([sys.executable, "-m", "fq", "combine", "--key", str(out / "signer.pub"), "--plan",
                        str(out / "published" / "assemblies" / "a.r1.h2.assembly.intoto.jsonl"), "--experts",
                        f"1:0-{n - 1}", "--base", str(out / "published" / "base" / "a"), "--no-state", "--out",
                        str(adapter)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    from fq.provenance.adapter import read_adapter
    from safetensors import safe_open

    hot = set(c.plan.experts_of("a.r1.h2", 1))
    ad = read_adapter(adapter)
    assert 0 < len(hot) < n
    for e in range(n):  # every expert of the layer: hot ones (three nodes) and the others (two), in both blocks
        for proj in ("gate_proj", "down_proj"):
            chain = []
            for node in ("a", "a.r1", "a.r1.h2"):
                if node == "a.r1.h2" and e not in hot:
                    continue
                f = c.fragment_of(node, 1, e // BLOCK)
                path = c.fragment(node, f.block)
                with safe_open(path, "pt") as fh:
                    key = f"model.layers.1.mlp.experts.{e}.{proj}"
                    chain.append({s: fh.get_tensor(f"{key}.{s}") for s in ("trellis", "suh", "svh", "mul1")})
            base = chain[0]
            got = reconstruct_chain(ad.chain(1, e, proj, base))
            assert torch.equal(got, reconstruct_chain(chain)), (e, proj)


def test_snakemake_lint_is_clean():
    p = subprocess.run([sys.executable, "-m", "snakemake", "--lint"], cwd=REPO, capture_output=True, text=True)
    assert "Congratulations, your workflow is in a good condition!" in p.stdout + p.stderr, p.stdout + p.stderr


def test_a_wrong_window_partition_is_refused_at_parse_time(tmp_path):
    write_config(tmp_path, RECIPE, windows="1")
    p = smk(tmp_path, "-n", check=False)
    assert p.returncode != 0 and "layer(s) 2 in no window" in p.stdout + p.stderr


def test_an_unknown_encode_granularity_is_refused_at_parse_time(tmp_path):
    write_config(tmp_path, RECIPE, encode={"device": "cpu", "per_job": "expert"})
    p = smk(tmp_path, "-n", check=False)
    out = p.stdout + p.stderr
    assert p.returncode != 0 and "'expert' is not one of ['block', 'layer']" in out and "per_job" in out


def test_cuda_without_named_devices_is_refused():
    from fq.errors import FqError
    from fq.workflow.devices import claim

    if torch.cuda.is_available():
        with pytest.raises(FqError, match="encode.devices is empty"):
            claim("cuda", [], "/tmp")
    with pytest.raises(FqError, match="encode.device"):
        claim("tpu", [0], "/tmp")
    assert claim("cpu", [], "/tmp") == "cpu"


# -- encode.per_job: layer -----------------------------------------------------------------------------------------
LAYER_MODE = {"device": "cpu", "devices": [], "threads": 1, "seed": 0, "per_job": "layer"}


@pytest.fixture(scope="module")
def layer_run(run, small, tmp_path_factory):
    """Layer mode, two ways. The module's recipe planned in layer mode (``snakemake -n``: which jobs and rules).
    And the base node alone run in layer mode on the same source, signed with the block-mode run's key and planned
    from the same expert usage: its first run is SIGKILLed (the whole process group, as a preemption would) once the
    first layer job has committed its first block and is encoding the second; the second run resumes it. The base
    alone keeps the encodes few (a node's fragments do not depend on the nodes beside it, so they must be the
    block-mode run's bytes)."""
    from tests.kits import crashkit as k

    d0, _ = run
    over = dict(encode=LAYER_MODE, signer_key=str(d0 / "campaign" / "keys" / "signer.key"))
    planned = tmp_path_factory.mktemp("wf-layer-plan")
    small_config(planned, small, RECIPE, **over)
    dry = smk(planned, "-n")
    d = tmp_path_factory.mktemp("wf-layer")
    small_config(d, small, BASE_ONLY, **over)
    camp = d / "campaign"
    first, second = (camp / "metrics" / "a" / f"a-layer001-block00{b}.json" for b in (0, 1))
    p = k.start(d)
    try:
        k.wait_for(lambda: first.is_file() or p.poll() is not None, 600, "the first block of the first layer job")
        mid_layer = first.is_file() and not second.exists() and p.poll() is None
        killed = {f.name: f.stat().st_mtime_ns for f in (camp / "fragments" / "a").glob("*.safetensors")}
    finally:
        k.killpg(p)
    smk(d, *k.TARGETS)  # up to the published tree: the report job is the module campaign's (test_full_run_...)
    return d, dry.stdout + dry.stderr, mid_layer, killed


def test_layer_mode_runs_one_job_per_node_and_layer(layer_run):
    d, dry, _, _ = layer_run
    counts = job_counts(dry)
    assert "encode" not in counts  # the block rule is not defined in layer mode
    assert counts["encode_layer"] == 4  # a and a.r1 (every expert: both blocks) x 2 layers
    # the hot stage's one block per layer is block 0 in one layer and block 1 in the other: two more rules
    assert sorted(n for n in counts if n.startswith("encode_layer_")) == ["encode_layer_2", "encode_layer_3"]
    assert sum(n for r, n in counts.items() if r.startswith("encode_layer")) == 6
    logs = sorted(p.name for p in (d / "campaign" / "logs" / "encode").iterdir())
    assert logs == [f"a-layer00{l}.log" for l in (1, 2)]


def test_layer_mode_killed_mid_layer_resumes_to_the_block_mode_bytes(run, layer_run):
    d0, _ = run
    d, _, mid_layer, killed = layer_run
    assert mid_layer, "the first run was not killed between the first layer job's two blocks"
    a, b = d0 / "campaign", d / "campaign"
    assert (b / "published.verified").read_text().startswith("ok: ")
    for kind in ("fragments", "metrics"):
        assert tree_digest(b / kind / "a") == tree_digest(a / kind / "a")
    # the killed job's committed block was redone with the rest of its layer (Snakemake reruns an incomplete job
    # whole): the documented price of a crash in layer mode
    after = fragment_mtimes(d)
    assert list(killed) == ["a-layer001-block000.safetensors"]
    assert after["campaign/fragments/a/a-layer001-block000.safetensors"] != killed["a-layer001-block000.safetensors"]


def test_switching_per_job_on_a_finished_campaign_reencodes_nothing(layer_run):
    d, _, _, _ = layer_run
    from tests.kits import crashkit as k

    p = smk(d, "-n", *k.TARGETS, "--config", "encode={per_job: block}")  # the published tree, as layer_run made it
    assert "Nothing to be done" in p.stdout + p.stderr


def test_a_layer_job_asks_for_its_source_when_snakemake_will_rerun_it_for_an_older_output(run):
    """Block mode can commit a stage's block before its parent's next block; a layer job of that stage then has an
    output older than one of its inputs, which Snakemake's mtime trigger reruns: it must have its shards staged."""
    d, _ = run
    c = campaign(d)
    b0, b1 = (c.block(1, i) for i in (0, 1))
    stage = [c.fragment("a.r1", b0), c.attestation(c.fragment("a.r1", b0)), c.metrics("a.r1", b0)]
    files = stage + [c.fragment("a", b0), c.fragment("a", b1), c.fragment("a.r1", b1), c.attestation(c.fragment("a.r1", b1)),
                     c.metrics("a.r1", b1)]
    saved = {p: os.stat(p) for p in files}
    try:
        now = time.time()
        for p, t in [(c.fragment("a", b0), now - 400), *((p, now - 300) for p in stage), (c.fragment("a", b1), now - 200),
                     *((p, now - 100) for p in files[5:])]:
            os.utime(p, (t, t))
        assert not c.fragment_needs_source("a.r1", b0) and not c.fragment_needs_source("a.r1", b1)
        assert c.layer_needs_source("a.r1", 1)
        os.utime(c.fragment("a", b1), (now - 350, now - 350))  # parent's block 1 older than every output: no rerun
        assert not c.layer_needs_source("a.r1", 1)
    finally:
        for p, st in saved.items():
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
