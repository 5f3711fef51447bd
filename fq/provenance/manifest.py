"""The base manifest: one signed line naming every file of a published base with its sha256.

``BASE_DIR/fq-manifest.intoto.jsonl`` is a DSSE envelope around an in-toto Statement whose subjects
are every file of the base directory (skeleton shards, expert fragments, their attestations,
config/tokenizer files), predicateType ``https://fq.dev/base-manifest/v1``. The *base manifest
digest* that plans pin is the sha256 of this line's bytes; ``fq combine --base DIR`` compares it with
the base actually on disk.

    write_base_manifest(base_dir, node=, campaign=, key=, derived=) -> (path, sha256)
    read_base_manifest(base_dir, public_key, campaign=None, sha256=None) -> BaseManifest   # digest pin, then signature
    check_base_files(base_dir, manifest, public_key=None) -> list[str]  # re-hash; strays and misses
    verify_base(base_dir, public_key, campaign=None, sha256=None) -> VerifiedBase     # all of it, or raise

``check_base_files`` is the one check of a base directory against its manifest (``fq verify`` of a tree
or a manifest, ``fq combine --base``): every file present must be listed, every listed file present
with the listed sha256 and size; each file is read once, streaming (8 MiB chunks). Given the public
key, a listed shard whose attestation is listed too is verified against it in that same pass
(``verify_shard``: header, per-expert/per-tensor ranges, finite scales), and its digest compared with
the manifest's. ``verify_base`` is what ``--base`` runs: the manifest (its digest first when a plan
pins it), then ``check_base_files`` with the key; any problem refuses the checkpoint.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fq.core import atomic
from fq.core.canonical import dumps as canonical_dumps, sha256_hex
from fq.core.safepath import check_name, open_regular, read_regular, sha256_stream
from fq.errors import FqError
from fq.provenance.attest import dsse
from fq.provenance.attest.campaign import require_same
from fq.provenance.attest.fragment import verify_shard
from fq.provenance.attest.keys import fingerprint
from fq.provenance.attest.statement import MANIFEST, parse_statement, statement
from fq.provenance.derived import DERIVED_ORDER, OPTIONAL, RULES, check_derived, rule_inputs
from fq.provenance.exl3config import CONFIG, QUANTIZATION_CONFIG, TENSOR_OUTPUTS, TENSOR_RULES
from fq.provenance.model_card import README, RULE as RULE_CARD, check_params as check_card_params
from fq.provenance.model_sig import SIGNATURE, check_signature
from fq.model.shards import Header, read_header
from fq.provenance.fragments import attestation_name
from fq.provenance.geometry import stored_shape_problems

MANIFEST_NAME = "fq-manifest.intoto.jsonl"
DERIVED_FILES = (CONFIG, QUANTIZATION_CONFIG)


@dataclass(frozen=True)
class BaseManifest:
    sha256: str
    node: str
    campaign: dict
    files: dict  # name -> (sha256, size)
    derived: tuple = ()  # {name, rule, params, from} of each declared derived file
    model_signing: dict | None = None  # {signature: "model.sig", public_key: PEM}: the OpenSSF signature it declares

    def digests(self) -> dict[str, str]:
        """What ``model.sig`` signs: every listed file's sha256, and the manifest's own line's."""
        return {**{n: d for n, (d, _) in self.files.items()}, MANIFEST_NAME: self.sha256}


def _walk(base_dir: str | os.PathLike) -> tuple[list[str], list[str]]:
    """(relative names of every file under ``base_dir`` except the manifest, problems): a symlinked
    directory or a name that is not a safe relative path is a problem, and the walk goes on."""
    base = Path(base_dir)
    names, problems = [], []
    for dirpath, dirnames, filenames in os.walk(base):
        for d in sorted(dirnames):
            if os.path.islink(os.path.join(dirpath, d)):
                problems.append(f"{os.path.join(dirpath, d)}: is a symlink; a base holds only real files")
        for f in sorted(filenames):
            rel = Path(dirpath, f).relative_to(base).as_posix()
            if rel not in (MANIFEST_NAME, SIGNATURE) and not f.startswith(".tmp-"):  # model.sig: checked apart
                try:
                    names.append(check_name(rel, f"{base}/{rel}"))
                except FqError as e:
                    problems.append(str(e))
    return sorted(names), problems


def list_files(base_dir: str | os.PathLike) -> list[str]:
    """Relative names of every file under ``base_dir`` except the manifest; refuses symlinks and
    anything that is not a regular file or directory."""
    names, problems = _walk(base_dir)
    if problems:
        raise FqError(problems[0])
    return names


def _hash(base_dir, name: str, size: int | None = None) -> tuple[str, int]:
    with open_regular(base_dir, name, f"{base_dir}/{name}", size=size, listed_by=MANIFEST_NAME) as fh:
        digest, size, _ = sha256_stream(fh)
    return digest, size


def write_base_manifest(base_dir: str | os.PathLike, *, node: str, campaign: dict,
                        key: Ed25519PrivateKey, derived: list[dict], model_signing: str | None = None
                        ) -> tuple[Path, str]:
    """``derived``: ``[{name, rule, params}]`` (``fq.provenance.exl3config.write_derived``'s specs, the model card's):
    the base's config.json and quantization_config.json (and README.md); their ``from`` is filled here, and each must
    be its rule's output. ``model_signing``: the PEM of the ECDSA public key whose ``model.sig`` (written after this
    manifest, over its files and itself: fq.provenance.model_sig) every consumer checks; None: no model.sig."""
    names = list_files(base_dir)
    if not names:
        raise FqError(f"{base_dir}: empty base; nothing to manifest")
    if campaign.get("signer") != fingerprint(key):
        raise FqError(f"{base_dir}: campaign names signer {campaign.get('signer')!r}, the key is {fingerprint(key)}")
    hashed = [(n, *_hash(base_dir, n)) for n in names]
    predicate = {"format": "fq-base-manifest/1", "node": node, "campaign": campaign,
                 "files": [{"name": n, "size": size} for n, _, size in hashed]}
    digests = {n: d for n, d, _ in hashed}
    entries = []
    for spec in derived:
        if spec["rule"] not in RULES:
            raise FqError(f"{base_dir}/{spec['name']}: unknown derivation rule {spec['rule']!r}")
        inputs = rule_inputs(spec["rule"], names)
        missing = [n for n in inputs + [spec["name"]] if n not in digests]
        if missing:
            raise FqError(f"{base_dir}/{missing[0]}: missing; {spec['name']} is derived by rule {spec['rule']}")
        entry = {**spec, "from": [{"name": n, "sha256": digests[n]} for n in inputs]}
        problem, _, _ = check_derived(base_dir, entry, f"{base_dir}/{spec['name']}")
        if problem:
            raise FqError(problem)
        entries.append(entry)
    predicate["derived"] = entries
    if model_signing is not None:
        predicate["model_signing"] = {"signature": SIGNATURE, "public_key": model_signing}
    _check_declared(entries, {n: (d, size) for n, d, size in hashed}, f"{base_dir}/{MANIFEST_NAME}")
    line = dsse.envelope_line(dsse.sign(statement([(n, d) for n, d, _ in hashed], MANIFEST, predicate), key))
    path = Path(base_dir) / MANIFEST_NAME
    atomic.write_bytes(path, line)
    return path, sha256_hex(line)


def read_base_manifest(base_dir: str | os.PathLike, public_key: Ed25519PublicKey,
                       campaign: dict | None = None, *, sha256: str | None = None,
                       label: str | None = None) -> BaseManifest:
    """``sha256``: the manifest digest a plan pins, compared before the signature is checked or the line
    parsed (``label`` names the base in that error; default the manifest's path)."""
    where = f"{base_dir}/{MANIFEST_NAME}"
    data = read_regular(base_dir, MANIFEST_NAME, where)
    if sha256 is not None and sha256_hex(data) != sha256:
        # refused: not the manifest the plan pins; its own problem, if any, is the better message (bounded work)
        _parse_manifest(data, where, public_key, campaign)
        raise FqError(f"{label or where}: manifest sha256 {sha256_hex(data)[:16]}… is not the base this plan was "
                      f"built on ({sha256[:16]}…)")
    return _parse_manifest(data, where, public_key, campaign)


def _parse_manifest(data: bytes, where: str, public_key: Ed25519PublicKey, campaign: dict | None) -> BaseManifest:
    subjects, pred = parse_statement(dsse.open_envelope(data, public_key, where), where, MANIFEST)
    if pred["campaign"]["signer"] != fingerprint(public_key):
        raise FqError(f"{where}: campaign identity names another signer than the pinned key")
    if campaign is not None:
        require_same(pred["campaign"], campaign, where)
    sizes = {f["name"]: f["size"] for f in pred["files"]}
    if sorted(sizes) != sorted(n for n, _ in subjects) or len(sizes) != len(subjects):
        raise FqError(f"{where}: subjects and predicate files name different files")
    for n, _ in subjects:
        check_name(n, f"{where}: subject")
    files = {n: (d, sizes[n]) for n, d in subjects}
    return BaseManifest(sha256_hex(data), pred["node"], pred["campaign"], files,
                        _check_declared(pred["derived"], files, where), pred.get("model_signing"))


def _check_declared(derived: list[dict], files: dict, where: str) -> tuple:
    """The manifest's ``derived`` against its own listing: config.json and quantization_config.json, each by a
    rule that derives that file, with the same params (so config.json's bits and codebook are those the
    quantization_config rule checks against the tensors), and ``from`` exactly the rule's inputs among the
    listed files with their listed digests."""
    outputs = sorted(d["name"] for d in derived)
    if len(set(outputs)) != len(outputs) or not set(DERIVED_FILES) <= set(outputs) \
            or not set(outputs) - set(DERIVED_FILES) <= set(OPTIONAL):
        raise FqError(f"{where}: declares derived files {outputs}; a base declares {sorted(DERIVED_FILES)}, "
                      f"its model card {README} and, when its skeleton needs them, {' and '.join(TENSOR_OUTPUTS)} "
                      "(each recomputed by every consumer)")
    exl3 = [d for d in derived if d["rule"] != RULE_CARD]  # the card's params are its own (fq.provenance.model_card)
    if len({canonical_dumps(d["params"]) for d in exl3}) != 1:
        raise FqError(f"{where}: derived files declare different params "
                      f"({'; '.join(d['name'] + ': ' + canonical_dumps(d['params']).decode() for d in exl3)})")
    for d in derived:
        if d["rule"] == RULE_CARD:
            check_card_params(d["params"], f"{where}: derived {d['name']}")
    seen = set()
    for d in derived:
        name, rule = d["name"], d["rule"]
        if name in seen:
            raise FqError(f"{where}: derived file {name} is declared twice")
        seen.add(name)
        if name not in files:
            raise FqError(f"{where}: derived file {name} is not among the files it lists")
        if RULES[rule].output != name:
            raise FqError(f"{where}: derived {name}: rule {rule} derives {RULES[rule].output}, not {name}")
        inputs = rule_inputs(rule, list(files))
        if [f["name"] for f in d["from"]] != inputs:
            raise FqError(f"{where}: derived {name}: from {[f['name'] for f in d['from']][:4]} is not what rule "
                          f"{rule} derives it from among the listed files ({inputs[:4]}{'…' if len(inputs) > 4 else ''})")
        for f in d["from"]:
            if f["sha256"] != files[f["name"]][0]:
                raise FqError(f"{where}: derived {name}: input {f['name']} sha256 {f['sha256'][:16]}… is not the "
                              f"listed {files[f['name']][0][:16]}…")
    return tuple(derived)


@dataclass(frozen=True)
class VerifiedBase:
    manifest: BaseManifest
    shards: dict  # name -> Attested (with .info: the one pass over the file) of every attested shard


def _check_files(base_dir, manifest: BaseManifest, public_key: Ed25519PublicKey | None) -> tuple[list[str], dict]:
    present, problems = _walk(base_dir)
    present = set(present)
    shards = {}
    derived = {d["name"]: d for d in manifest.derived}
    bad = set()  # listed files missing or not as listed
    for name in sorted(present - set(manifest.files)):
        problems.append(f"{base_dir}/{name}: not listed in {MANIFEST_NAME} (stray file in a published base)")
    for name, (digest, size) in sorted(manifest.files.items()):
        if name not in present:
            problems.append(f"{base_dir}/{name}: listed in {MANIFEST_NAME} but missing")
            bad.add(name)
            continue
        if name in derived:
            continue  # recomputed below, once its inputs are checked
        try:
            if public_key is not None and name.endswith(".safetensors") and attestation_name(name) in manifest.files:
                att = verify_shard(base_dir, name, public_key, manifest.campaign)  # the file's one pass
                shards[name] = att
                got, got_size = att.info.sha256, att.info.size
            else:
                got, got_size = _hash(base_dir, name, size)
        except FqError as e:
            problems.append(str(e))
            bad.add(name)
            continue
        if (got, got_size) != (digest, size):
            problems.append(f"{base_dir}/{name}: sha256/size differ from {MANIFEST_NAME}")
            bad.add(name)
    for name, d in sorted(derived.items(), key=lambda kv: DERIVED_ORDER.index(kv[0])):  # inputs before outputs
        if name in bad or any(f["name"] in bad for f in d["from"]):
            bad.add(name)
            continue  # its own problem, or an input's, is already reported
        try:
            problem, got, got_size = check_derived(base_dir, d, f"{base_dir}/{name}")
        except FqError as e:
            problem = str(e)
        if problem is None and (got, got_size) != manifest.files[name]:
            problem = f"{base_dir}/{name}: sha256/size differ from {MANIFEST_NAME} (which lists another output of rule {d['rule']})"
        if problem:
            problems.append(problem)
            bad.add(name)
    problems += _signature_problems(base_dir, manifest)
    # every base fragment's linears at the padded shape of the matrices the source config makes (fq.codec.shape)
    problems += stored_shape_problems(base_dir, manifest.files, shards, bad)
    for rule_name in TENSOR_RULES:
        # a derived tensor file the base needs and its manifest does not declare: exllamav3 would misread the base
        # (gpt-oss's experts without their biases, MiniMax-M2's router without its score bias)
        rule = RULES[rule_name]
        if rule.output in derived or bad:
            continue
        try:
            needed = rule.needed(Path(base_dir), rule.inputs(sorted(manifest.files)))
        except FqError as e:
            problems.append(str(e))
            continue
        if needed:
            problems.append(f"{base_dir}/{MANIFEST_NAME}: {rule.missing} but the manifest declares no {rule.output} "
                            f"(rule {rule.rule}); {rule.consequence}")
    return problems, shards


def _signature_problems(base_dir, manifest: BaseManifest) -> list[str]:
    """``model.sig`` against the manifest: present exactly when the manifest declares a model-signing key, signed by
    that key over exactly the manifest's files and the manifest (fq.provenance.model_sig)."""
    where = f"{base_dir}/{SIGNATURE}"
    present = os.path.lexists(where)
    if manifest.model_signing is None:
        return [f"{where}: {MANIFEST_NAME} declares no model-signing key, so nothing vouches for this signature "
                "(stray file in a published base)"] if present else []
    if not present:
        return [f"{where}: missing; {MANIFEST_NAME} declares the OpenSSF model signature of this directory"]
    return check_signature(base_dir, manifest.digests(), manifest.model_signing["public_key"], where)


def check_base_files(base_dir: str | os.PathLike, manifest: BaseManifest,
                     public_key: Ed25519PublicKey | None = None) -> list[str]:
    """One line per problem: a listed file missing or different, or a file the manifest does not list.
    With ``public_key``, attested shards are also verified against their attestations (same pass)."""
    return _check_files(base_dir, manifest, public_key)[0]


def verify_base(base_dir: str | os.PathLike, public_key: Ed25519PublicKey, campaign: dict | None = None, *,
                sha256: str | None = None, option: str | None = None) -> VerifiedBase:
    """All of a base checkpoint against its manifest (``fq combine --base``); the first problem raises,
    saying how many more there are. ``option``: the command-line option that named ``base_dir``, prefixed
    to the error."""
    label = f"{option} {base_dir}" if option else None
    manifest = read_base_manifest(base_dir, public_key, campaign, sha256=sha256, label=label)
    problems, shards = _check_files(base_dir, manifest, public_key)
    if problems:
        more = f" (and {len(problems) - 1} more problem(s) in this base)" if len(problems) > 1 else ""
        raise FqError(f"{option + ': ' if option else ''}{problems[0]}{more}")
    return VerifiedBase(manifest, shards)


def read_verified(base_dir: Path, name: str, digest: str, size: int) -> tuple[Header | None, bytes]:
    """A base file's bytes, read once, whose sha256 and size are the manifest's (so what is parsed is what was
    verified, whatever happens to the file afterwards); and its safetensors header parsed from those bytes."""
    where = f"{base_dir}/{name}"
    with open_regular(base_dir, name, where, size=size, listed_by="the base manifest") as fh:
        header = read_header(fh, where) if name.endswith(".safetensors") else None
        fh.seek(0)
        data = fh.read(size + 1)
    if len(data) != size or sha256_hex(data) != digest:
        raise FqError(f"{where}: changed since it was verified (sha256/size differ from the manifest)")
    if header is not None and data[:header.data_start] != header.raw:
        raise FqError(f"{where}: changed since it was verified (header)")
    return header, data
