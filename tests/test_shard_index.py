"""A staged shard's range index (fq.model.shard_index): the staging job hashes each tensor's bytes in the pass that
verifies the whole shard, and a chain job then reads and verifies only its own tensors. On the demo model: the
chain's Hessians and hidden states are byte-identical with and without the index, a job with it reads fewer bytes,
and a tampered tensor, header or index, or an index derived from another shard digest, is refused by name."""
from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch

from fq.core import canonical
from fq.core.safepath import sha256_file
from fq.errors import FqError
from fq.hessian import capture, layer as layer_mod
from fq.model import checkpoint as checkpoint_mod, demo_model, shard_index
from fq.workflow.staging import stage_shard

ROWS, COLS = 2, 32


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """The demo model, its shards' recorded digests, and two staging directories: ``plain`` (shards only) and
    ``indexed`` (each shard staged by the staging job with its range index)."""
    d = tmp_path_factory.mktemp("ranges")
    model = Path(demo_model.write(d / "model"))
    shards = sorted(p.name for p in model.glob("*.safetensors"))
    recorded = {s: sha256_file(model / s) for s in shards}
    campaign = d / "campaign.json"
    campaign.write_text(canonical.pretty({"source": {"shards": {
        s: {"sha256": recorded[s], "size": (model / s).stat().st_size} for s in shards}}}))
    plain, indexed = d / "plain" / "staging", d / "indexed" / "staging"
    plain.mkdir(parents=True)
    for s in shards:
        shutil.copyfile(model / s, plain / s)
        stage_shard(str(campaign), "local", str(model), s, 0, str(indexed / s), out_index=str(indexed / s) + ".ranges.json")
    return model, recorded, plain, indexed


def ckpt_in(model: Path, staging: Path):
    return dataclasses.replace(layer_mod.read_checkpoint(model), dir=staging)


def test_the_staging_job_writes_a_canonical_index_derived_from_the_recorded_digest(staged):
    model, recorded, _, indexed = staged
    for s, digest in recorded.items():
        path = shard_index.index_path(indexed / s)
        doc = shard_index.load(path, s, digest)
        assert path.read_bytes() == canonical.dumps(doc) + b"\n"
        assert doc["size"] == (model / s).stat().st_size
        # header and tensors tile the shard: every byte is under one digest
        spans = sorted([(0, doc["header"]["length"])] + [(t["offset"], t["length"]) for t in doc["tensors"].values()])
        assert spans[0][0] == 0 and all(a[0] + a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert spans[-1][0] + spans[-1][1] == doc["size"]


def test_the_chain_gives_the_same_bytes_with_and_without_the_index(staged, tmp_path):
    model, recorded, plain, indexed = staged
    tokens = torch.randint(0, 512, (ROWS, COLS), generator=torch.Generator().manual_seed(0))
    a = capture.capture_all(ckpt_in(model, plain), tokens, tmp_path / "a", sha256=recorded)
    b = capture.capture_all(ckpt_in(model, indexed), tokens, tmp_path / "b", sha256=recorded)
    assert sorted(a["hessians"]) == [1, 2]
    assert a["digests"] == b["digests"]  # hidden states and Hessians, metadata (the shard digests) included
    for L, path in a["hessians"].items():
        assert path.read_bytes() == b["hessians"][L].read_bytes()


class _Counting:
    """A file object that counts the bytes read through it."""

    def __init__(self, fh, counter: list):
        self._fh, self._counter = fh, counter

    def read(self, n=-1):
        data = self._fh.read(n)
        self._counter[0] += len(data)
        return data

    def readinto(self, buf):
        n = self._fh.readinto(buf)
        self._counter[0] += n
        return n

    def __getattr__(self, name):
        return getattr(self._fh, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._fh.close()


def _bytes_read(monkeypatch, ckpt, layer: int, recorded) -> tuple[int, dict]:
    counter = [0]
    real = checkpoint_mod.open_file
    monkeypatch.setattr(checkpoint_mod, "open_file", lambda *a, **k: _Counting(real(*a, **k), counter))
    _, digests = layer_mod.layer_tensors(ckpt, layer, recorded)
    monkeypatch.setattr(checkpoint_mod, "open_file", real)
    return counter[0], digests


def test_a_job_with_the_index_reads_only_its_tensors_and_headers(staged, monkeypatch):
    model, recorded, plain, indexed = staged
    whole, d_plain = _bytes_read(monkeypatch, ckpt_in(model, plain), 1, recorded)
    ranged, d_indexed = _bytes_read(monkeypatch, ckpt_in(model, indexed), 1, recorded)
    assert d_plain == d_indexed == {s: recorded[s] for s in d_plain}  # the recorded shard digests, as before
    ckpt = ckpt_in(model, indexed)
    own = 0
    for s in d_indexed:
        doc = shard_index.load(shard_index.index_path(indexed / s), s, recorded[s])
        own += sum(doc["tensors"][n]["length"] for n in ckpt.layer_names(layer_mod.architecture(ckpt.config), 1)
                   if ckpt.weight_map[n] == s)
        own += 2 * doc["header"]["length"]  # read_header's parse, then its raw bytes
    assert whole >= sum((plain / s).stat().st_size for s in d_plain)  # each shard hashed whole
    assert ranged == own < whole
    print(f"layer 1: {whole} bytes read without the index, {ranged} with it")


def _tampered_copy(indexed: Path, tmp_path: Path) -> Path:
    out = tmp_path / "staging"
    shutil.copytree(indexed, out)
    return out


def _layer1_tensor(model: Path, staging: Path):
    """(shard, entry) of one of layer 1's tensors."""
    ckpt = ckpt_in(model, staging)
    name = ckpt.layer_names(layer_mod.architecture(ckpt.config), 1)[0]
    shard = ckpt.weight_map[name]
    from fq.model.shards import read_header

    with open(staging / shard, "rb") as fh:
        return shard, read_header(fh, shard).entry(name)


def test_a_tampered_tensor_range_is_refused_naming_file_and_tensor(staged, tmp_path):
    model, recorded, _, indexed = staged
    staging = _tampered_copy(indexed, tmp_path)
    shard, e = _layer1_tensor(model, staging)
    with open(staging / shard, "r+b") as fh:
        fh.seek(e.start)
        b = fh.read(1)
        fh.seek(e.start)
        fh.write(bytes([b[0] ^ 1]))
    with pytest.raises(FqError, match=rf"{shard}: tensor '{e.name}' \(bytes {e.start}\.\.{e.end}\) has sha256 .*"
                                      rf"{shard}\.ranges\.json .* says"):
        layer_mod.layer_tensors(ckpt_in(model, staging), 1, recorded)


def test_a_tampered_index_is_refused_naming_it(staged, tmp_path):
    model, recorded, _, indexed = staged
    staging = _tampered_copy(indexed, tmp_path)
    shard, e = _layer1_tensor(model, staging)
    path = shard_index.index_path(staging / shard)
    doc = canonical.load(path)
    doc["tensors"][e.name]["sha256"] = "0" * 64
    shard_index.write(path, doc)
    with pytest.raises(FqError, match=rf"tensor '{e.name}' .*/{path.name} \(derived .* says {'0' * 64}"):
        layer_mod.layer_tensors(ckpt_in(model, staging), 1, recorded)
    doc["tensors"][e.name]["sha256"] = canonical.load(shard_index.index_path(indexed / shard))["tensors"][e.name]["sha256"]
    doc["tensors"][e.name]["offset"] += 1
    shard_index.write(path, doc)
    with pytest.raises(FqError, match=rf"tensor '{e.name}' differs from .*{path.name}: offset {e.start} "
                                      rf"\(index: {e.start + 1}\)"):
        layer_mod.layer_tensors(ckpt_in(model, staging), 1, recorded)


def test_an_index_derived_from_another_shard_digest_is_refused(staged, tmp_path):
    model, recorded, _, indexed = staged
    staging = _tampered_copy(indexed, tmp_path)
    shard, _ = _layer1_tensor(model, staging)
    path = shard_index.index_path(staging / shard)
    doc = canonical.load(path)
    doc["shard_sha256"] = "f" * 64
    shard_index.write(path, doc)
    with pytest.raises(FqError, match=rf"{path.name}: derived from shard sha256 {'f' * 64}, but the campaign "
                                      rf"recorded {recorded[shard]} for {shard}"):
        layer_mod.layer_tensors(ckpt_in(model, staging), 1, recorded)


def test_a_changed_header_is_refused_against_the_index(staged, tmp_path):
    model, recorded, _, indexed = staged
    staging = _tampered_copy(indexed, tmp_path)
    shard, _ = _layer1_tensor(model, staging)
    data = bytearray((staging / shard).read_bytes())
    doc = canonical.load(shard_index.index_path(staging / shard))
    end = doc["header"]["length"]
    assert data[end - 1:end] == b" "  # fq pads its headers with spaces: a tab parses the same, hashes otherwise
    data[end - 1] = ord("\t")
    (staging / shard).write_bytes(bytes(data))
    with pytest.raises(FqError, match=rf"{shard}: header \({end} bytes\) has sha256 .* but .*{shard}\.ranges\.json "
                                      rf"says {end} bytes with sha256 {doc['header']['sha256']}"):
        layer_mod.layer_tensors(ckpt_in(model, staging), 1, recorded)
