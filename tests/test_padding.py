"""Matrices whose dims are multiples of 16 but not of 128 (gpt-oss's hidden = intermediate = 2880), stored zero-padded
to multiples of 128 as exllamav3 1.6.5 pads them (issue 23; ``fq.codec.shape``).

- The codec: encoding W is encoding W zero-padded, byte for byte (weight-only, a residual stage, LDLQ with H
  zero-padded); the padded rows and columns reconstruct to exactly zero; W_hat, rel_mse and proxy_err are W's own
  entries; ``reconstruct(..., shape=)`` trims and refuses a stored shape that is not the padded one; a dim that is not
  a multiple of 16 is refused.
- A tiny gpt-oss (transformers' own classes, tests/kits/familykit.py) of hidden 160 and intermediate 96 (stored 256 and
  128), in its published MXFP4 layout: read, one block (its one MoE layer, 2 experts) encoded by the encode job
  (``fq.workflow.encode.encode_blocks``), published as finalize lays a base out (skeleton, source config, derived
  files, manifest, plan, publication), ``fq verify``, and fq's CPU runtime against transformers. About 15 s on two
  cores; exllamav3 loads the same kind of base on the GPU (benchmarks/family_campaigns.py, ``gpt_oss-padded*``).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.kits import familykit as fk
from fq.codec import encode, encode_residual, reconstruct, reconstruct_chain
from fq.codec.exact import tree_sum
from fq.codec.ldlq import encode_ldlq
from fq.codec.shape import padded, padded_shape
from fq.errors import FqError


def _pad(W: torch.Tensor, shape) -> torch.Tensor:
    out = torch.zeros(shape, dtype=W.dtype)
    out[: W.shape[0], : W.shape[1]] = W
    return out


def _equal_sets(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -- the codec ----------------------------------------------------------------------------------------------------
W = torch.randn(48, 80, generator=torch.Generator().manual_seed(0)) * 0.02  # stored (128, 128)


@pytest.fixture(scope="module")
def enc():
    return encode(W, 2, "mul1", seed=3)


def test_a_padded_encode_is_the_encode_of_the_zero_padded_matrix(enc):
    e = enc
    assert _equal_sets(e.tensors, encode(_pad(W, (128, 128)), 2, "mul1", seed=3).tensors)
    assert tuple(e.tensors["trellis"].shape) == (8, 8, 32) and tuple(e.tensors["suh"].shape) == (128,) \
        and tuple(e.tensors["svh"].shape) == (128,)
    full = reconstruct(e.tensors)
    assert full.shape == (128, 128) and not full[48:].any() and not full[:, 80:].any()  # zero channel scales
    assert torch.equal(e.W_hat, full[:48, :80]) and torch.equal(reconstruct(e.tensors, shape=(48, 80)), e.W_hat)
    d = (e.W_hat.double() - W.double()).flatten()
    assert e.sum_sq_err == float(tree_sum(d * d)) and e.sum_sq_w == float(tree_sum(W.double().flatten() ** 2))
    assert 0 < e.rel_mse < 0.2
    # a stage: the residual on the padded shape, trimmed as the base
    r = encode_residual(W, [e.tensors], 2, "mul1", seed=4)
    assert _equal_sets(r.tensors, encode_residual(_pad(W, (128, 128)), [e.tensors], 2, "mul1", seed=4).tensors)
    chain = reconstruct_chain([e.tensors, r.tensors], shape=(48, 80))
    assert torch.equal(chain, e.W_hat + r.W_hat)
    assert float(((chain - W) ** 2).sum()) < 0.5 * e.sum_sq_err


def test_a_padded_ldlq_encode_zero_pads_the_hessian():
    """H is given at W's own width (calibration captures it there) and zero-padded: the Hessian exllamav3 captures
    at the padded width, its input zero-extended; the damping is over the padded diagonal, as exllamav3's."""
    X = torch.randn(256, 80, generator=torch.Generator().manual_seed(1))
    H = X.t() @ X / 256
    e = encode_ldlq(W, H, 2, "mul1", seed=5)
    p = encode_ldlq(_pad(W, (128, 128)), _pad(H, (128, 128)), 2, "mul1", seed=5)
    assert _equal_sets(e.tensors, p.tensors)
    full = reconstruct(e.tensors)
    assert not full[48:].any() and not full[:, 80:].any() and torch.equal(e.W_hat, full[:48, :80])
    assert e.proxy_err == pytest.approx(p.proxy_err, rel=1e-12) and 0 < e.proxy_err < 0.2
    with pytest.raises(FqError, match=r"Hessian H: expected a floating-point \(in, in\) = \(80, 80\)"):
        encode_ldlq(W, _pad(H, (128, 128)), 2)


def test_dims_that_are_not_multiples_of_16_are_refused_and_so_is_a_stored_shape_that_is_not_the_padded_one(enc):
    with pytest.raises(FqError, match=r"W: shape \(out=40, in=72\); both dims must be positive multiples of 16"):
        encode(torch.randn(40, 72), 2)
    t = enc.tensors
    with pytest.raises(FqError, match=r"w: stored \(out, in\) = \(128, 128\); its matrix is \(out, in\) = \(48, 200\), "
                                      r"stored zero-padded to \(out, in\) = \(128, 256\)"):
        reconstruct(t, "w", shape=(48, 200))
    with pytest.raises(FqError, match=r"parents: chain reconstructs to \(128, 128\), W is \(48, 144\) \(stored at "
                                      r"\(128, 256\)\)"):
        encode_residual(torch.randn(48, 144), [t], 1)
    assert padded(2880) == 2944 and padded(256) == 256 and padded_shape((2880, 96)) == (2944, 128)


# -- a tiny gpt-oss of non-128 dims, published ---------------------------------------------------------------------
HIDDEN, INTER, EXPERTS, K = 160, 96, 2, 2  # two experts (both of every token's top-2): 6 matrices to encode
KEYS = {"hidden_size": HIDDEN, "intermediate_size": INTER, "num_hidden_layers": 1, "num_local_experts": EXPERTS}
IDS = torch.randint(0, fk.VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
PREFIX = "model.layers.0.mlp.experts"


def _publish(src: Path, work: Path) -> dict:
    """One K2 mul1 base of ``src`` (one block: its one MoE layer) encoded by the encode job and laid out as finalize
    publishes it: the fragment, the skeleton of the source's one shard, source_config.json, the derived files,
    the manifest, the plan and the publication statement."""
    import shutil
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import encode_job as bench  # its campaign.json, as init writes it
    from fq.core import canonical
    from fq.model.shards import RawTensor, read_header, read_range
    from fq.model.source import PROJECTIONS, load_source
    from fq.provenance.attest import keys
    from fq.provenance.exl3config import SOURCE_CONFIG, write_derived
    from fq.provenance.fragments import fragment_filename
    from fq.workflow.encode import BlockJob, encode_blocks
    from fq.workflow.skeleton import source_statement
    from tests.kits import tree

    s = load_source(src)
    (shard,) = s.shards
    doc_path, key_path = bench.make_campaign(work, "cpu", EXPERTS, src / shard)
    doc = canonical.load(doc_path)
    priv = keys.load_private(key_path)
    pub = priv.public_key()
    recipe = tree.recipe("padded", {"a": {"role": "base", "K": K, "codebook": "mul1", "parent": None}}, {"a": ["a"]})
    t = tree.Tree(work / "published", priv, pub, doc["identity"], source_statement(doc, [shard]), recipe,
                  doc["encoder"])
    root = t.root
    base = root / "base" / "a"
    base.mkdir(parents=True)
    frag = base / fragment_filename("a", 0, 0)
    sources = {e: {p: s.expert_source(0, e, p, lambda n: str(src / n)).to_json() for p in PROJECTIONS}
               for e in range(EXPERTS)}
    job = BlockJob(node="a", role="base", K=K, codebook="mul1", node_digest=recipe.node_digest("a"), layer=0,
                   block=0, experts=list(range(EXPERTS)), sources=sources, ancestors=[], out_fragment=str(frag),
                   out_metrics=str(work / "metrics.json"))
    (summary,) = encode_blocks([job], campaign_json=str(doc_path), key_path=str(key_path), device="cpu",
                               devices_list=[], lock_dir=str(work / "locks"), seed=0, layout=s.family_entry.layout,
                               threads=2)
    with open(src / shard, "rb") as fh:
        header = read_header(fh, str(src / shard))
        raws = [RawTensor(n, header.entry(n).dtype, tuple(header.entry(n).shape),
                          read_range(fh, header.entry(n).start, header.entry(n).length, shard))
                for n in s.skeleton_tensors]
    t.skeleton("a", shard, raws)
    shutil.copyfile(src / "config.json", base / SOURCE_CONFIG)
    derived = write_derived(base, bits=K, codebook="mul1")
    t.manifest("a", derived)
    path = t.plan("a", ["a"], [f"base/a/{frag.name}"], expires="2030-01-01T00:00:00Z")
    t.publish()
    return {"src": src, "root": root, "base": base, "plan": path, "pub": pub, "priv": priv, "fragment": frag,
            "summary": summary, "source": s, "derived": [d["name"] for d in derived]}


@pytest.fixture(scope="module")
def oss(tmp_path_factory):
    """The tiny gpt-oss of hidden 160 / intermediate 96 in its published MXFP4 layout, and its published base."""
    d = tmp_path_factory.mktemp("oss")
    bf16 = fk.build("GptOssForCausalLM", d / "bf16", keys=KEYS, max_shard_size="1GB")
    src = fk.to_mxfp4_gptoss(bf16, d / "mxfp4")
    return _publish(src, d / "work")


def test_the_source_is_read_and_planned_at_the_padded_shapes(oss):
    from fq.planning.plan import encoded_expert_bytes

    s = oss["source"]
    assert s.source_format.kind == "mxfp4" and s.padded
    assert s.expert_shape("gate") == (INTER, HIDDEN) and s.stored_shape("gate") == (128, 256)
    assert s.expert_shape("down") == (HIDDEN, INTER) and s.stored_shape("down") == (256, 128)
    assert encoded_expert_bytes(s, K) == 3 * (128 * 256 * K // 8 + 2 * (128 + 256) + 4)


def test_one_block_is_encoded_at_the_stored_shapes_and_reconstructs_the_source(oss):
    from safetensors.torch import load_file

    from fq.model.formats import read_matrix
    from fq.model.source import PROJECTIONS

    s, got = oss["source"], load_file(str(oss["fragment"]))
    layout = s.family_entry.layout
    for e in range(EXPERTS):
        for p, lp in zip(PROJECTIONS, layout.projections):
            t = {x: got[layout.key(0, e, lp, x)] for x in ("trellis", "suh", "svh", "mul1")}
            (out_p, in_p), (out_f, in_f) = s.stored_shape(p), s.expert_shape(p)
            assert tuple(t["trellis"].shape) == (in_p // 16, out_p // 16, 16 * K)
            assert tuple(t["suh"].shape) == (in_p,) and tuple(t["svh"].shape) == (out_p,)
            full = reconstruct(t)
            assert not full[out_f:].any() and not full[:, in_f:].any()  # the padding decodes to zero
            w = read_matrix({}, s.expert_source(0, e, p, lambda n: str(oss["src"] / n)), p)
            m = oss["summary"]["experts"][str(e)][p]
            err = float(((reconstruct(t, shape=(out_f, in_f)) - w) ** 2).sum() / (w ** 2).sum())
            assert err == pytest.approx(m["sum_sq_err"] / m["sum_sq_w"], rel=1e-5) and err < 0.15, (e, p, err)


def test_the_published_base_verifies_and_states_the_padded_shapes(oss):
    from safetensors.torch import load_file

    from fq.core import canonical
    from fq.provenance.exl3config import EXPERT_BIAS, QUANTIZATION_CONFIG
    from fq.provenance.verify import verify_path

    report = verify_path(oss["root"], oss["pub"])
    assert report.ok, report.problems
    base = oss["base"]
    assert EXPERT_BIAS in oss["derived"]
    storage = canonical.loads((base / QUANTIZATION_CONFIG).read_bytes())["tensor_storage"]
    gate = storage[f"{PREFIX}.1.gate_proj"]["stored_tensors"]
    down = storage[f"{PREFIX}.1.down_proj"]["stored_tensors"]
    assert gate[f"{PREFIX}.1.gate_proj.trellis"]["shape"] == [256 // 16, 128 // 16, 16 * K]
    assert gate[f"{PREFIX}.1.gate_proj.svh"]["shape"] == [128] and down[f"{PREFIX}.1.down_proj.svh"]["shape"] == [256]
    # the biases exllamav3 reads beside the trellis are zero-padded to the stored output width (its EXL3 loader does
    # not pad them), the real entries the source's fused ones
    assert gate[f"{PREFIX}.1.gate_proj.bias"]["shape"] == [128] and down[f"{PREFIX}.1.down_proj.bias"]["shape"] == [256]
    bias = load_file(str(base / EXPERT_BIAS))
    fused = {k: v for k, v in fk.load_tensors(oss["src"]).items() if k.endswith("_bias")}
    for e in range(EXPERTS):
        g = bias[f"{PREFIX}.{e}.gate_proj.bias"]
        assert torch.equal(g[:INTER], fused[f"{PREFIX}.gate_up_proj_bias"][e, 0::2].half()) and not g[INTER:].any()
        dn = bias[f"{PREFIX}.{e}.down_proj.bias"]
        assert torch.equal(dn[:HIDDEN], fused[f"{PREFIX}.down_proj_bias"][e].half()) and not dn[HIDDEN:].any()


def test_a_base_stored_at_another_shape_than_its_config_makes_is_refused(oss, tmp_path):
    """The geometry check everything that verifies a base runs (fq.provenance.geometry: fq verify, fq combine --base,
    the runtimes), against a config whose intermediate size pads to another width than the fragment's."""
    from fq.provenance.geometry import stored_shape_problems
    from fq.provenance.manifest import verify_base

    vb = verify_base(oss["base"], oss["pub"])
    assert stored_shape_problems(oss["base"], vb.manifest.files, vb.shards) == []
    other = tmp_path / "other"
    other.mkdir()
    cfg = json.loads((oss["base"] / "source_config.json").read_text())
    (other / "source_config.json").write_text(json.dumps({**cfg, "intermediate_size": 144}))
    (problem,) = stored_shape_problems(other, vb.manifest.files, vb.shards)
    assert problem == (f"{other}/{oss['fragment'].name}: expert 0 down_proj is stored at (out, in) = (256, 128); "
                       f"source_config.json makes the matrix (160, 144), stored zero-padded at (256, 256)")


def test_the_cpu_runtime_trims_the_reconstruction_and_matches_transformers(oss):
    """fq's runtime from the verified base: every routed expert is the trimmed reconstruction (fused back as
    transformers loads gpt-oss), and its logits are transformers' on those weights exactly; against the source
    (dequantized MXFP4) the K2 base is far closer than the source with its routed experts zeroed."""
    from safetensors.torch import load_file

    from fq.model.formats import fuse_experts
    from fq.model.source import PROJECTIONS
    from fq.runtime import load as rt

    s = oss["source"]
    loaded = rt.load_product(oss["plan"], oss["pub"])
    got = load_file(str(oss["fragment"]))
    layout = s.family_entry.layout
    per_expert = {layout.key(0, e, lp, "weight"): reconstruct({x: got[layout.key(0, e, lp, x)] for x in
                                                               ("trellis", "suh", "svh", "mul1")},
                                                              shape=s.expert_shape(p))
                  for e in range(EXPERTS) for p, lp in zip(PROJECTIONS, layout.projections)}
    fused = fuse_experts(per_expert, layout, s.family_entry.fused_experts, "test")
    for name, t in fused.items():
        assert torch.equal(loaded.state.tensors[name], t), name
    config, tensors = rt.checkpoint_state(oss["src"])
    assert sorted(loaded.state.tensors) == sorted(tensors)
    experts = set(fused)
    same = rt.build_model(config, {**tensors, **fused})
    ref = rt.build_model(config, tensors)
    zeroed = rt.build_model(config, {n: torch.zeros_like(t) if n in experts else t for n, t in tensors.items()})
    with torch.no_grad():
        mine, dequant, want, zero = (m(input_ids=IDS).logits.double() for m in (loaded.model, same, ref, zeroed))
    assert torch.equal(mine, dequant)

    def kl(a, b):
        la, lb = torch.log_softmax(a, -1), torch.log_softmax(b, -1)
        return float((la.exp() * (la - lb)).sum(-1).mean())

    assert kl(want, mine) < 0.5 * kl(want, zero), (kl(want, mine), kl(want, zero))


def test_tp_export_cuts_whole_blocks_and_never_the_padded_hidden_dim(oss, tmp_path):
    """The MoE weight manifest declares the stored (padded) shapes: gate/up split their output (the intermediate
    size, 96 stored at 128: one block, so tp 1 only, said clearly; experts go over ep), down its input, and the
    padded hidden dim is never split; the reference MoE forward zero-extends the input and trims down's output."""
    from safetensors.torch import load_file

    from fq.model.source import PROJECTIONS
    from fq.tp.export import tp_export
    from fq.tp.moe import moe_forward

    with pytest.raises(FqError, match=r"out 128 / 2 = 64 is not a multiple of 128 .*TP sizes that work for this "
                                      r"manifest: 1; or use expert parallelism"):
        tp_export(oss["plan"], oss["pub"], tmp_path / "tp2", tp=2, sign_key=oss["priv"])
    res = tp_export(oss["plan"], oss["pub"], tmp_path / "ep2", tp=1, ep=2, sign_key=oss["priv"])
    assert res.files >= 2
    s, got = oss["source"], load_file(str(oss["fragment"]))
    layout = s.family_entry.layout
    sets = {(e, p): {x: got[layout.key(0, e, lp, x)] for x in ("trellis", "suh", "svh", "mul1")}
            for e in range(EXPERTS) for p, lp in zip(PROJECTIONS, layout.projections)}
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(3))
    router = torch.randn(EXPERTS, HIDDEN, generator=torch.Generator().manual_seed(4))
    stored = {e: tuple(reconstruct(sets[(e, p)]) for p in PROJECTIONS) for e in range(EXPERTS)}
    own = {e: tuple(reconstruct(sets[(e, p)], shape=s.expert_shape(p)) for p in PROJECTIONS) for e in range(EXPERTS)}
    torch.testing.assert_close(moe_forward(x, router, stored, 2), moe_forward(x, router, own, 2), rtol=0, atol=1e-6)


def test_fq_evals_weight_only_twin_of_a_fused_expert_family_is_fused_as_transformers_loads_it(oss):
    """fq eval's weight-only twin of a gpt-oss product (calibration.compare_weight_only): each routed expert the
    twin's reconstruction, fused back into the fused tensors gpt-oss's model reads (one matrix per expert would be
    keys transformers refuses). A twin made of the product's own fragment is the product exactly."""
    from safetensors.torch import load_file

    from fq.runtime import load as rt
    from fq.runtime.evaluate import _twin_tensors

    loaded = rt.load_product(oss["plan"], oss["pub"])
    st = loaded.state
    got = load_file(str(oss["fragment"]))
    layout = st.layout
    own = {(0, e, lp): {x: got[layout.key(0, e, lp, x)] for x in ("trellis", "suh", "svh", "mul1")}
           for e in range(EXPERTS) for lp in layout.projections}
    twin = _twin_tensors(st, st.plan, {"a": own}, "twins")
    assert sorted(twin) == sorted(st.tensors) and all(torch.equal(twin[k], st.tensors[k]) for k in twin)
    with torch.no_grad():
        assert torch.equal(rt.build_model(st.config, twin)(input_ids=IDS).logits, loaded.model(input_ids=IDS).logits)
