"""fq's per-user cache (fq.core.cache) and what it holds: the linear shapes of a source (fq.planning.model_bits), a
pure function of config.json, the transformers and torch versions and fq's code, computed by building transformers'
decoder layers (seconds: every Snakemake parse paid them before the cache)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from fq.core import cache
from fq.planning import model_bits
from fq.workflow.campaign import load_campaign

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "fq" / "linear-shapes"


@pytest.fixture(scope="module")
def source():
    return load_campaign({"campaign": "t", "out": "unused", "source": {"kind": "demo"},
                          "recipe": str(ROOT / "recipes" / "demo.json"), "block_size": 4, "windows": "1,2",
                          "windows_on_disk": 1, "encode": {"device": "cpu"},
                          "assembly": {"version": 1, "expires": "2030-01-01T00:00:00Z"}}).source


def test_shapes_are_computed_once_then_read_and_equal(fresh, source, monkeypatch):
    first = model_bits.linear_shapes(source)
    (entry,) = fresh.glob("*.json")
    assert entry.name == model_bits._shapes_key(dict(source.config)) + ".json"
    # a second call reads the entry: building the layers again would fail here
    monkeypatch.setattr(model_bits, "_built_shapes", lambda *a: pytest.fail("built again, not read"))
    assert model_bits.linear_shapes(source) == first
    assert first["lm_head"][0] == "head" and {c for c, _ in first.values()} >= {"attention", "dense", "shared"}


def test_a_damaged_entry_is_computed_again_and_the_cache_can_be_off(fresh, source, monkeypatch):
    want = model_bits.linear_shapes(source)
    (entry,) = fresh.glob("*.json")
    for bad in ("{", json.dumps({"linears": {"x": [0, 1]}, "head": [1, 1]}), json.dumps([1])):
        entry.write_text(bad)
        assert model_bits.linear_shapes(source) == want
        assert json.loads(entry.read_text())["head"] == list(want["lm_head"][1])  # rewritten
    entry.unlink()
    monkeypatch.setenv("FQ_CACHE", "off")
    assert model_bits.linear_shapes(source) == want and not list(fresh.glob("*.json"))


def test_the_key_is_everything_the_shapes_depend_on(source, monkeypatch):
    from importlib import metadata

    config = dict(source.config)
    key = model_bits._shapes_key(config)
    assert model_bits._shapes_key(dict(config, hidden_size=config["hidden_size"] + 128)) != key
    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda d: "0.0" if d == "transformers" else real(d))
    assert model_bits._shapes_key(config) != key


def test_an_unwritable_cache_is_skipped(tmp_path, source, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    assert cache.get_json("linear-shapes", "k") is None
    cache.put_json("linear-shapes", "k", {"a": 1})  # nothing raised, nothing written
    assert model_bits.linear_shapes(source)["lm_head"][0] == "head"
