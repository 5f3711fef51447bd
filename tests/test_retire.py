"""Retiring a window removes the shards an interrupted run left staged (the SIGKILL loop found one)."""
import json

from fq.workflow.staging import retire_window


def test_retire_removes_only_the_windows_leftovers(tmp_path):
    staging = tmp_path / "staging"
    staging.mkdir()
    for name in ("a.safetensors", "b.safetensors"):  # a: this window's last use, left behind; b: a later window's
        (staging / name).write_bytes(b"x")
        (staging / f"{name}.ranges.json").write_bytes(b"{}")  # its range index, temp as it is
    marker = tmp_path / "window-0.retired"
    retire_window(str(staging), 0, ["a.safetensors", "gone.safetensors"], str(marker))
    assert not (staging / "a.safetensors").exists() and (staging / "b.safetensors").exists()
    assert not (staging / "a.safetensors.ranges.json").exists() and (staging / "b.safetensors.ranges.json").exists()
    doc = json.loads(marker.read_text())
    assert doc == {"window": 0, "retired": ["a.safetensors", "gone.safetensors"], "removed_leftovers": ["a.safetensors"]}
