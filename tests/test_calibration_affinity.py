"""Router-affinity weighted Hessians (config ``calibration.weighting``, fq.hessian.affinity): on the demo model the
weighted Hessians equal a direct computation from the full transformers model (each token's weight the sigmoid of
its router logit, computed from the checkpoint's router matrix); ``none`` writes the file, binding and attestation
fields of before; every family's declared router score is what its router applies (checked on each family's own MoE
block); families without one, and a routed-only capture, are refused when the config or the price is read; and the
option flows through a real Snakemake campaign into the Hessian file, its binding and the fragment's attestation."""
from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
import torch

from fq.core import canonical
from fq.errors import FqError
from tests.kits import demokit
from fq.hessian import affinity, capture, layer as layer_mod, store
from fq.model import families

ROWS, COLS = 2, 32
PRE_OPTION_TENSORS = ["input", "input.count"] + [f"down.{e}" for e in range(8)] + ["down.count"]


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo checkpoint, tokens of its calibration split, and its layer-1 Hessian captured at each weighting."""
    d = tmp_path_factory.mktemp("affinity")
    model, text = demokit.full_demo(d)
    cal = demokit.calibration_tokens(model, text, ROWS, COLS)
    files = {}
    for w in affinity.WEIGHTINGS:
        out = d / w
        out.mkdir()
        files[w] = capture.capture_all(model, cal, out, weighting=w)["hessians"][1]
    default = d / "default"
    default.mkdir()
    files["default"] = capture.capture_all(model, cal, default)["hessians"][1]
    return model, cal, files


def _direct(model: Path, tokens: torch.Tensor, layer: int = 1) -> dict:
    """Layer ``layer``'s Hessians computed directly on the full transformers model: x the MoE block's input (hooked),
    c = sigmoid(x · W_routerᵀ) from the checkpoint's router matrix (GLM's router scores its experts by a sigmoid),
    a_e = act(x·gate_eᵀ)·(x·up_eᵀ) from the model's experts; H_e = Σ c x xᵀ / Σ c and Σ c a aᵀ / Σ c in float64."""
    from fq.model.checkpoint_model import load_checkpoint

    m = load_checkpoint(model)
    block = m.model.layers[layer].mlp
    seen = {}
    block.register_forward_pre_hook(lambda _m, args: seen.__setitem__("x", args[0].detach()))
    with torch.no_grad():
        m(input_ids=tokens)
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).float()
    c = torch.sigmoid((x @ block.gate.weight.detach().T.float()).double())
    ex = block.experts
    out = {"inputs": [], "downs": []}
    xd = x.double()
    for e in range(ex.gate_up_proj.shape[0]):
        gate, up = torch.nn.functional.linear(x, ex.gate_up_proj[e].detach().float()).chunk(2, dim=-1)
        a = (ex.act_fn(gate) * up).double()
        w = c[:, e]
        out["inputs"].append((xd * w[:, None]).T @ xd / w.sum())
        out["downs"].append((a * w[:, None]).T @ a / w.sum())
    out["input"] = xd.T @ xd / xd.shape[0]
    return out


def _close(a, b, rtol=2e-5) -> bool:
    return float((a - b).abs().max()) <= rtol * float(b.abs().max())



def test_weighted_hessians_equal_the_direct_computation_on_the_demo_model(demo):
    model, cal, files = demo
    ref = _direct(model, cal.tokens)
    full = store.read_hessians(files["affinity"])
    down = store.read_hessians(files["affinity-down"])
    assert (full.weighting, down.weighting) == ("affinity", "affinity-down")
    for e in range(8):
        assert _close(full.down(e), ref["downs"][e]) and _close(full.input_for(e), ref["inputs"][e])
        # affinity-down: the same weighted downs, gate/up on the layer's one input Hessian
        assert torch.equal(down.down(e), full.down(e))
        assert torch.equal(down.input_for(e), down.input()) and _close(down.input(), ref["input"])
    # the weighting moves the Hessians: not the all-experts ones
    plain = store.read_hessians(files["none"])
    assert not _close(plain.down(0), full.down(0), rtol=1e-3)
    # the masses are Σ c of each expert: every token counted, each at its router score
    assert full.down_mass == down.down_mass == full.input_mass
    assert all(0 < m < ROWS * COLS for m in full.down_mass) and full.down_counts == (ROWS * COLS,) * 8


def test_weighting_none_writes_the_file_binding_and_attestation_of_before(demo):
    from safetensors import safe_open

    from fq.workflow.calibration import quant_hessian, weighted

    _, _, files = demo
    assert store.read_hessians(files["none"]).sha256 == store.read_hessians(files["default"]).sha256
    with safe_open(str(files["none"]), "pt") as f:
        assert list(f.keys()) == sorted(PRE_OPTION_TENSORS) and sorted(f.metadata()) == sorted(store.META_KEYS)
    with safe_open(str(files["affinity"]), "pt") as f:
        assert {"down.mass", "input.mass", "input.7"} <= set(f.keys()) and f.metadata()["weighting"] == "affinity"
    bound = {"file": "hessian-layer001.safetensors", "sha256": "0" * 64, "calibration": "1" * 64,
             "capture": "all-experts"}
    assert weighted("none") == {} and quant_hessian(bound) == bound
    assert quant_hessian(dict(bound, weighting="affinity"))["weighting"] == "affinity"
    assert store.layer_bytes(256, 128, 8) == 395_776 and store.layer_bytes(256, 128, 8, "affinity-down") == 395_840


def test_a_weighted_file_is_checked_on_read(demo, tmp_path):
    from fq.model.shards import RawTensor, write_shard
    from safetensors import safe_open

    _, _, files = demo
    with safe_open(str(files["affinity-down"]), "pt") as f:
        md, ts = dict(f.metadata()), {k: f.get_tensor(k) for k in f.keys()}

    def rewrite(name, meta=None, drop=(), **over):
        p = tmp_path / name
        t = {k: over.get(k.replace(".", "_"), v) for k, v in ts.items() if k not in drop}
        write_shard(p, [RawTensor.of(k, v) for k, v in t.items()], dict(sorted({**md, **(meta or {})}.items())))
        return p

    cases = [
        (rewrite("a.safetensors", drop=("down.mass",)), r"tensor 'down.mass' missing"),
        (rewrite("b.safetensors", meta={"weighting": "soft"}), r"metadata field weighting is 'soft'"),
        (rewrite("c.safetensors", meta={"capture": "routed-only"}), r"a weighted file is an all-experts capture"),
        (rewrite("d.safetensors", down_mass=-ts["down.mass"]), r"tensor 'down.mass' is .* expected finite"),
    ]
    for path, msg in cases:
        with pytest.raises(FqError, match=rf"{path}: .*{msg}"):
            store.read_hessians(path)


def _families_with_a_chain() -> list[str]:
    return [f.architectures[0] for f in families.REGISTRY.values() if f.calibration is not None]


def _moe_block(arch_name: str):
    """(the family's Arch, the MoE block of an MoE layer of its tiny config: random init, its router's parameters
    and score bias made to act)."""
    from tests.kits import familykit

    if arch_name in familykit.ARCHS:
        config = familykit.config_of(arch_name)
    else:  # DeepSeek-V3.2: the tiny config the chain's own family test uses
        from tests import test_hessian_families as thf
        from transformers import AutoConfig

        model_type = {"DeepseekV32ForCausalLM": "deepseek_v32"}[arch_name]
        _, args, _ = thf.FAMILIES[model_type]
        config = json.loads(AutoConfig.for_model(model_type, **{**thf.COMMON, **args}).to_json_string())
        config["architectures"] = [arch_name]
    arch = layer_mod.architecture(config)
    hfc = layer_mod.hf_config(config)
    layer = next(L for L in range(arch.n_layers(config)) if arch.is_moe(config, L))
    layer_cls, _ = arch.classes()
    torch.manual_seed(0)
    block = getattr(layer_cls(hfc, layer).float().eval(), arch.moe_block)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a module built alone is not initialized (the model's _init_weights does that): seeded
        for name, t in list(block.named_parameters()) + list(block.named_buffers()):
            if t.is_floating_point():  # the router and its score bias wider, so that the choice varies per token
                t.copy_((0.5 if name.startswith(arch.router + ".") or "bias" in name else 0.05)
                        * torch.randn(t.shape, generator=g))
    return arch, block, int(hfc.hidden_size)


@pytest.mark.parametrize("arch_name", _families_with_a_chain())
def test_each_familys_declared_router_score_is_what_its_router_applies(arch_name):
    """The declared score function (sigmoid or softmax of the router's logits), at the experts the router chose, is
    the top-k weights the family's own experts module is handed, up to one factor per token; the other function is
    refused. Phi-3.5-MoE's sparsemixer is neither: it declares none."""
    arch, block, hidden = _moe_block(arch_name)
    seen = {}
    getattr(block, arch.router).register_forward_hook(lambda _m, _i, out: seen.__setitem__("router", out))
    block.experts.register_forward_pre_hook(lambda _m, args, kw: seen.__setitem__(
        "applied", (list(args) + [kw.get("top_k_index"), kw.get("top_k_weights")])[1:3]), with_kwargs=True)
    with torch.no_grad():
        block(torch.randn(1, 64, hidden, generator=torch.Generator().manual_seed(2)))
    logits, weights = affinity.router_outputs(seen["router"])
    index, applied = seen["applied"]
    assert torch.equal(weights, applied) and torch.equal(arch.router_topk(seen["router"]), index)
    kind = arch.cal.router_score
    if kind is None:
        assert arch_name == "PhimoeForCausalLM"
        for k in ("sigmoid", "softmax"):
            with pytest.raises(FqError, match="router_score declaration is not what its router does"):
                affinity.scores(logits, applied, index, k, arch_name)
        return
    s = affinity.scores(logits, applied, index, kind, arch_name)
    assert s.shape == logits.shape and bool((s > 0).all())
    other = {"sigmoid": "softmax", "softmax": "sigmoid"}[kind]
    with pytest.raises(FqError, match=rf"{arch_name}: the router's applied top-k weights .* not its {other} scores"):
        affinity.scores(logits, applied, index, other, arch_name)


def test_a_family_without_router_scores_or_a_routed_only_capture_is_refused_by_name(tmp_path, capsys):
    from fq.cli import main
    from fq.model.source_synth import synthetic_checkpoint, write_synthetic
    from fq.workflow.campaign import load_campaign
    from fq.workflow.campaign_calibration import check_weighting

    phimoe = families.by_name("phimoe")
    with pytest.raises(FqError, match=r"cfg: calibration.weighting affinity: PhimoeForCausalLM \(Phi-3.5-MoE\) has no "
                                      r"router score .*GlmMoeDsaForCausalLM"):
        check_weighting({"weighting": "affinity"}, phimoe, "cfg")
    assert check_weighting({}, phimoe, "cfg") == "none"  # unweighted: its chain as before
    with pytest.raises(FqError, match=r"calibration.weighting 'soft': expected one of none, affinity-down, affinity"):
        check_weighting({"weighting": "soft"}, families.by_name("glm4_moe"), "cfg")
    # fq plan / fq price: refused before a price is quoted
    d = write_synthetic(tmp_path / "phimoe", *synthetic_checkpoint(
        "mixtral", hidden=256, inter=128, n_experts=8, n_layers=2, model_type="phimoe",
        extra_config={"architectures": ["PhimoeForCausalLM"]}))
    recipe = tmp_path / "recipe.json"
    recipe.write_text(json.dumps({"format": "fq-cartridge/2", "name": "one",
                                  "nodes": [{"name": "k3", "kind": "base", "K": 3, "codebook": "mul1"}],
                                  "products": [{"name": "k3", "chain": ["k3"]}]}))
    args = ["plan", str(recipe), "--model", str(d), "--sizes", str(d / "sizes.json"), "--calibration", "4x64",
            "--allow-unloadable"]
    assert main(args + ["--weighting", "affinity-down"]) == 2
    assert "PhimoeForCausalLM (Phi-3.5-MoE) has no router score" in capsys.readouterr().err
    assert main(args) == 0
    # a campaign's config: refused when it is read, naming the setting
    cfg = {"campaign": "c", "out": str(tmp_path / "out"), "source": {"kind": "demo"}, "recipe": str(recipe),
           "block_size": 8, "windows_on_disk": 1, "calibration": {"capture": "routed-only", "weighting": "affinity"}}
    with pytest.raises(FqError, match="calibration.weighting affinity weights every token .* not routed-only"):
        load_campaign(cfg)


def test_fq_price_states_the_weighted_hessians_disk_memory_and_flops(tmp_path, capsys):
    from fq.cli import main
    from fq.model.source_synth import glm5_like, write_synthetic

    d = write_synthetic(tmp_path / "glm5", *glm5_like())
    recipe = Path(__file__).resolve().parents[1] / "recipes" / "glm52-k2k3-lean.json"
    outs = {}
    for w in affinity.WEIGHTINGS:
        assert main(["price", str(recipe), "--model", str(d), "--sizes", str(d / "sizes.json"), "--calibration",
                     "250x2048", "--weighting", w]) == 0
        outs[w] = capsys.readouterr().out
    moe = {w: re.search(r"MoE layers +75 jobs +([0-9.]+) PFLOP", out).group(1) for w, out in outs.items()}
    # affinity-down sums what none sums; affinity adds E · 2 · tokens · hidden² a layer (9.9 PFLOP at GLM-5)
    assert moe == {"none": "8.34", "affinity-down": "8.34", "affinity": "18.23"}
    assert "Hessians 2.2 GB per layer, 166.8 GB in all" in outs["none"]
    assert "capture memory: 8.9 GB of float64 sums per MoE layer job" in outs["none"]
    assert "all-experts capture, affinity-down weighting" in outs["affinity-down"]
    assert "Hessians 2.2 GB per layer" in outs["affinity-down"]
    assert "Hessians 21.6 GB per layer, 1.617 TB in all" in outs["affinity"]
    assert "capture memory: 86.2 GB" in outs["affinity"]


# -- a real campaign ------------------------------------------------------------------------------------------------
RECIPE = {"format": "fq-cartridge/2", "name": "aff", "description": "one K2 base",
          "nodes": [{"name": "a", "kind": "base", "K": 2, "codebook": "mul1"}],
          "products": [{"name": "a", "chain": ["a"]}]}
USAGE = str(Path(__file__).resolve().parents[1] / "fq" / "data" / "demo" / "usage.json")


def _statement(p: Path) -> dict:
    env = canonical.loads(p.with_name(p.name + ".intoto.jsonl").read_bytes())
    return canonical.loads(base64.b64decode(env["payload"]))


@pytest.mark.slow  # the chain is serial: five jobs of about 5 s each on 2 cores
def test_the_weighting_flows_through_a_campaign_into_its_hessian_binding_and_attestations(tmp_path):
    """Snakemake runs the calibration chain to layer 1 and one block's encode (one expert) of a campaign with
    weighting affinity: the Hessian, its binding and the fragment's quant_args say so. Set back to none, the campaign
    would rerun that encode (its rerun key changed), and the encode, as finalize, refuses the Hessian captured with
    the other weighting: the two settings never share a Hessian or a fragment."""
    from tests.test_workflow import smk, write_config

    from fq.workflow import calibration as wcal

    write_config(tmp_path, RECIPE, block_size=1, windows="1-2", usage=USAGE,
                 calibration={"text": None, "sha256": None, "rows": ROWS, "columns": COLS, "capture": "all-experts",
                              "weighting": "affinity"})
    out = tmp_path / "campaign"
    frag = out / "fragments" / "a" / "a-layer001-block000.safetensors"
    smk(tmp_path, str(frag.relative_to(tmp_path)))
    hessian, binding = out / "calibration" / "hessian-layer001.safetensors", out / "calibration" / \
        "hessian-layer001.bound.json"
    h = store.read_hessians(hessian)
    bound = json.loads(binding.read_text())
    assert h.weighting == bound["weighting"] == "affinity" and bound["sha256"] == h.sha256
    qa = _statement(frag)["predicate"]["quant_args"]
    assert qa["objective"] == store.OBJECTIVE_LDLQ
    assert qa["hessian"] == {"file": hessian.name, "sha256": h.sha256, "calibration": h.meta["calibration"],
                             "capture": "all-experts", "weighting": "affinity"}
    # the encode gave each expert's gate and up its own input Hessian, its down the weighted one
    from fq.workflow.encode import _Hessians

    hess = _Hessians({"path": str(hessian), "binding": str(binding), "weighting": "affinity"}, 1)
    assert torch.equal(hess.for_matrix(3, "gate"), h.input_for(3)) and not torch.equal(h.input_for(3), h.input())
    assert torch.equal(hess.for_matrix(3, "down"), h.down(3))

    cfg = json.loads((tmp_path / "config.yaml").read_text())
    cfg["calibration"]["weighting"] = "none"
    (tmp_path / "config.yaml").write_text(json.dumps(cfg))
    p = smk(tmp_path, "-n", str(frag.relative_to(tmp_path)))
    assert "Params have changed since last execution" in p.stdout + p.stderr
    with pytest.raises(FqError, match=rf"{binding}: layer 1's Hessian was captured with calibration.weighting "
                                      r"affinity, the campaign now says none"):
        wcal.bound_hessians(str(hessian), str(binding), 1, "none")
    assert wcal.bound_hessians(str(hessian), str(binding), 1, "affinity")[0].sha256 == h.sha256
