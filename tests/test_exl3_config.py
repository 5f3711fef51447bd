"""Issue 16, part 2: every published base is a directory an EXL3 runtime loads, and its config is checked.

- ``config.json`` of a base is the source's config plus ``quantization_config`` (``quant_method: "exl3"``, the
  converter's fields with fq's true values: K, codebook, head 16-bit, no calibration, out scales always);
  ``quantization_config.json`` beside it adds ``tensor_storage``, which is exactly the shards' tensors;
- both are declared derived in the base manifest (rule, params, inputs with their sha256) and recomputed byte for
  byte by ``fq verify`` and ``fq combine --base``: an edited field is one line naming the file and the field,
  whether the edit was left unsigned or an insider re-signed everything around it;
- the derivation is byte-reproducible and the publication statement lists the new files. What a real Snakemake
  campaign's finalize writes, and that finalizing twice publishes identical bytes, is checked on the Kimi-K2 FP8
  campaign of tests/test_family_campaigns.py.
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tests.kits import provkit
from fq.cli import main
from fq.core import canonical
from fq.errors import FqError
from fq.provenance.assembly import read_assembly, sign_assembly
from fq.provenance.attest import dsse
from fq.provenance.attest.statement import MANIFEST, STATEMENT_TYPE
from fq.provenance.combine import combine
from fq.provenance.exl3config import (QUANTIZATION_CONFIG, RULE_CONFIG, RULE_QUANTIZATION_CONFIG, VERSION,
                                      derive_config, derive_quantization_config, write_derived)
from fq.provenance.manifest import MANIFEST_NAME, list_files, read_base_manifest
from fq.provenance.publication import read_publication
from fq.provenance.verify import verify_path

NOW = provkit.NOW
MARKERS = {"mcg": 0xCBAC1FED, "mul1": 0x83DCD12D}


def block(bits: int, codebook: str) -> dict:
    return {"quant_method": "exl3", "version": VERSION, "bits": bits, "head_bits": 16,
            "calibration": {"rows": 0, "cols": 0}, "out_scales": "always", "codebook": codebook}


def storage_read_by_safetensors(base: Path) -> dict:
    """tensor_storage as the converter would list it, read with the safetensors library (not fq's reader)."""
    modules: dict = {}
    for shard in sorted(base.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                entry = modules.setdefault(name.rsplit(".", 1)[0], {"stored_tensors": {}})
                entry["stored_tensors"][name] = {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(),
                                                 "dtype": str(t.dtype)}
                if name.endswith((".mul1", ".mcg")):
                    entry[f"{name.rsplit('.', 1)[1]}_multiplier"] = t.view(torch.int32).item() & 0xFFFFFFFF
    for key, entry in modules.items():
        trellis = entry["stored_tensors"].get(f"{key}.trellis")
        if trellis is not None:
            entry.update(quant_format="exl3", bits_per_weight=trellis["shape"][-1] // 16)
    return modules


# -- a base as finalize writes it (provkit: base k2, K=2 mul1) ------------------------------------------------------
@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    return provkit.build_campaign(tmp_path_factory.mktemp("exl3cfg"))


@pytest.fixture
def c(pristine, tmp_path):
    """A private copy of the module's campaign (tests tamper with it); same key."""
    return provkit.private_copy(pristine, tmp_path / "c")


def test_config_json_carries_the_true_quantization_config(pristine):
    base = pristine.root / "base/k2"
    cfg = json.loads((base / "config.json").read_text())
    assert cfg["quantization_config"] == block(2, "mul1")
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == provkit.SOURCE_CONFIG
    assert json.loads((base / "source_config.json").read_text()) == provkit.SOURCE_CONFIG
    qc = json.loads((base / QUANTIZATION_CONFIG).read_text())
    assert {k: v for k, v in qc.items() if k != "tensor_storage"} == block(2, "mul1")


def test_tensor_storage_is_the_shards_tensors(pristine):
    base = pristine.root / "base/k2"
    storage = json.loads((base / QUANTIZATION_CONFIG).read_text())["tensor_storage"]
    assert storage == storage_read_by_safetensors(base)
    exl3 = {k for k, e in storage.items() if e.get("quant_format") == "exl3"}
    experts = {f"model.layers.{layer}.mlp.experts.{e}.{proj}" for layer in provkit.LAYERS
               for e in range(provkit.N_EXPERTS) for proj in provkit.DIMS}
    assert exl3 == experts  # every routed expert of the base, and nothing else
    for key in exl3:
        assert storage[key]["bits_per_weight"] == 2 and storage[key]["mul1_multiplier"] == MARKERS["mul1"]
    for key in set(storage) - exl3:  # kept 16-bit: stored tensors only, as the converter lists them
        assert set(storage[key]) == {"stored_tensors"}, key
    assert storage["model.embed_tokens"]["stored_tensors"]["model.embed_tokens.weight"] == {
        "shape": [64, 128], "n_bytes": 64 * 128 * 2, "dtype": "torch.bfloat16"}


def test_the_manifest_declares_both_files_derived(pristine):
    base = pristine.root / "base/k2"
    m = read_base_manifest(base, pristine.pub)
    sha = {n: d for n, (d, _) in m.files.items()}
    shards = sorted(n for n in m.files if n.endswith(".safetensors"))
    params = {"bits": 2, "codebook": "mul1"}
    assert list(m.derived) == [
        {"name": "config.json", "rule": RULE_CONFIG, "params": params,
         "from": [{"name": "source_config.json", "sha256": sha["source_config.json"]}]},
        {"name": QUANTIZATION_CONFIG, "rule": RULE_QUANTIZATION_CONFIG, "params": params,
         "from": [{"name": n, "sha256": sha[n]} for n in shards]}]
    for n in ("config.json", QUANTIZATION_CONFIG, "source_config.json"):
        assert sha[n] == hashlib.sha256((base / n).read_bytes()).hexdigest()


def test_the_publication_lists_the_new_files(pristine):
    stmt = read_publication(pristine.root, pristine.pub)
    for n in ("config.json", QUANTIZATION_CONFIG, "source_config.json"):
        assert stmt.files[f"base/k2/{n}"] == hashlib.sha256((pristine.root / "base/k2" / n).read_bytes()).hexdigest()


def test_the_derivation_is_byte_reproducible(pristine, tmp_path):
    base = pristine.root / "base/k2"
    shards = sorted(p.name for p in base.glob("*.safetensors"))
    config, qc = (base / "config.json").read_bytes(), (base / QUANTIZATION_CONFIG).read_bytes()
    assert derive_config((base / "source_config.json").read_bytes(), 2, "mul1") == config
    assert config == canonical.pretty({**provkit.SOURCE_CONFIG, "quantization_config": block(2, "mul1")}).encode()
    assert qc == canonical.dumps(json.loads(qc)) + b"\n"  # canonical JSON, one final newline
    # the same inputs elsewhere (another path, fresh files) give the same bytes; a second write changes nothing
    other = tmp_path / "elsewhere"
    other.mkdir()
    for n in shards + ["source_config.json"]:
        shutil.copyfile(base / n, other / n)
    assert derive_quantization_config(other, shards, 2, "mul1") == qc
    assert write_derived(other, bits=2, codebook="mul1") == write_derived(other, bits=2, codebook="mul1")
    assert (other / "config.json").read_bytes() == config and (other / QUANTIZATION_CONFIG).read_bytes() == qc
    mtime = (other / QUANTIZATION_CONFIG).stat().st_mtime_ns
    write_derived(other, bits=2, codebook="mul1")
    assert (other / QUANTIZATION_CONFIG).stat().st_mtime_ns == mtime


def _underived(pristine, to: Path) -> Path:
    """The pristine base's shards and source config, without its derived files, in ``to``."""
    to.mkdir()
    for p in (pristine.root / "base/k2").iterdir():
        if p.suffix == ".safetensors" or p.name == "source_config.json":
            shutil.copyfile(p, to / p.name)
    return to


def test_an_experts_only_base_states_its_bits_over_the_whole_model(pristine, tmp_path):
    """What finalize writes now (whole_model_bits): ``bits`` over every linear but the embeddings, the head and the
    routers (the routed experts at K with their scales, the skeleton's 16-bit linears), as exllamav3's converter
    states it, ``expert_bits`` K; declared as the model_bits param, which the rule recomputes from the shards."""
    from fq.errors import FqError
    from fq.provenance.exl3config import storage_bits, tensor_storage

    other = _underived(pristine, tmp_path / "whole-bits")
    shards = sorted(p.name for p in other.glob("*.safetensors"))
    out = write_derived(other, bits=2, codebook="mul1", whole_model_bits=True)
    want = storage_bits(tensor_storage(other, shards, 2, "mul1", None))
    assert [d["params"] for d in out] == [{"bits": 2, "codebook": "mul1", "model_bits": want}] * 2
    for q in (json.loads((other / "config.json").read_bytes())["quantization_config"],
              json.loads((other / QUANTIZATION_CONFIG).read_bytes())):
        assert q["bits"] == want and q["expert_bits"] == 2 and "linear_bits" not in q and q["head_bits"] == 16
    assert 2 < want < 16  # the experts' scales and any 16-bit linear of the skeleton count
    with pytest.raises(FqError, match=f"the shards hold {want} bits per weight"):
        derive_quantization_config(other, shards, 2, "mul1", model_bits=round(want + 0.5, 4))


def test_a_calibrated_base_states_its_calibration_rows_and_columns(pristine, tmp_path):
    """A calibrated campaign's bases say how many calibration rows and columns their Hessians came from, as the
    converter's ``calibration`` block does; the manifest declares it as a param of both rules, which a consumer
    re-derives; a weight-only base keeps {rows: 0, cols: 0} and declares no such param."""
    from fq.errors import FqError
    from fq.provenance.exl3config import quantization_block, specs

    other = _underived(pristine, tmp_path / "calibrated")
    cal = {"rows": 250, "cols": 2048}
    out = write_derived(other, bits=2, codebook="mul1", calibration=cal)
    assert [d["params"] for d in out] == [{"bits": 2, "codebook": "mul1", "calibration": cal}] * 2
    assert json.loads((other / "config.json").read_bytes())["quantization_config"]["calibration"] == cal
    assert json.loads((other / QUANTIZATION_CONFIG).read_bytes())["calibration"] == cal
    assert quantization_block(2, "mul1")["calibration"] == {"rows": 0, "cols": 0}
    assert "calibration" not in specs(2, "mul1")[0]["params"]
    for bad in ({"rows": 0, "cols": 2048}, {"rows": 4}, {"rows": 4, "cols": 64, "seed": 1}, {"rows": 1.5, "cols": 2}):
        with pytest.raises(FqError, match="calibration .*expected"):
            specs(2, "mul1", bad)


def test_a_source_quantization_is_replaced_only_when_fq_reads_it():
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    got = json.loads(derive_config(json.dumps({"model_type": "deepseek_v3", "quantization_config": fp8}).encode(),
                                   2, "mul1", "src"))
    assert got["quantization_config"]["quant_method"] == "exl3" and got["model_type"] == "deepseek_v3"
    with pytest.raises(FqError, match=r"quantization_config.quant_method 'awq' is not a source format fq reads"):
        derive_config(json.dumps({"quantization_config": {"quant_method": "awq"}}).encode(), 2, "mul1", "src")
    with pytest.raises(FqError, match=r"weight_block_size: expected"):
        derive_config(json.dumps({"quantization_config": {"quant_method": "fp8"}}).encode(), 2, "mul1", "src")


def test_keys_exllamav3_reads_under_another_spelling_are_stated():
    """Qwen3-MoE as transformers 5.x saves it says num_local_experts; exllamav3's Qwen3MoeConfig requires num_experts."""
    src = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_local_experts": 128}
    got = json.loads(derive_config(json.dumps(src).encode(), 3, "mul1", "src"))
    assert got["num_experts"] == 128 and got["num_local_experts"] == 128
    src["num_experts"] = 128  # the authors' spelling: nothing to add
    assert set(json.loads(derive_config(json.dumps(src).encode(), 3, "mul1", "src"))) == set(src) | {"quantization_config"}
    with pytest.raises(FqError, match="architecture 'LlamaForCausalLM' is not a model family fq reads"):
        derive_config(json.dumps({"architectures": ["LlamaForCausalLM"]}).encode(), 3, "mul1", "src")


# -- tampering -----------------------------------------------------------------------------------------------------
def _rewrite(path: Path, edit) -> None:
    """Edit one field and write the file back in its own format, so the field is the only difference."""
    doc = json.loads(path.read_text())
    edit(doc)
    if path.name == "config.json":
        path.write_text(canonical.pretty(doc))
    else:
        path.write_bytes(canonical.dumps(doc) + b"\n")


EXPERT = "model.layers.1.mlp.experts.0.down_proj"
EDITS = {  # name: (file, edit, the field and values the one problem line names)
    "config.json: bits changed": (
        "config.json", lambda d: d["quantization_config"].update(bits=3),
        r"quantization_config\.bits is 3, the rule derives 2"),
    "config.json: field added": (
        "config.json", lambda d: d["quantization_config"].update(group_size=128),
        r"quantization_config\.group_size is present \(128\), the rule derives no such field"),
    "config.json: head claimed quantized": (
        "config.json", lambda d: d["quantization_config"].update(head_bits=6),
        r"quantization_config\.head_bits is 6, the rule derives 16"),
    "quantization_config.json: bits changed": (
        QUANTIZATION_CONFIG, lambda d: d.update(bits=3), r"bits is 3, the rule derives 2"),
    "quantization_config.json: field added": (
        QUANTIZATION_CONFIG, lambda d: d.update(group_size=128),
        r"group_size is present \(128\), the rule derives no such field"),
    "quantization_config.json: a tensor's dtype": (
        QUANTIZATION_CONFIG,
        lambda d: d["tensor_storage"][EXPERT]["stored_tensors"][f"{EXPERT}.suh"].update(dtype="torch.bfloat16"),
        re.escape(f'tensor_storage["{EXPERT}"].stored_tensors["{EXPERT}.suh"].dtype is "torch.bfloat16", '
                  'the rule derives "torch.float16"')),
    "quantization_config.json: a 16-bit module claimed EXL3": (
        QUANTIZATION_CONFIG, lambda d: d["tensor_storage"]["model.norm"].update(quant_format="exl3"),
        re.escape('tensor_storage["model.norm"].quant_format is present ("exl3"), the rule derives no such field')),
    "quantization_config.json: a module left out": (
        QUANTIZATION_CONFIG, lambda d: d["tensor_storage"].pop(EXPERT),
        re.escape(f'tensor_storage["{EXPERT}"] is missing, the rule derives')),
}


def _manifest_statement(base: Path) -> dict:
    env = canonical.loads((base / MANIFEST_NAME).read_bytes())
    return canonical.loads(base64.b64decode(env["payload"]))


def insider_resign_base(c, edit_predicate=None) -> None:
    """Re-sign base k2's manifest over its files as they are now, with the campaign's own key and none of the
    producer's checks (derived declarations kept, their input digests refreshed; ``edit_predicate`` may change
    more), then every plan pinning the manifest and the publication statement."""
    base = c.root / "base/k2"
    st = _manifest_statement(base)
    pred = st["predicate"]
    digest = {n: hashlib.sha256((base / n).read_bytes()).hexdigest() for n in list_files(base)}
    pred["files"] = [{"name": n, "size": (base / n).stat().st_size} for n in digest]
    for d in pred.get("derived", []):
        d["from"] = [{"name": f["name"], "sha256": digest[f["name"]]} for f in d["from"]]
    if edit_predicate:
        edit_predicate(pred)
    st["subject"] = [{"name": n, "digest": {"sha256": d}} for n, d in digest.items()]
    line = dsse.envelope_line(dsse.sign(canonical.dumps(st), c.priv))
    (base / MANIFEST_NAME).write_bytes(line)
    for plan_path in c.plans.values():
        plan = read_assembly(plan_path, c.pub, now=NOW).predicate
        plan["base"]["manifest"]["sha256"] = hashlib.sha256(line).hexdigest()
        plan_path.write_bytes(sign_assembly(plan, c.priv))
    # the publication statement, signed over the tree as it is now (without build_publication's checks)
    pub_path = c.root / "publication.intoto.jsonl"
    st = canonical.loads(base64.b64decode(canonical.loads(pub_path.read_bytes())["payload"]))
    files = sorted(p.relative_to(c.root).as_posix() for p in c.root.rglob("*") if p.is_file() and p != pub_path)
    sha = {n: hashlib.sha256((c.root / n).read_bytes()).hexdigest() for n in files}
    st["subject"] = [{"name": n, "digest": {"sha256": sha[n]}} for n in files]
    st["predicate"]["bases"]["k2"]["manifest_sha256"] = sha[f"base/k2/{MANIFEST_NAME}"]
    for entry in st["predicate"]["products"].values():
        entry["sha256"] = sha[entry["file"]]
    pub_path.write_bytes(dsse.envelope_line(dsse.sign(canonical.dumps(st), c.priv)))


def refusals(c, tmp_path, capsys) -> tuple[list[str], str, str, str]:
    """(fq verify's problems for the tree, combine --base's error, and the two CLI stderr lines)."""
    base = c.root / "base/k2"
    problems = verify_path(c.root, c.pub, now=NOW).problems
    with pytest.raises(FqError) as e:
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, base_dir=base, experts="1:0-3")
    assert not (tmp_path / "a.safetensors").exists()
    capsys.readouterr()
    assert main(["verify", str(c.root), "--key", str(c.pub_path)]) == 1
    verify_err = capsys.readouterr().err
    assert main(["combine", "--key", str(c.pub_path), "--plan", str(c.plans["k2r1"]), "--base", str(base),
                 "--out", str(tmp_path / "b.safetensors"), "--no-state"]) == 2
    combine_err = capsys.readouterr().err
    return problems, str(e.value), verify_err, combine_err


@pytest.mark.parametrize("insider", [False, True], ids=["unsigned edit", "insider re-signed"])
@pytest.mark.parametrize("edit", list(EDITS))
def test_an_edited_config_is_refused_by_verify_and_combine_base(c, edit, insider, tmp_path, capsys):
    name, change, field = EDITS[edit]
    base = c.root / "base/k2"
    _rewrite(base / name, change)
    if insider:
        insider_resign_base(c)
        assert read_base_manifest(base, c.pub).files[name][0] == hashlib.sha256((base / name).read_bytes()).hexdigest()
    line = re.escape(f"{base}/{name}: ") + field + r".* \(rule fq-exl3-[a-z-]+/1; a derived file must be its rule's"
    problems, combine_msg, verify_err, combine_err = refusals(c, tmp_path, capsys)
    assert len(problems) == 1 and re.match(line, problems[0]), problems
    assert re.match(line, combine_msg) and "\n" not in combine_msg, combine_msg  # no option given: none named
    assert re.search(line, verify_err), verify_err
    assert re.search(line, combine_err) and combine_err.count("\n") == 1, combine_err


def test_params_that_are_not_the_tensors_are_refused(c, tmp_path, capsys):
    """An insider declares K=3 for a K=2 base and writes config.json to match: the quantization_config rule
    reads the tensors and refuses it, naming the module."""
    base = c.root / "base/k2"
    (base / "config.json").write_bytes(derive_config((base / "source_config.json").read_bytes(), 3, "mul1"))
    _rewrite(base / QUANTIZATION_CONFIG, lambda d: d.update(bits=3))

    def k3(pred):
        for d in pred["derived"]:
            d["params"]["bits"] = 3
    insider_resign_base(c, k3)
    problems, combine_msg, _, _ = refusals(c, tmp_path, capsys)
    want = (f"{base}/{QUANTIZATION_CONFIG}: cannot be derived by rule {RULE_QUANTIZATION_CONFIG}: "
            f"{base}/k2-layer001-block000.safetensors: model.layers.1.mlp.experts.0.down_proj: an EXL3 module at K=2; "
            "this base's quantization_config says bits 3")
    assert problems == [want]
    assert combine_msg == want  # the Python API was given no --base option: none is named


@pytest.mark.parametrize("case", ["no derived files", "different params", "stale input digest"])
def test_a_manifest_that_misdeclares_its_derived_files_is_refused(c, case, tmp_path, capsys):
    base = c.root / "base/k2"

    def edit(pred):
        if case == "no derived files":
            del pred["derived"]
        elif case == "different params":
            pred["derived"][0]["params"]["bits"] = 3
        else:
            pred["derived"][0]["from"][0]["sha256"] = "0" * 64
    insider_resign_base(c, edit)
    want = {"no derived files": r"'derived' is a required property",
            "different params": r"derived files declare different params \(config\.json: \{\"bits\":3",
            "stale input digest": r"derived config\.json: input source_config\.json sha256 0000000000000000… is not "
                                  r"the listed"}[case]
    problems = verify_path(c.root, c.pub, now=NOW).problems
    assert any(re.search(re.escape(f"{base}/{MANIFEST_NAME}") + ".*" + want, p) for p in problems), problems
    with pytest.raises(FqError, match=want):
        combine(c.plans["k2r1"], c.pub, tmp_path / "a.safetensors", now=NOW, base_dir=base, experts="1:0-3")


def test_an_untouched_base_passes_combine_base(pristine, tmp_path):
    combine(pristine.plans["k2r1"], pristine.pub, tmp_path / "a.safetensors", now=NOW,
            base_dir=pristine.root / "base/k2", experts="1:0-3")
    assert (tmp_path / "a.safetensors").is_file()
    assert verify_path(pristine.root, pristine.pub, now=NOW).ok
