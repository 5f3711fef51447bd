"""The model card of a published base: ``README.md``, a derived file (rule ``fq-model-card/1``).

A user who finds a base on the Hub reads its README first. Finalize writes one per published base, in the Hub's
model-card format (YAML front matter: ``base_model``, ``base_model_relation``, ``library_name: exllamav3``,
``pipeline_tag``, ``tags``, ``quantized_by``; then Markdown): what the source is, the recipe and the allocation (K
per class, per layer where it differs), the bytes, where the measured quality is, how to load it (exllamav3,
TabbyAPI), how to verify it, and how the cartridges (stages) published beside it are served.

It is *derived*, like ``config.json``: the base manifest declares it with its rule, inputs and params, and every
consumer of the manifest recomputes it byte for byte (``fq.provenance.derived``), so a card that says anything
else than its inputs and the signed params is refused. Inputs: ``source_config.json`` (the architecture, the
family, the layers) and ``quantization_config.json`` (K per module, codebook, calibration, stored bytes: what the
tensors are, checked against them by its own rule). Params (signed in the manifest; ``card_params``):

    base_model   the source's repo id or path (the campaign's source)
    revision     the source's revision
    node         the base node
    campaign     the campaign's name
    quantized_by the config's model_card.quantized_by, else "fq"
    signer       the Ed25519 fingerprint the campaign signs with
    description  the recipe node's description, or null
    budget       a budgeted base's bits budget (recipe ``bits``), or null
    eval         how the campaign's eval job measures it ({text, sha256, tokens, seq_len}), or null: no eval
    model_signing  the sha256 hint of the OpenSSF model-signing public key whose model.sig covers the directory,
                 or null

The quality numbers themselves are not in the card: the eval job runs after finalize, on the published tree (its
measurements are not the signer's claims: docs/eval.md); the card says how they were measured and where they are.
No clock, path or host goes in: the same inputs and params give the same bytes.

    card_params(...) -> dict;  check_params(params, where);  render(source_config, quantization_config, params) -> bytes
    write_card(base_dir, params) -> spec                     # producer: README.md, and what the manifest declares
    CardRule: the rule (inputs, derive, explain) the derived-file registry holds (fq.provenance.derived)
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

from fq.core import atomic, canonical
from fq.core.safepath import open_regular
from fq.core.targets import EXLLAMAV3
from fq.errors import FqError
from fq.model import families
from fq.provenance.exl3config import MAX_DERIVED_BYTES, QUANTIZATION_CONFIG, SOURCE_CONFIG, Rule

README = "README.md"
RULE = "fq-model-card/1"
MAX_CARD_BYTES = 1 << 20  # a card lists classes and layers, never modules: a few kB
SIGNATURE = "model.sig"  # the OpenSSF model-signing bundle beside the card (fq.provenance.model_signing)
_PARAMS = ("base_model", "revision", "node", "campaign", "quantized_by", "signer", "description", "budget", "eval",
           "model_signing")
_HEX64 = re.compile(r"[0-9a-f]{64}")


def card_params(*, base_model: str, revision: str | None, node: str, campaign: str, signer: str,
                quantized_by: str | None = None, description: str | None = None, budget: float | None = None,
                eval: dict | None = None, model_signing: str | None = None) -> dict:
    params = {"base_model": base_model, "revision": revision, "node": node, "campaign": campaign,
              "quantized_by": quantized_by or "fq", "signer": signer, "description": description,
              "budget": budget, "eval": eval, "model_signing": model_signing}
    check_params(params, "model card params")
    return params


def _line(value, where: str, field: str, optional: bool = False, limit: int = 200) -> None:
    """A one-line string (it goes into YAML and Markdown as is): no control characters, bounded."""
    if value is None and optional:
        return
    if not isinstance(value, str) or not value or len(value) > limit or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise FqError(f"{where}: {field} {value!r}: expected a one-line string of 1 to {limit} characters"
                      f"{' or null' if optional else ''}")


def check_params(params: dict, where: str) -> None:
    if not isinstance(params, dict) or sorted(params) != sorted(_PARAMS):
        got = sorted(params) if isinstance(params, dict) else params
        raise FqError(f"{where}: params {got!r}: expected exactly {', '.join(_PARAMS)} (rule {RULE})")
    for field in ("base_model", "node", "campaign", "quantized_by"):
        _line(params[field], where, field)
    _line(params["revision"], where, "revision", optional=True)
    _line(params["description"], where, "description", optional=True, limit=2000)
    for field in ("signer", "model_signing"):
        v = params[field]
        if not (v is None and field == "model_signing") and not (isinstance(v, str) and _HEX64.fullmatch(v)):
            raise FqError(f"{where}: {field} {v!r}: expected 64 lowercase hex digits (a sha256)"
                          f"{' or null' if field == 'model_signing' else ''}")
    b = params["budget"]
    if b is not None and (isinstance(b, bool) or not isinstance(b, (int, float)) or not 0 < b <= 16):
        raise FqError(f"{where}: budget {b!r}: expected a budgeted base's bits per weight (0 < B <= 16) or null")
    ev = params["eval"]
    if ev is not None:
        ok = isinstance(ev, dict) and sorted(ev) == ["seq_len", "sha256", "text", "tokens"] and \
            all(type(ev[k]) is int and ev[k] >= 2 for k in ("tokens", "seq_len")) and \
            isinstance(ev["sha256"], str) and _HEX64.fullmatch(ev["sha256"])
        if not ok:
            raise FqError(f"{where}: eval {ev!r}: expected {{text, sha256, tokens, seq_len}} (tokens and seq_len "
                          "integers >= 2) or null")
        _line(ev["text"], where, "eval.text")


# -- reading the inputs -----------------------------------------------------------------------------------------

def _human(n: int) -> str:
    for div, unit in ((10**12, "T"), (10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= div:
            return f"{n / div:.3g}{unit}"
    return str(n)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n < (1 << 30) else f"{n / (1 << 30):.2f} GiB"


_SCALE = re.compile(r"(\.suh|\.svh|\.mcg|\.mul1|_scale_inv|\.weight_scale|\.scales)$")


def _parameters(storage: dict) -> int:
    """Parameters as stored: an EXL3 linear in x out (its suh and svh lengths: 128-aligned), any other tensor its
    elements, leaving out EXL3 scales, codebook markers and FP8 block scales (not parameters of the model)."""
    n = 0
    for key, entry in storage.items():
        stored = entry["stored_tensors"]
        if entry.get("quant_format") == "exl3":
            n += stored[f"{key}.suh"]["shape"][0] * stored[f"{key}.svh"]["shape"][0]
            continue
        for name, t in stored.items():
            if not _SCALE.search(name):
                size = 1
                for d in t["shape"]:
                    size *= d
                n += size
    return n


def _per_layer(value) -> dict | None:
    """{layer: K} of a K given per layer (a budgeted base's allocation), None for one K."""
    if isinstance(value, dict) and value and all(k.isdigit() for k in value):
        return {int(k): v for k, v in value.items()}
    return None


def _k(value) -> str:
    if isinstance(value, dict):  # {gate, up, down: K}
        return " / ".join(f"{p} K{value[p]}" for p in ("gate", "up", "down"))
    return f"K{value}"


def _allocation(block: dict, moe_layers: list[int]) -> list[str]:
    """The K per class, and a table per layer where a class's K differs by layer (a budgeted base)."""
    linears = block.get("linear_bits", {})
    head = linears.get("head", block.get("head_bits", 16))
    rows = [("routed experts", block.get("expert_bits", block["bits"]))] + \
        [(cls, linears.get(cls)) for cls in ("attention", "shared", "dense")] + \
        [("head (lm_head)", head.get("head") if isinstance(head, dict) else head)]
    out = ["| class | K (bits per weight of its trellis) |", "| --- | --- |"]
    for cls, v in rows:
        what = "not EXL3: kept as the source stores it" if v is None or v == 16 else \
            "per layer (below)" if _per_layer(v) is not None else _k(v)
        out.append(f"| {cls} | {what} |")
    varying = {cls: _per_layer(v) for cls, v in rows if _per_layer(v) is not None}
    if varying:
        layers = sorted({layer for per in varying.values() for layer in per})
        out += ["", "K per layer (the allocation: one K per unit, a unit being a class of a layer, the routed "
                "experts' gate, up and down apart, as exllamav3 loads them):", "",
                "| layer | " + " | ".join(varying) + " |", "| --- |" + " --- |" * len(varying)]
        for layer in layers:
            cells = [_k(per[layer]) if layer in per else "-" for per in varying.values()]
            out.append(f"| {layer}{' (MoE)' if layer in moe_layers else ''} | " + " | ".join(cells) + " |")
    return out


def render(source: dict, qconfig: dict, params: dict, where: str = README) -> bytes:
    """The card's bytes from the source config, the quantization config and the params (module docstring)."""
    check_params(params, where)
    if not isinstance(qconfig, dict) or not isinstance(qconfig.get("tensor_storage"), dict):
        raise FqError(f"{where}: {QUANTIZATION_CONFIG} has no tensor_storage")
    family = families.for_config(source, f"{where}: {SOURCE_CONFIG}")
    text = family.text_view(source, f"{where}: {SOURCE_CONFIG}")
    n_layers = text.get("num_hidden_layers")
    moe_layers = family.moe_layers(text, n_layers, SOURCE_CONFIG) if type(n_layers) is int else []
    storage = qconfig["tensor_storage"]
    stored = sum(t["n_bytes"] for e in storage.values() for t in e["stored_tensors"].values())
    exl3 = sum(1 for e in storage.values() if e.get("quant_format") == "exl3")
    n_params = _parameters(storage)
    bpw = qconfig["bits"]
    arch = (source.get("architectures") or ["?"])[0]
    p = params
    base, node = p["base_model"], p["node"]
    where_dir = f"base/{node}"
    rev = f" at revision `{p['revision']}`" if p["revision"] else ""
    q = json.dumps  # YAML accepts JSON strings: quoting never depends on the value
    lines = ["---", f"base_model: {q(base)}", "base_model_relation: quantized", "library_name: exllamav3",
             "pipeline_tag: text-generation", f"quantized_by: {q(p['quantized_by'])}", "tags:",
             *[f"- {t}" for t in ("exl3", "quantized", "moe", "fq")], "---", "",
             f"# {node}: {base}, EXL3 at {bpw:g} bits per weight", "",
             f"An EXL3 quantization of `{base}`{rev}, published and signed by fq (base node `{node}` of campaign "
             f"`{p['campaign']}`). This directory is a model exllamav3 {EXLLAMAV3} loads as it is. Paths below are "
             f"relative to the publication's root, where this directory is `{where_dir}`.", ""]
    if p["description"]:
        lines += [f"Recipe: {p['description']}", ""]
    lines += ["## Source", "", "| | |", "| --- | --- |", f"| model | `{base}`{rev} |",
              f"| architecture | `{arch}` (model_type `{source.get('model_type', '?')}`; fq family: {family.title}) |",
              f"| parameters | {_human(n_params)} ({n_params:,} as stored: EXL3 linears at their 128-aligned size) |"]
    if type(n_layers) is int:
        moe = f"; MoE layers: {len(moe_layers)}" if moe_layers else ""
        try:
            moe += f", {family.n_experts(text, SOURCE_CONFIG)} routed experts each" if moe_layers else ""
        except FqError:
            pass
        lines.append(f"| layers | {n_layers}{moe} |")
    cal = qconfig.get("calibration") or {}
    objective = (f"with LDLQ against Hessians of calibration activations ({cal['rows']} rows x {cal['cols']} tokens)"
                 if cal.get("rows") else "weight-only (no calibration data)")
    lines += ["", "## Recipe and allocation", "",
              f"Codebook `{qconfig.get('codebook')}`; encoded {objective}; output-channel scales "
              f"{qconfig.get('out_scales', 'always')}."]
    if p["budget"] is not None:
        lines.append(f"A budgeted base: {p['budget']:g} bits per weight, K per unit from the campaign's measured "
                     "allocation (each unit's sensitivity measured on the source, then the K per unit of least "
                     "predicted KL under the budget).")
    lines += ["", *_allocation(qconfig, moe_layers), "",
              "## Size", "", "| | |", "| --- | --- |",
              f"| stored tensor bytes | {stored:,} ({_mib(stored)}) |",
              f"| bits per weight | {bpw:g} (over every linear but the embeddings, the head and the routers: "
              "`quantization_config.bits`) |",
              f"| EXL3 modules | {exl3:,} |", "", "## Measured quality", ""]
    ev = p["eval"]
    if ev:
        windows = ev["tokens"] // ev["seq_len"]
        lines += [f"The campaign measures this base with `fq eval` after publication, against the source: KL(source "
                  f"|| this base) of the next-token distributions, top-1 agreement and perplexity, on `{ev['text']}` "
                  f"(sha256 `{ev['sha256']}`): its first {ev['tokens']} tokens in windows of {ev['seq_len']}, "
                  f"{windows * (ev['seq_len'] - 1):,} next-token positions when the text has that many tokens.",
                  "",
                  f"The numbers are in the campaign's `eval/eval.json` and `eval/eval.tsv` (row `{node}`), not in this "
                  "signed card: they are measured after this directory is signed, and they are measurements anyone "
                  "can repeat, not claims of the signer. To measure it yourself:"]
    else:
        lines += ["This campaign did not run `fq eval`, so this card states no quality numbers. To measure KL, top-1 "
                  "and perplexity against the source:"]
    lines += ["", "```sh", "fq eval . --key signer.pub --source SOURCE_DIR --text heldout.txt --out eval.json",
              "```", "", "## Load it", "", f"With exllamav3 ({EXLLAMAV3}):", "", "```python",
              "from exllamav3 import Cache, Config, Generator, Model, Tokenizer", "",
              f'config = Config.from_directory("{where_dir}")', "model = Model.from_config(config)",
              "cache = Cache(model, max_num_tokens=8192)", "model.load()",
              "tokenizer = Tokenizer.from_config(config)",
              "generator = Generator(model=model, cache=cache, tokenizer=tokenizer)",
              'print(generator.generate(prompt="Hello", max_new_tokens=64))', "```", "",
              "With TabbyAPI, put the directory in its models directory and name it in `config.yml`:", "",
              "```yaml", "model:", "  model_dir: models", f"  model_name: {node}", "```", "",
              "exllamav3 reads the files lazily, as they are when it loads them: verify first.", "",
              "## Verify it", "",
              f"Every file here is listed with its sha256 in `fq-manifest.intoto.jsonl`, signed with Ed25519 by the "
              f"key of fingerprint `{p['signer']}`; this card is recomputed from the files and the signed params "
              "by every check. With that key (`signer.pub`, from the publisher):", "", "```sh",
              "fq verify . --key signer.pub  # the whole publication",
              f"fq verify {where_dir}/fq-manifest.intoto.jsonl --key signer.pub  # this directory alone", "```"]
    if p["model_signing"]:
        lines += ["", f"`{SIGNATURE}` signs the same files in the OpenSSF model-signing format (a Sigstore bundle, "
                  f"ECDSA key whose PEM's sha256 is `{p['model_signing']}`), which the standard tool verifies:", "",
                  "```sh", f"model_signing verify key {where_dir} --signature {where_dir}/{SIGNATURE} --public_key "
                  "model-signing.pub", "```"]
    lines += ["", "## Cartridges", "",
              "Residual stages that upgrade this base (all experts, or chosen ones, to more bits) are published "
              "beside it under `stages/`, each product named by a signed plan in `assemblies/` whose base is this "
              "directory. exllamav3 reads one trellis per linear, so a chain runs through fq's runtime, which sums "
              "its stages (exllamav3 on CUDA, or the CPU):", "", "```sh",
              "fq generate . PRODUCT --key signer.pub --prompt \"Hello\"",
              f"fq combine --key signer.pub --plan assemblies/PRODUCT.assembly.intoto.jsonl --base {where_dir} "
              "--out adapter.safetensors", "```", ""]
    data = "\n".join(lines).encode("utf-8")
    if len(data) > MAX_CARD_BYTES:
        raise FqError(f"{where}: {len(data)} bytes, more than a model card holds ({MAX_CARD_BYTES})")
    return data


class CardRule(Rule):
    """``README.md`` from ``source_config.json`` and ``quantization_config.json`` (module docstring)."""

    rule = RULE

    def inputs(self, listed):
        return [SOURCE_CONFIG, QUANTIZATION_CONFIG]

    def derive(self, base_dir, inputs, params):
        base_dir = Path(base_dir)
        docs = []
        for name in (SOURCE_CONFIG, QUANTIZATION_CONFIG):
            where = f"{base_dir}/{name}"
            with open_regular(base_dir, name, where) as fh:
                doc = canonical.loads(fh.read(MAX_DERIVED_BYTES + 1), where)
            if not isinstance(doc, dict):
                raise FqError(f"{where}: expected a JSON object")
            docs.append(doc)
        return render(docs[0], docs[1], params, f"{base_dir}/{README}")

    def explain(self, want: bytes, got: bytes) -> str:
        """The first line that differs, for a refusal."""
        a, b = want.decode("utf-8", "replace").split("\n"), got.decode("utf-8", "replace").split("\n")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                return f"line {i + 1} is {y[:60]!r}, the rule derives {x[:60]!r}"
        return f"it has {len(b)} lines, the rule derives {len(a)}"


CARD_RULE = CardRule(README, MAX_CARD_BYTES, json=False)


def write_card(base_dir: str | os.PathLike, params: dict) -> dict:
    """Producer: ``README.md`` of ``base_dir`` (after its quantization_config.json), written when its bytes differ
    (finalize is idempotent); returns the spec its manifest declares."""
    data = CARD_RULE.derive(Path(base_dir), CARD_RULE.inputs([]), params)
    path = Path(base_dir) / README
    if path.is_symlink() or not path.is_file() or path.read_bytes() != data:
        atomic.write_bytes(path, data)
    return {"name": README, "rule": RULE, "params": dict(params)}
