"""One reader of a source checkpoint directory (fq.model.checkpoint): planning, the calibration chain and the reference
forward take the same directories and refuse the same bad files. A Hugging Face cache snapshot (every file a symlink
into the cache's blobs) is read by all three; a FIFO, a shard name that leaves the directory and a config that is not
a JSON object are refused naming the file."""
import json
import os
import shutil
from pathlib import Path

import pytest

from tests.kits import familykit as fk
from fq.errors import FqError
from fq.hessian.layer import read_checkpoint
from fq.model.checkpoint import read_meta
from fq.model.checkpoint_model import checkpoint_state
from fq.model.source import load_source


@pytest.fixture(scope="module")
def real(tmp_path_factory):
    return fk.build("Qwen3MoeForCausalLM", tmp_path_factory.mktemp("ckpt") / "real")


def _snapshot(real: Path, root: Path) -> Path:
    """The layout of ~/.cache/huggingface/hub/models--o--n: blobs, and a snapshot of relative symlinks to them."""
    blobs, snap = root / "blobs", root / "snapshots" / "rev"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in real.iterdir():
        shutil.copyfile(f, blobs / f.name)
        os.symlink(Path("..", "..", "blobs", f.name), snap / f.name)
    return snap


def test_a_hub_cache_snapshot_is_read_by_planning_calibration_and_the_reference(real, tmp_path):
    snap = _snapshot(real, tmp_path)
    src = load_source(snap)
    ckpt = read_checkpoint(snap)
    config, tensors = checkpoint_state(snap)
    want = read_meta(real)
    assert src.weight_map == want.weight_map == dict(ckpt.weight_map) and config == want.config
    assert ckpt.config_sha256 == want.config_sha256 and set(tensors) == set(want.weight_map)


def test_bad_files_are_refused_the_same_way_by_every_reader(real, tmp_path):
    d = tmp_path / "fifo"
    shutil.copytree(real, d)
    shard = sorted(set(json.loads((d / "model.safetensors.index.json").read_text())["weight_map"].values()))[0]
    (d / shard).unlink()
    os.mkfifo(d / shard)
    for read in (lambda p: checkpoint_state(p), lambda p: load_source(p)):
        with pytest.raises(FqError, match=f"{shard}: a FIFO, expected a regular file"):
            read(d)

    d = tmp_path / "escape"
    shutil.copytree(real, d)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    for read in (read_meta, load_source, read_checkpoint, checkpoint_state):
        with pytest.raises(FqError, match=r"weight_map\[.*expected a plain shard file name"):
            read(d)

    d = tmp_path / "list"
    shutil.copytree(real, d)
    (d / "config.json").write_text("[1, 2]")
    for read in (read_meta, load_source, read_checkpoint, checkpoint_state):
        with pytest.raises(FqError, match="config.json: expected a JSON object"):
            read(d)
