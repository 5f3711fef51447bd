"""fq.hessian on the demo model with real transformers: the layer-by-layer chain is the source model's forward, the
captured Hessians equal XᵀX computed directly from hooks on the full model, the files are deterministic and
checked on read, and calibration tokens are bound to their text."""
from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import pytest
import torch

from tests.kits import demokit
from fq.model import demo_model
from fq.errors import FqError
from fq.hessian import calibration, capture, layer as layer_mod, store
from fq.model.shards import RawTensor, write_shard

ROWS, COLS = 4, 64


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("hessian")
    return demokit.full_demo(d)


@pytest.fixture(scope="module")
def cal(demo):
    return demokit.calibration_tokens(*demo, ROWS, COLS)


@pytest.fixture(scope="module")
def reference(demo, cal):
    """The full transformers model (fq.runtime.load) on the same tokens, with hooks: each MoE block's input, each
    router's top-k, each layer's output and the final norm's input."""
    from fq.runtime.load import load_checkpoint

    model, _ = demo
    m = load_checkpoint(model)
    seen: dict = {"x": {}, "topk": {}, "layer": {}}
    handles = []
    for L, lay in enumerate(m.model.layers):
        handles.append(lay.register_forward_hook(lambda _m, _i, out, L=L: seen["layer"].__setitem__(
            L, (out[0] if isinstance(out, tuple) else out).detach())))
        if hasattr(lay.mlp, "experts"):
            handles.append(lay.mlp.register_forward_pre_hook(lambda _m, args, L=L: seen["x"].__setitem__(
                L, args[0].detach())))
            handles.append(lay.mlp.gate.register_forward_hook(lambda _m, _i, out, L=L: seen["topk"].__setitem__(
                L, out[-1].detach())))
    handles.append(m.model.norm.register_forward_pre_hook(lambda _m, args: seen.__setitem__("final", args[0].detach())))
    with torch.no_grad():
        m(input_ids=cal.tokens)
    for h in handles:
        h.remove()
    return m, seen


@pytest.fixture(scope="module")
def chain(demo, cal):
    """embed + advance through every layer, in memory, both capture modes for the MoE layers."""
    model, _ = demo
    ckpt = layer_mod.read_checkpoint(model)
    hidden = capture.embed(ckpt, cal.tokens)
    outs, sums, routed = [], {}, {}
    for L in range(ckpt.config["num_hidden_layers"]):
        tensors, _ = layer_mod.layer_tensors(ckpt, L)
        nxt, s = capture.advance(L, hidden, tensors, ckpt.config)
        if s is not None:
            sums[L] = s
            _, routed[L] = capture.advance(L, hidden, tensors, ckpt.config, routed_only=True)
        outs.append(nxt)
        hidden = nxt
    return ckpt, outs, sums, routed


def _close(a, b, rtol=1e-5):
    """max |a - b| relative to max |b|."""
    return float((a - b).abs().max()) <= rtol * float(b.abs().max())


def test_layer_modules_equal_the_full_models_layers(demo, reference):
    ckpt = layer_mod.read_checkpoint(demo[0])
    m, _ = reference
    arch = layer_mod.architecture(ckpt.config)
    hfc = layer_mod.hf_config(ckpt.config)
    for L in range(ckpt.config["num_hidden_layers"]):
        tensors, shards = layer_mod.layer_tensors(ckpt, L)
        mine = layer_mod.build_layer(hfc, arch, L, tensors).state_dict()
        theirs = m.model.layers[L].state_dict()
        assert sorted(mine) == sorted(theirs)
        for k in theirs:
            assert torch.equal(mine[k], theirs[k]), (L, k)
        assert set(shards) == {ckpt.weight_map[n] for n in tensors}  # only the shards holding layer L were read
    assert torch.equal(layer_mod.rotary(hfc, arch).inv_freq, m.model.rotary_emb.inv_freq)


def test_chain_reproduces_the_full_model_forward(reference, chain):
    _, seen = reference
    ckpt, outs, sums, _ = chain
    assert sorted(sums) == [1, 2]  # layer 0 is dense: it advances the states and captures nothing
    for L, out in enumerate(outs):
        assert out.shape == (ROWS, COLS, demo_model.HIDDEN) and out.dtype == torch.float32
        assert _close(out, seen["layer"][L], 1e-5), L
    # the last layer's output is what the full model's final norm receives
    assert float((outs[-1] - seen["final"]).abs().max()) < 1e-4


def test_input_hessian_is_xtx_of_the_moe_block_input(reference, chain):
    _, seen = reference
    _, _, sums, routed = chain
    for L, s in sums.items():
        x = seen["x"][L].reshape(-1, demo_model.HIDDEN).double()
        assert s.input_count == ROWS * COLS and s.tokens == ROWS * COLS
        assert _close(s.input, x.T @ x)
        assert torch.equal(routed[L].input, s.input)  # the mode changes only the down-projection sums


def test_down_hessians_all_experts_and_routed_only(reference, chain):
    m, seen = reference
    _, _, sums, routed = chain
    for L, s in sums.items():
        experts = m.model.layers[L].mlp.experts
        x = seen["x"][L].reshape(-1, demo_model.HIDDEN)
        topk = seen["topk"][L].reshape(x.shape[0], -1)
        counts = torch.bincount(topk.reshape(-1), minlength=demo_model.N_EXPERTS).tolist()
        r = routed[L]
        assert s.mode == "all-experts" and r.mode == "routed-only"
        assert s.down_counts == [ROWS * COLS] * demo_model.N_EXPERTS
        assert r.down_counts == counts and sum(counts) == ROWS * COLS * 2  # top-2 routing
        for e in range(demo_model.N_EXPERTS):
            with torch.no_grad():
                gate, up = torch.nn.functional.linear(x, experts.gate_up_proj[e]).chunk(2, dim=-1)
                a = (experts.act_fn(gate) * up).double()
            assert _close(s.down[e], a.T @ a), (L, e)
            ar = a[(topk == e).any(dim=-1)]
            assert ar.shape[0] == counts[e]
            assert _close(r.down[e], ar.T @ ar), (L, e)
            assert not torch.allclose(r.down[e], s.down[e])  # fewer tokens: a different Hessian


def test_capture_is_deterministic_and_files_round_trip(demo, cal, chain, tmp_path):
    model, _ = demo
    a = capture.capture_all(model, cal, tmp_path / "a")
    b = capture.capture_all(model, cal, tmp_path / "b", keep_hidden=False)
    assert sorted(a["hessians"]) == [1, 2]
    for L, path in a["hessians"].items():
        assert path.name == f"hessian-layer{L:03d}.safetensors"
        assert path.read_bytes() == b["hessians"][L].read_bytes()
    assert [p.name for p in b["hidden"]] == ["hidden-layer002.safetensors"]
    assert a["hidden"][-1].read_bytes() == b["hidden"][-1].read_bytes()
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [
        "hessian-layer001.safetensors", "hessian-layer002.safetensors", "hidden-layer002.safetensors"]
    # the files hold what the in-memory chain computed (same settings): sums rounded once to float32
    _, _, sums, _ = chain
    for L, path in a["hessians"].items():
        h = store.read_hessians(path, expect_sha256=a["digests"][path.name])
        s = sums[L]
        assert h.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
        assert h.layer == L and h.mode == "all-experts" and h.n_experts == demo_model.N_EXPERTS
        assert h.meta["calibration"] == cal.digest and h.meta["tokens"] == ROWS * COLS
        assert set(h.meta["source_shards"]) == {f"model-0000{i}-of-00004.safetensors" for i in ((2, 3) if L == 1 else (3, 4))}
        assert h.meta["hidden_in"] == a["digests"][f"hidden-layer{L - 1:03d}.safetensors"]
        assert torch.equal(h.input_sum(), s.input.float().double())
        assert torch.equal(h.input(), s.input.float().double() / (ROWS * COLS))
        for e in range(demo_model.N_EXPERTS):
            assert torch.equal(h.down(e), s.down[e].float().double() / (ROWS * COLS))
        assert torch.equal(h.input(), h.input().T)
        assert path.stat().st_size - _data_start(path) == store.layer_bytes(256, 128, 8) + 8 * 9
    # the hidden files chain: each names the layer that consumes it and the calibration
    hidden, meta = capture.load_hidden(a["hidden"][0], next_layer=0, calibration=cal.digest)
    assert hidden.shape == (ROWS, COLS, demo_model.HIDDEN) and meta["sha256"] == a["digests"]["hidden-embed.safetensors"]


def _data_start(path: Path) -> int:
    with open(path, "rb") as fh:
        return 8 + struct.unpack("<Q", fh.read(8))[0]


def test_packed_upper_triangle_layout(tmp_path):
    from safetensors import safe_open

    n = 5
    h = torch.arange(n * n, dtype=torch.float64).reshape(n, n)
    h = h + h.T
    i, j = torch.triu_indices(n, n)
    assert torch.equal(store.pack(h), h[i, j].float())
    assert store.pack(h).numel() == store.packed_len(n) == 15
    assert store.pack(h)[:n].tolist() == h[0].tolist()  # row 0 first, then row 1 from its diagonal
    assert torch.equal(store.unpack(store.pack(h), n), h)
    with pytest.raises(FqError, match="packed 5x5 triangle has 15"):
        store.unpack(torch.zeros(14), n)
    path = tmp_path / store.file_name(7)
    sums = _sums(tmp_path, 7)
    store.write_hessians(path, sums, _meta())
    with safe_open(str(path), "pt") as f:  # the reference safetensors reader reads the file unchanged
        assert torch.equal(f.get_tensor("input"), sums.input[torch.triu_indices(16, 16).unbind()].float())
        assert f.get_tensor("down.count").tolist() == sums.down_counts
        assert f.metadata()["format"] == "fq-hessian/1"
    # GLM-5 (hidden 6144, intermediate 2048, 256 experts): the size the module docstring states
    assert store.layer_bytes(6144, 2048, 256) == 2_224_041_984


def _sums(tmp_path, layer=3, n=16, m=8, E=3, mode="all-experts"):
    g = torch.Generator().manual_seed(layer)
    x = torch.randn(40, n, generator=g, dtype=torch.float64)
    a = torch.randn(E, 40, m, generator=g, dtype=torch.float64)
    counts = [40] * E if mode == "all-experts" else [40, 0, 17]
    return capture.LayerSums(layer, mode, x.T @ x, 40, torch.stack([ai.T @ ai for ai in a]), counts, 4, 10)


def _meta(**kw):
    return {"architecture": "Glm4MoeForCausalLM", "calibration": "a" * 64, "config_sha256": "b" * 64,
            "source_shards": {"model-00001-of-00001.safetensors": "c" * 64}, "hidden_in": "", "row_batch": 4,
            "rows": 4, "cols": 10, "torch": "t", "transformers": "tf", **kw}


def _rewrite(src: Path, dst: Path, *, drop=(), reshape=None, meta=None, extra=None):
    """A copy of a Hessian file with tensors dropped/reshaped or metadata changed (through fq.model.shards' writer)."""
    from safetensors import safe_open

    with safe_open(str(src), "pt") as f:
        md = dict(f.metadata())
        names = list(f.keys())
        ts = {k: f.get_tensor(k) for k in names}
    order = ["input", "input.count"] + sorted((k for k in names if k.startswith("down.") and k != "down.count"),
                                              key=lambda k: int(k.split(".")[1])) + ["down.count"]
    out = []
    for k in order:
        if k in drop:
            continue
        t = ts[k]
        if reshape and k in reshape:
            t = t[: reshape[k]]
        out.append(RawTensor.of(k, t))
    if extra:
        out.append(RawTensor.of(extra, torch.zeros(1)))
    md.update(meta or {})
    write_shard(dst, out, dict(sorted(md.items())))
    return dst


def test_hessian_file_refusals_name_file_and_field(tmp_path):
    good = tmp_path / store.file_name(3)
    digest = store.write_hessians(good, _sums(tmp_path), _meta())
    h = store.read_hessians(good, expect_sha256=digest)
    assert h.down_counts == (40, 40, 40)

    with pytest.raises(FqError, match=rf"{good}: sha256 {digest}, expected {'0' * 64} \(field hessian_sha256"):
        store.read_hessians(good, expect_sha256="0" * 64)
    # tampered bytes: the digest the campaign recorded no longer matches
    bad = tmp_path / "tampered.safetensors"
    raw = bytearray(good.read_bytes())
    raw[-100] ^= 0x40
    bad.write_bytes(bytes(raw))
    with pytest.raises(FqError, match=rf"{bad}: sha256 .* \(field hessian_sha256"):
        store.read_hessians(bad, expect_sha256=digest)

    cases = [
        (dict(reshape={"down.1": 10}), r"tensor 'down.1' is F32 \[10\], expected F32 \[36\]"),
        (dict(reshape={"input": 100}), r"tensor 'input' is F32 \[100\], expected F32 \[136\]"),
        (dict(drop=("down.2",)), r"tensor 'down.2' missing"),
        (dict(drop=("input.count",)), r"tensor 'input.count' missing"),
        (dict(extra="down.3"), r"unexpected tensor 'down.3' \(n_experts is 3\)"),
        (dict(meta={"format": "fq-hessian/0"}), r"metadata field format is 'fq-hessian/0', expected 'fq-hessian/1'"),
        (dict(meta={"n_experts": "4"}), r"tensor 'down.3' missing"),
        (dict(meta={"hidden_size": "17"}), r"tensor 'input' is F32 \[136\], expected F32 \[153\] \(hidden_size 17"),
        (dict(meta={"capture": "some"}), r"metadata field capture is 'some'"),
        (dict(meta={"tokens": "41"}), r"metadata field tokens is 41, expected rows x cols = 40"),
        (dict(meta={"calibration": "xyz"}), r"metadata field calibration is 'xyz', expected a sha256"),
        (dict(meta={"source_shards": "[]"}), r"metadata field source_shards must be"),
    ]
    for i, (kw, msg) in enumerate(cases):
        path = _rewrite(good, tmp_path / f"case{i}.safetensors", **kw)
        with pytest.raises(FqError, match=rf"{path}: .*{msg}"):
            store.read_hessians(path)
    no_meta = tmp_path / "nometa.safetensors"
    write_shard(no_meta, [RawTensor.of("input", torch.zeros(136))], {"format": "fq-hessian/1"})
    with pytest.raises(FqError, match=rf"{no_meta}: metadata fields missing \['architecture'"):
        store.read_hessians(no_meta)
    nan = _sums(tmp_path)
    nan.down[1, 0, 0] = float("nan")
    store.write_hessians(tmp_path / "nan.safetensors", nan, _meta())
    with pytest.raises(FqError, match=r"nan.safetensors: tensor 'down.1' has non-finite values"):
        store.read_hessians(tmp_path / "nan.safetensors")
    # routed-only: an expert no token reached has no Hessian, and says so
    ro = tmp_path / "routed.safetensors"
    store.write_hessians(ro, _sums(tmp_path, mode="routed-only"), _meta())
    h = store.read_hessians(ro)
    assert h.down_counts == (40, 0, 17) and h.down(2).shape == (8, 8)
    with pytest.raises(FqError, match=r"routed.safetensors: down.1: no calibration token was routed to expert 1"):
        h.down(1)
    # all-experts with a count short of every token is a contradiction
    short = _rewrite(ro, tmp_path / "short.safetensors", meta={"capture": "all-experts"})
    with pytest.raises(FqError, match=r"short.safetensors: down.count\[1\] is 0, expected 40 \(all-experts"):
        store.read_hessians(short)


def test_capture_layer_refusals(demo, cal, tmp_path):
    model, _ = demo
    ckpt = layer_mod.read_checkpoint(model)
    emb = tmp_path / capture.EMBED_FILE
    capture.capture_embed(ckpt, cal, emb)
    with pytest.raises(FqError, match=rf"{emb}: metadata field next_layer is '0', expected '1'"):
        capture.capture_layer(ckpt, 1, emb, tmp_path / "h1", tmp_path / "x1")
    with pytest.raises(FqError, match="layer 0 is dense"):
        capture.capture_layer(ckpt, 0, emb, tmp_path / "h0", tmp_path / "x0")
    with pytest.raises(FqError, match="layer 1 is an MoE layer: capture_layer needs out_hessian"):
        capture.capture_layer(ckpt, 1, emb, tmp_path / "h1")
    with pytest.raises(FqError, match="layer 3: the calibration chain covers layers 0..2"):
        capture.capture_layer(ckpt, 3, emb, tmp_path / "h3", tmp_path / "x3")
    shard = "model-00001-of-00004.safetensors"
    with pytest.raises(FqError, match=rf"{shard}: sha256 [0-9a-f]{{64}}, expected {'0' * 64} \(the digest the campaign"):
        capture.capture_layer(ckpt, 0, emb, tmp_path / "h0", sha256={shard: "0" * 64})
    assert not (tmp_path / "h0").exists() and not (tmp_path / "h1").exists()
    with pytest.raises(FqError, match=r"ids 0\.\.600 outside the model's vocabulary 0\.\.511"):
        capture.embed(ckpt, torch.tensor([[0, 600]]))
    other = dict(ckpt.config, architectures=["MixtralForCausalLM"])
    with pytest.raises(FqError, match="model_type 'glm4_moe' is not one of MixtralForCausalLM's"):
        layer_mod.architecture(other)
    with pytest.raises(FqError, match="architecture 'LlamaForCausalLM' is not a model family fq reads; supported: "
                                      ".*Glm4MoeForCausalLM"):
        layer_mod.architecture(dict(ckpt.config, architectures=["LlamaForCausalLM"], model_type="llama"))
    # every registered family has a chain; one without (a family registered later) is refused by name
    import dataclasses

    from fq.model import families
    bare = dataclasses.replace(families.by_name("minimax"), calibration=None)
    with pytest.raises(FqError, match=r"x/config.json: calibration: MiniMaxForCausalLM \(MiniMax-Text-01\) has no "
                                      r"calibration chain .*calibrated families: .*MiniMaxForCausalLM"):
        families.check_calibration(bare, "x/config.json")


def test_calibration_tokens(demo, cal, tmp_path):
    model, text = demo
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    again = calibration.from_text(text, sha, model / "tokenizer.json", ROWS, COLS)
    assert again.tokens.dtype == torch.int64 and again.tokens.shape == (ROWS, COLS)
    assert torch.equal(again.tokens, cal.tokens) and again.digest == cal.digest == calibration.token_digest(cal.tokens)
    # rows are consecutive windows of the token stream
    big = calibration.from_text(text, sha, model, 2 * ROWS, COLS)
    assert torch.equal(big.tokens[:ROWS], cal.tokens)
    assert torch.equal(big.tokens.reshape(-1)[:ROWS * COLS], cal.tokens.reshape(-1))
    assert calibration.from_text(text, sha, model, ROWS * 2, COLS // 2).digest != cal.digest  # same ids, other shape
    assert cal.source["sha256"] == sha and cal.source["tokens_available"] > 16 * 128

    with pytest.raises(FqError, match=rf"{text}: sha256 {sha}, expected {'1' * 64} \(field text_sha256\)"):
        calibration.from_text(text, "1" * 64, model, ROWS, COLS)
    with pytest.raises(FqError, match=r"text_sha256 must be 64 lowercase hex"):
        calibration.from_text(text, "ABC", model, ROWS, COLS)
    short = tmp_path / "short.txt"
    short.write_text("a few words only")
    ssha = hashlib.sha256(short.read_bytes()).hexdigest()
    with pytest.raises(FqError, match=rf"{short}: \d+ tokens, fewer than the 256 that rows x cols = 4 x 64 needs"):
        calibration.from_text(short, ssha, model, ROWS, COLS)
    with pytest.raises(FqError, match="rows must be a positive integer"):
        calibration.from_text(text, sha, model, 0, COLS)

    tok = tmp_path / "tokens.safetensors"
    calibration.save_tokens(tok, cal)
    back = calibration.from_tokens(tok, ROWS, COLS, sha256=hashlib.sha256(tok.read_bytes()).hexdigest())
    assert torch.equal(back.tokens, cal.tokens) and back.digest == cal.digest
    calibration.save_tokens(tmp_path / "tokens2.safetensors", cal)
    assert (tmp_path / "tokens2.safetensors").read_bytes() == tok.read_bytes()
    with pytest.raises(FqError, match=rf"{tok}: sha256 .*expected {'2' * 64} \(field tokens_sha256\)"):
        calibration.from_tokens(tok, ROWS, COLS, sha256="2" * 64)
    with pytest.raises(FqError, match=rf"{tok}: 256 tokens, fewer than the 258 that rows x cols = 2 x 129 needs"):
        calibration.from_tokens(tok, 2, 129)
    flat = tmp_path / "flat.safetensors"
    write_shard(flat, [RawTensor.of("tokens", cal.tokens.reshape(-1).int())], {})
    assert torch.equal(calibration.from_tokens(flat, 2, COLS).tokens, cal.tokens[:2])
    wrong = tmp_path / "wrong.safetensors"
    write_shard(wrong, [RawTensor.of("ids", cal.tokens)], {})
    with pytest.raises(FqError, match=rf"{wrong}: tensors \['ids'\], expected exactly one named 'tokens'"):
        calibration.from_tokens(wrong, ROWS, COLS)
    assert json.loads(demo_model.files()["config.json"])["num_hidden_layers"] == 3


def test_importing_the_package_loads_no_torch():
    import subprocess
    import sys

    code = ("import sys, fq.hessian, fq.hessian.calibration, fq.hessian.capture, fq.hessian.layer, fq.hessian.store\n"
            "print('torch' in sys.modules, 'transformers' in sys.modules, 'fq.codec' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False", "False"]


# -- GLM-5's architecture: MLA attention with a DSA indexer ---------------------------------------------------------
def _glm5_tiny(d: Path, **over) -> Path:
    """A tiny GlmMoeDsaForCausalLM (GLM-5's class) with random weights, saved by transformers itself."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("glm_moe_dsa", **{**dict(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16,
        v_head_dim=32, index_topk=32, index_head_dim=32, index_n_heads=2, max_position_embeddings=256, n_group=1,
        topk_group=1), **over})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def test_glm5_architecture_chain_reproduces_the_full_model(tmp_path):
    """The chain on GLM-5's own class: 48 columns against an indexer top-k of 32, so the sparse attention selects
    (the chain materializes the causal mask the indexer reads); each layer's output and each MoE layer's input
    Hessian equal the full model's."""
    from transformers import AutoModelForCausalLM

    d = _glm5_tiny(tmp_path / "glm5")
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    tokens = torch.randint(0, 512, (3, 48), generator=torch.Generator().manual_seed(1))
    seen: dict = {"layer": {}, "x": {}}
    for L, lay in enumerate(m.model.layers):
        lay.register_forward_hook(lambda _m, _i, out, L=L: seen["layer"].__setitem__(L, out[0].detach()))
        if hasattr(lay.mlp, "experts"):
            lay.mlp.register_forward_pre_hook(lambda _m, args, L=L: seen["x"].__setitem__(L, args[0].detach()))
    with torch.no_grad():
        m(input_ids=tokens)
    r = capture.capture_all(d, tokens, tmp_path / "cap", row_batch=2)
    assert sorted(r["hessians"]) == [1, 2] and layer_mod.architecture(m.config.to_dict()).name == "GlmMoeDsaForCausalLM"
    for L in range(3):
        out, _ = capture.load_hidden(r["hidden"][L + 1], next_layer=L + 1)
        assert _close(out, seen["layer"][L], 1e-5), L
    for L, p in r["hessians"].items():
        h = store.read_hessians(p)
        x = seen["x"][L].reshape(-1, 128).double()
        assert h.input_count == 3 * 48 and _close(h.input(), x.T @ x / x.shape[0], 1e-6), L


def test_glm5_shared_indexer_layers_are_refused_by_name(tmp_path):
    d = _glm5_tiny(tmp_path / "glm5s", index_topk_pattern="FSF")
    tokens = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    with pytest.raises(FqError, match="layer 1: its attention reuses the previous layer's top-k token selection"):
        capture.capture_all(d, tokens, tmp_path / "cap")
