"""fq.runtime: chain products loaded into a transformers Glm4MoeForCausalLM on the CPU, verified first.

The kit (tests/kits/runtimekit.py) publishes a tiny random-init GLM-4-MoE whose source experts are the full chain's
sum, so ``k2.r1.h2`` is the source exactly."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.kits import runtimekit as rk
from fq.errors import FqError
from fq.provenance.assembly import PlanState
from fq.model.experts import STANDARD
from fq.provenance.combine import combine
from fq.runtime import load as rt
from fq.runtime import quality


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    return rk.build(tmp_path_factory.mktemp("rt"))


@pytest.fixture(scope="module")
def windows():
    ids = torch.randint(0, 512, (1024,), generator=torch.Generator().manual_seed(7)).tolist()
    return quality.token_windows(ids, 128, 1024)


@pytest.fixture(scope="module")
def source(kit):
    return rt.load_checkpoint(kit.source)


@pytest.fixture(scope="module")
def loaded(kit):
    return {p: rt.load_product(kit.plan(p), kit.pub) for p in rk.PRODUCTS}


def expert_weights(model, layer: int, expert: int) -> dict[str, torch.Tensor]:
    """A Glm4Moe expert's three linears as transformers 5.x holds them (gate and up fused into one 3-D parameter,
    gate first), read independently of transformers' own reverse conversion."""
    experts = model.model.layers[layer].mlp.experts
    gate_up = experts.gate_up_proj[expert]
    return {"gate_proj": gate_up[: rk.INTER], "up_proj": gate_up[rk.INTER:], "down_proj": experts.down_proj[expert]}


def test_expert_weights_are_the_sum_of_the_chain_reconstructions(kit, loaded):
    for product, chain in rk.PRODUCTS.items():
        model, state = loaded[product].model, loaded[product].state
        assert state.chain == chain
        for layer in rk.LAYERS:
            for e in range(rk.N_EXPERTS):
                want_stages = [i for i, n in enumerate(chain) if (n, layer, e, "gate_proj") in kit.sets]
                assert state.stages[(layer, e)] == want_stages
                got = expert_weights(model, layer, e)
                for proj in rk.DIMS:
                    want = kit.chain_weight(chain, layer, e, proj)  # reconstruct_chain of the kit's own sets
                    assert got[proj].dtype == torch.float32
                    assert torch.equal(got[proj], want), (product, layer, e, proj)
    # the skeleton verbatim (float32 upcast of the same values)
    model = loaded["k2"].model
    assert torch.equal(model.model.embed_tokens.weight, kit.source_tensors["model.embed_tokens.weight"])
    assert torch.equal(model.model.layers[1].mlp.gate.weight, kit.source_tensors["model.layers.1.mlp.gate.weight"])


def test_the_loaded_expert_computes_its_chain_weights(kit, loaded):
    """The fused experts module, run on its own, computes down(silu(gate x) * up x) with the chain's weights."""
    model = loaded["k2.r1.h2"].model
    experts = model.model.layers[2].mlp.experts
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(3))
    idx = torch.tensor([[5, 0]] * 3)
    weights = torch.tensor([[1.0, 0.0]] * 3)
    with torch.no_grad():
        got = experts(x, idx, weights)
    w = {p: kit.chain_weight(["k2", "r1", "h2"], 2, 5, p) for p in rk.DIMS}
    want = (torch.nn.functional.silu(x @ w["gate_proj"].T) * (x @ w["up_proj"].T)) @ w["down_proj"].T
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


def test_published_tree_and_base_plus_adapter_give_identical_logits(kit, loaded, windows, tmp_path):
    for product in ("k2.r1", "k2.r1.h2"):
        adapter = tmp_path / f"{product}.safetensors"
        combine(kit.plan(product), kit.pub, adapter, base_dir=kit.base_dir)
        b = rt.load_adapter(kit.base_dir, adapter, kit.plan(product), kit.pub)
        a = loaded[product]
        assert b.state.stages == a.state.stages
        with torch.no_grad():
            la, lb = a.model(input_ids=windows).logits, b.model(input_ids=windows).logits
        assert torch.equal(la, lb)


def test_a_plan_outside_a_tree_with_its_adapter(kit, loaded, windows, tmp_path):
    """(b) as a deployment has it: the base checkpoint, the adapter and the plan file, nothing else."""
    adapter = tmp_path / "a.safetensors"
    combine(kit.plan("k2.r1"), kit.pub, adapter, base_dir=kit.base_dir)
    plan = tmp_path / kit.plan("k2.r1").name
    shutil.copy(kit.plan("k2.r1"), plan)
    b = rt.load_adapter(kit.base_dir, adapter, plan, kit.pub)
    with torch.no_grad():
        assert torch.equal(b.model(input_ids=windows[:2]).logits, loaded["k2.r1"].model(input_ids=windows[:2]).logits)


def test_an_expert_narrowed_adapter_gives_the_stages_only_on_the_chosen_experts(kit, tmp_path):
    chosen = {(1, 2), (1, 6), (2, 5)}
    adapter = tmp_path / "narrow.safetensors"
    combine(kit.plan("k2.r1.h2"), kit.pub, adapter, experts="1:2,6;2:5", base_dir=kit.base_dir)
    b = rt.load_adapter(kit.base_dir, adapter, kit.plan("k2.r1.h2"), kit.pub)
    for layer in rk.LAYERS:
        for e in range(rk.N_EXPERTS):
            got = expert_weights(b.model, layer, e)
            if (layer, e) in chosen:
                chain = ["k2", "r1", "h2"] if e in rk.HOT else ["k2", "r1"]
            else:
                chain = ["k2"]
            assert b.state.stages[(layer, e)] == list(range(len(chain)))
            for proj in rk.DIMS:
                assert torch.equal(got[proj], kit.chain_weight(chain, layer, e, proj)), (layer, e, proj)


# -- refused before anything runs ---------------------------------------------------------------------------
@pytest.fixture
def no_model(monkeypatch):
    """Fails the test if a model is built: a refusal must come before any forward (or any model at all)."""
    def built(*a, **k):
        raise AssertionError("a model was built from unverified bytes")
    monkeypatch.setattr(rt, "build_model", built)


def copy_tree(kit, tmp_path):
    root = tmp_path / "copy"
    shutil.copytree(kit.root, root)
    return root


def flip(path, offset_from_end: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[-offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("rel", ["stages/r1/r1-layer001-block000.safetensors",
                                 "stages/h2/h2-layer002-block001.safetensors",
                                 "base/k2/k2-layer002-block001.safetensors",
                                 "base/k2/model.safetensors"])
def test_a_flipped_byte_in_a_fragment_or_the_base_is_refused_before_it_runs(kit, tmp_path, no_model, rel):
    root = copy_tree(kit, tmp_path)
    flip(root / rel)
    with pytest.raises(FqError) as e:
        rt.load_product(root / "assemblies/k2.r1.h2.assembly.intoto.jsonl", kit.pub)
    assert rel.rsplit("/", 1)[-1] in str(e.value)


def test_a_swapped_plan_is_refused_before_it_runs(kit, tmp_path, no_model):
    root = copy_tree(kit, tmp_path)
    shutil.copy(root / "assemblies/k2.r1.assembly.intoto.jsonl", root / "assemblies/k2.r1.h2.assembly.intoto.jsonl")
    with pytest.raises(FqError, match="k2.r1"):
        rt.load_product(root / "assemblies/k2.r1.h2.assembly.intoto.jsonl", kit.pub)


def test_a_wrong_key_is_refused(kit, tmp_path, no_model):
    from fq.provenance.attest import keys

    _, pub_path, _ = keys.generate(tmp_path / "other")
    with pytest.raises(FqError):
        rt.load_product(kit.plan("k2.r1"), keys.load_public(pub_path))


def test_a_tampered_adapter_is_refused_before_it_runs(kit, tmp_path, no_model):
    adapter = tmp_path / "a.safetensors"
    combine(kit.plan("k2.r1.h2"), kit.pub, adapter, base_dir=kit.base_dir)
    good = adapter.read_bytes()
    flip(adapter)
    with pytest.raises(FqError, match="bytes differ from the range the plan names"):
        rt.load_adapter(kit.base_dir, adapter, kit.plan("k2.r1.h2"), kit.pub)
    # an adapter built from another plan, presented with this one
    adapter.write_bytes(good)
    other = tmp_path / "b.safetensors"
    combine(kit.plan("k2.r1"), kit.pub, other, base_dir=kit.base_dir)
    with pytest.raises(FqError, match="another plan"):
        rt.load_adapter(kit.base_dir, other, kit.plan("k2.r1.h2"), kit.pub)
    # a base that is not the one the plan pins
    base = tmp_path / "base"
    shutil.copytree(kit.base_dir, base)
    flip(base / "k2-layer001-block000.safetensors")
    with pytest.raises(FqError, match="k2-layer001-block000"):
        rt.load_adapter(base, adapter, kit.plan("k2.r1.h2"), kit.pub)


def test_build_model_refuses_a_missing_tensor(kit):
    config, tensors = rt.checkpoint_state(kit.source)
    del tensors[STANDARD.key(1, 3, "down_proj", "weight")]
    with pytest.raises(FqError, match="do not fill the model"):
        rt.build_model(config, tensors)


# -- quality at the output --------------------------------------------------------------------------------------
def test_quality_against_the_source(kit, loaded, source, windows):
    ref = quality.Reference(source, windows)
    q = {p: quality.compare(loaded[p].model, ref) for p in rk.PRODUCTS}
    assert q["k2.r1.h2"].kl == 0.0 and q["k2.r1.h2"].top1 == 1.0  # the full chain is the source
    assert q["k2.r1.h2"].ppl == pytest.approx(ref.ppl, rel=1e-12)
    assert q["k2"].kl > q["k2.r1"].kl > 0  # each stage brings the output closer
    assert q["k2"].top1 < q["k2.r1"].top1 < 1
    assert q["k2"].positions == windows.shape[0] * (windows.shape[1] - 1)


def test_quality_is_deterministic_whatever_the_thread_count(loaded, source, windows):
    before = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ref = quality.Reference(source, windows)
            results.append((ref.nll, quality.compare(loaded["k2"].model, ref)))
        assert results[0] == results[1]
        assert torch.get_num_threads() == 2  # restored
    finally:
        torch.set_num_threads(before)


def test_fq_eval_measures_every_product_and_native_point_deterministically(kit, tmp_path):
    """The CLI on the kit's published tree: every product, the native K5 point of k2.r1.h2; the full chain is the
    source (KL 0); two runs write the same bytes."""
    import subprocess
    import sys

    from fq.core import canonical

    outs = []
    for run in ("a", "b"):
        out, tsv = tmp_path / f"{run}.json", tmp_path / f"{run}.tsv"
        p = subprocess.run([sys.executable, "-m", "fq", "eval", str(kit.root), "--key", str(kit.pub_path),
                            "--source", str(kit.source), "--text", str(kit.heldout), "--native", str(kit.native),
                            "--tokens", "512", "--seq-len", "128", "--out", str(out), "--tsv", str(tsv)],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        outs.append((out.read_bytes(), tsv.read_bytes()))
    assert outs[0] == outs[1]
    doc = canonical.loads(outs[0][0])
    assert doc["format"] == "fq-eval/1" and doc["text"]["positions"] == 4 * 127
    prods = doc["products"]
    assert sorted(prods) == sorted(rk.PRODUCTS)
    assert prods["k2.r1.h2"]["kl"] == 0.0 and prods["k2.r1.h2"]["top1"] == 1.0
    assert prods["k2"]["kl"] > prods["k2.r1"]["kl"] > 0
    assert prods["k2"]["effective_bpw"] == 2 and prods["k2.r1"]["effective_bpw"] == 3
    assert prods["k2.r1.h2"]["effective_bpw"] == pytest.approx(3 + 2 * 3 / 8)
    native = doc["native"]["native K5 mul1 for k2.r1.h2"]
    assert prods["k2.r1.h2"]["native"] == "native K5 mul1 for k2.r1.h2"
    assert native["experts"] == 2 * len(rk.HOT) and native["chain"] == ["k2", "r1", "native-K5-mul1"]
    assert native["kl"] > 0  # random one-pass sets, not the source's experts
    assert prods["k2"]["native"] is None and prods["k2.r1"]["native"] is None  # no K3 base, no K3 native here
    lines = outs[0][1].decode().splitlines()
    assert lines[0].split("\t")[:3] == ["name", "kind", "chain"] and len(lines) == 1 + 3 + 1


def test_fq_eval_refuses_a_tampered_product_before_measuring(kit, tmp_path):
    import subprocess
    import sys

    root = copy_tree(kit, tmp_path)
    flip(root / "stages/h2/h2-layer001-block000.safetensors")
    out = tmp_path / "e.json"
    p = subprocess.run([sys.executable, "-m", "fq", "eval", str(root), "--key", str(kit.pub_path), "--source",
                        str(kit.source), "--text", str(kit.heldout), "--out", str(out)], capture_output=True, text=True)
    assert p.returncode == 2 and "h2-layer001-block000" in p.stderr and not out.exists()


def _no_forward_pass(monkeypatch):
    """evaluate() must refuse before it loads the source or runs any model."""
    from fq.runtime import quality

    def refuse(*a, **k):
        raise AssertionError("a forward pass ran before the refusal")
    monkeypatch.setattr(quality, "Reference", refuse)
    monkeypatch.setattr(quality, "compare", refuse)


@pytest.mark.parametrize("tamper", ["flipped byte in the last product's stage", "unlisted extra file"])
def test_fq_eval_verifies_the_whole_tree_before_any_forward_pass(kit, tmp_path, monkeypatch, tamper):
    """k2.r1.h2 is measured last: a flipped byte in its stage used to be found after the source and two products ran;
    a file the publication statement does not list used to pass."""
    from fq.runtime.evaluate import evaluate

    root = copy_tree(kit, tmp_path)
    if tamper.startswith("flipped"):
        flip(root / "stages/h2/h2-layer001-block000.safetensors")
        want = "h2-layer001-block000"
    else:
        (root / "stages/h2/notes.txt").write_text("x")
        want = "notes.txt: not covered by any attestation or base manifest"
    _no_forward_pass(monkeypatch)
    out = tmp_path / "e.json"
    with pytest.raises(FqError, match="refused before any forward pass") as e:
        evaluate(root, kit.pub, source=kit.source, text=kit.heldout, out_json=out)
    assert want in str(e.value) and not out.exists()


def test_fq_eval_reads_and_records_the_version_state(kit, tmp_path, monkeypatch):
    from fq.runtime.evaluate import evaluate

    state_path = tmp_path / "state.json"
    _no_forward_pass(monkeypatch)
    with pytest.raises(AssertionError, match="a forward pass ran"):  # verified and accepted: then measured
        evaluate(kit.root, kit.pub, source=kit.source, text=kit.heldout, out_json=tmp_path / "e.json",
                 state=PlanState(state_path))
    recorded = json.loads(state_path.read_text())
    pub_key = f"{kit.campaign['signer']}/publication"
    assert recorded[pub_key]["version"] == 1 and len(recorded) == 1 + len(rk.PRODUCTS)
    recorded[pub_key]["version"] += 1  # a newer publication of this signer was seen since
    state_path.write_text(json.dumps(recorded))
    with pytest.raises(FqError, match=r"refused before any forward pass .*older than version \d+ already seen"):
        evaluate(kit.root, kit.pub, source=kit.source, text=kit.heldout, out_json=tmp_path / "e.json",
                 state=PlanState(state_path))


def test_an_adapter_relabelled_for_another_plan_is_refused(kit, tmp_path, no_model):
    """k2.r1's adapter with its metadata rewritten to name k2.r1.h2's plan: the hot experts lack h2's stage."""
    import json

    from fq.model.shards import RawTensor, read_header
    from fq.provenance.adapter import write_adapter
    from fq.provenance.assembly import read_assembly

    src = tmp_path / "r1.safetensors"
    combine(kit.plan("k2.r1"), kit.pub, src, base_dir=kit.base_dir)
    with open(src, "rb") as fh:
        header = read_header(fh, str(src))
        data = src.read_bytes()
    plan = read_assembly(kit.plan("k2.r1.h2"), kit.pub)
    meta = dict(header.metadata, product="k2.r1.h2", plan_sha256=plan.sha256,
                stages=json.dumps([{"index": 1, "node": "r1", "K": 1, "codebook": "mul1"},
                                   {"index": 2, "node": "h2", "K": 2, "codebook": "mcg"}], separators=(",", ":")))
    forged = tmp_path / "forged.safetensors"
    write_adapter(forged, tensors=[RawTensor(e.name, e.dtype, e.shape, data[e.start:e.end]) for e in header.entries],
                  meta=meta, layout=STANDARD)
    with pytest.raises(FqError, match="are not the stages the plan's chain has for this expert"):
        rt.load_adapter(kit.base_dir, forged, kit.plan("k2.r1.h2"), kit.pub)


def test_the_exllamav3_path_stages_exactly_the_verified_base_bytes(kit, tmp_path):
    """fq.runtime.exl3 hands exllamav3 a private copy written from the buffers whose sha256 was checked (CPU part
    of that path; the CUDA part is tests/test_exl3_runtime.py). Every manifest file lands byte-identical."""
    from fq.runtime.exl3 import stage_base

    vc = rt.verify_product(kit.plan("k2.r1.h2"), kit.pub)
    assert sorted(vc.stage_sets) and all(i > 0 for sets in vc.stage_sets.values() for i, _ in sets)
    dest = tmp_path / "staged"
    dest.mkdir()
    stage_base(vc, dest)
    listed = vc.base.manifest.files
    assert sorted(p.name for p in dest.iterdir()) == sorted(listed)
    for name in listed:
        assert (dest / name).read_bytes() == (kit.base_dir / name).read_bytes()


def test_the_exllamav3_path_refuses_a_base_file_swapped_after_verification(kit, tmp_path):
    """A shard replaced between verification and staging (the window a lazily reading runtime would expose) is
    refused, and nothing of it is staged."""
    from fq.runtime.exl3 import stage_base

    root = copy_tree(kit, tmp_path)
    vc = rt.verify_product(root / "assemblies" / kit.plan("k2.r1").name, kit.pub)
    flip(vc.base_dir / rk.SKELETON)
    dest = tmp_path / "staged"
    dest.mkdir()
    with pytest.raises(FqError, match="changed since it was verified"):
        stage_base(vc, dest)
    assert not (dest / rk.SKELETON).exists()
