"""The input Hessians of the non-expert linears a whole-model base quantizes (fq.hessian.linear_store): captured by
the same layer-by-layer chain, they equal XᵀX of each linear's input taken by hooks on the full transformers model
(attention, shared expert, dense MLP, and lm_head after the final norm); linears reading one input share a group;
files are deterministic and refused when altered."""
from __future__ import annotations

import hashlib

import pytest
import torch

from fq.errors import FqError
from tests.kits import demokit
from fq.hessian import capture, layer as layer_mod, linear_store
from fq.model import demo_model

ROWS, COLS = 3, 48


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    d = tmp_path_factory.mktemp("linear-hessians")
    model, text = demokit.full_demo(d)
    return model, demokit.calibration_tokens(model, text, ROWS, COLS)


def _linears(ckpt, layer):
    """Every attention, shared and dense linear of ``layer`` (tensor prefixes)."""
    p = f"model.layers.{layer}."
    return sorted(n[: -len(".weight")] for n in ckpt.weight_map if n.startswith(p) and n.endswith("_proj.weight")
                  and ".experts." not in n)


def _reference(model, tokens):
    """Each linear's input on the full model (name -> [tokens, in] float64), and the final norm's output."""
    from fq.runtime.load import load_checkpoint

    m = load_checkpoint(model)
    seen: dict = {}
    handles = []
    for name, mod in m.named_modules():
        if isinstance(mod, torch.nn.Linear) and ".experts" not in name:
            handles.append(mod.register_forward_pre_hook(
                lambda _m, args, name=name: seen.__setitem__(name, args[0].detach().reshape(-1, args[0].shape[-1]))))
    with torch.no_grad():
        m(input_ids=tokens)
    for h in handles:
        h.remove()
    return {k: v.double() for k, v in seen.items()}


def _close(a, b, rtol=1e-5):
    return float((a - b).abs().max()) <= rtol * float(b.abs().max())


@pytest.fixture(scope="module")
def captured(demo, tmp_path_factory):
    """The chain on disk with every layer's non-expert linears and the head captured."""
    model, cal = demo
    out = tmp_path_factory.mktemp("cap")
    ckpt = layer_mod.read_checkpoint(model)
    prev = out / capture.EMBED_FILE
    capture.capture_embed(ckpt, cal, prev)
    files = {}
    for L in range(demo_model.N_LAYERS):
        nxt = out / capture.hidden_file(L)
        moe = L >= demo_model.FIRST_DENSE
        hess = out / f"hessian-layer{L:03d}.safetensors" if moe else None
        files[L] = out / linear_store.linear_file_name(L)
        r = capture.capture_layer(ckpt, L, prev, nxt, hess, linears=_linears(ckpt, L), out_linears=files[L],
                                  row_batch=2)
        assert r.linears_sha256 == hashlib.sha256(files[L].read_bytes()).hexdigest()
        prev = nxt
    files[None] = out / linear_store.linear_file_name(None)
    capture.capture_head(ckpt, prev, files[None], row_batch=2)
    return ckpt, files


def test_linear_hessians_equal_xtx_of_each_linears_input(demo, captured):
    model, cal = demo
    ckpt, files = captured
    ref = _reference(model, cal.tokens)
    for L, path in files.items():
        h = linear_store.read_linear_hessians(path)
        assert h.layer == L and h.meta["tokens"] == ROWS * COLS and set(h.counts) == {ROWS * COLS}
        names = ("lm_head",) if L is None else tuple(_linears(ckpt, L))
        assert h.names == names
        for n in names:
            x = ref[n]
            assert _close(h.for_linear(n), x.T @ x / x.shape[0]), (L, n)


def test_linears_reading_one_input_share_a_group(captured):
    _, files = captured
    groups = [g["linears"] for g in linear_store.read_linear_hessians(files[0]).meta["groups"]]
    p = "model.layers.0."
    assert groups == [[p + "mlp.down_proj"], [p + "mlp.gate_proj", p + "mlp.up_proj"],
                      [p + "self_attn.k_proj", p + "self_attn.q_proj", p + "self_attn.v_proj"],
                      [p + "self_attn.o_proj"]]
    moe = [g["linears"] for g in linear_store.read_linear_hessians(files[1]).meta["groups"]]
    p = "model.layers.1."
    assert [p + "mlp.shared_experts.gate_proj", p + "mlp.shared_experts.up_proj"] in moe
    assert [p + "mlp.shared_experts.down_proj"] in moe
    sizes = {g["linears"][0].rsplit(".", 1)[-1]: g["in_features"]
             for g in linear_store.read_linear_hessians(files[1]).meta["groups"]}
    assert sizes["down_proj"] == demo_model.MOE_INTERMEDIATE  # one shared expert


def test_linear_capture_is_deterministic(demo, captured, tmp_path):
    model, cal = demo
    ckpt, files = captured
    prev = tmp_path / capture.EMBED_FILE
    capture.capture_embed(ckpt, cal, prev)
    again = tmp_path / "again.safetensors"
    capture.capture_layer(ckpt, 0, prev, tmp_path / "h0.safetensors", linears=_linears(ckpt, 0), out_linears=again,
                          row_batch=2)
    assert again.read_bytes() == files[0].read_bytes()


def test_the_device_is_claimed_once_the_inputs_are_read(demo, captured, tmp_path, monkeypatch):
    """A calibration job takes its GPU late (``fq.workflow.calibration._late_claim``): the capture calls the claim
    once, after the hidden states and the layer's tensors are read, and gives the same bytes as a plain device."""
    model, cal = demo
    ckpt, files = captured
    prev = tmp_path / capture.EMBED_FILE
    capture.capture_embed(ckpt, cal, prev)
    events = []
    for name, mod in (("load_hidden", capture), ("layer_tensors", layer_mod)):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _real=real, _name=name, **k: events.append(_name) or _real(*a, **k))
    claim = lambda: events.append("claim") or "cpu"  # noqa: E731
    again = tmp_path / "again.safetensors"
    capture.capture_layer(ckpt, 0, prev, tmp_path / "h0.safetensors", linears=_linears(ckpt, 0), out_linears=again,
                          row_batch=2, device=claim)
    assert events == ["load_hidden", "layer_tensors", "claim"]
    assert again.read_bytes() == files[0].read_bytes()
    events.clear()
    head = tmp_path / "head.safetensors"
    last = files[None].parent / capture.hidden_file(demo_model.N_LAYERS - 1)  # the captured chain's last output
    capture.capture_head(ckpt, last, head, row_batch=2, device=claim)
    assert events == ["load_hidden", "claim"]
    assert head.read_bytes() == files[None].read_bytes()


def test_linear_hessian_file_refusals(captured, tmp_path):
    _, files = captured
    good = files[0]
    with pytest.raises(FqError, match="expected " + "0" * 64):
        linear_store.read_linear_hessians(good, expect_sha256="0" * 64)
    h = linear_store.read_linear_hessians(good)
    with pytest.raises(FqError, match="no Hessian for linear"):
        h.for_linear("model.layers.0.mlp.experts.0.down_proj")
    # a rewritten metadata field (groups no longer sorted) is refused by name
    from fq.model.shards import RawTensor, read_whole, tensors_in_range, write_shard

    header, data = read_whole(good, "x")
    t = tensors_in_range(header, [e.name for e in header.entries], 0, data)
    meta = dict(header.metadata)
    groups = linear_store.canonical.loads(meta["groups"], "g")
    meta["groups"] = linear_store.canonical.dumps(groups[::-1]).decode()
    bad = tmp_path / "bad.safetensors"
    write_shard(bad, [RawTensor.of(k, v) for k, v in t.items()], dict(sorted(meta.items())))
    with pytest.raises(FqError, match="metadata field groups"):
        linear_store.read_linear_hessians(bad)
    # a count that is not the token count
    t2 = dict(t)
    t2["h.0.count"] = torch.tensor(1, dtype=torch.int64)
    write_shard(bad, [RawTensor.of(k, v) for k, v in t2.items()], dict(header.metadata))
    with pytest.raises(FqError, match="h.0.count"):
        linear_store.read_linear_hessians(bad)


def test_capture_layer_linear_refusals(demo, captured, tmp_path):
    model, cal = demo
    ckpt, _ = captured
    prev = tmp_path / capture.EMBED_FILE
    capture.capture_embed(ckpt, cal, prev)
    with pytest.raises(FqError, match="linears and out_linears together"):
        capture.capture_layer(ckpt, 0, prev, tmp_path / "h.safetensors", linears=_linears(ckpt, 0))
    with pytest.raises(FqError, match="not one of the layer's"):
        capture.capture_layer(ckpt, 0, prev, tmp_path / "h.safetensors", linears=["model.layers.1.self_attn.q_proj"],
                              out_linears=tmp_path / "l.safetensors")


def test_glm5_mla_linears_group_by_input(tmp_path):
    """GLM-5's MLA: q_a and kv_a read the post-norm input (one group); q_b, kv_b and o_proj each their own."""
    from tests.test_hessian import _glm5_tiny

    d = _glm5_tiny(tmp_path / "glm5")
    ckpt = layer_mod.read_checkpoint(d)
    tokens = torch.randint(0, 512, (2, 40), generator=torch.Generator().manual_seed(3))
    hidden = capture.embed(ckpt, tokens)
    tensors, _ = layer_mod.layer_tensors(ckpt, 0)
    from fq.model.linears import classify

    names = sorted(lin.name for lin in (classify(n, "model.layers.", {1, 2}, 3) for n in tensors) if lin is not None)
    _, _, lin = capture.advance_linears(0, hidden, tensors, ckpt.config, linears=names, row_batch=2)
    short = [[n.rsplit(".", 1)[-1] for n in g] for g in lin.groups]
    assert ["kv_a_proj_with_mqa", "q_a_proj"] in short and ["kv_b_proj"] in short and ["q_b_proj"] in short \
        and ["o_proj"] in short, short
