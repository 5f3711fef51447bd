"""The fq commands under careless paths (issue 24, items 4 and 5): an output that cannot be written, an input that
is missing or not UTF-8, a checkpoint path that is not a directory, a demo model written into someone's directory.
Each is refused before any work (no model loaded, no measurement, no forward pass) with one line on stderr naming
the option, the path and the problem -- never a traceback, never a file overwritten.

Tests run as root here, and root writes into a chmod 0o500 directory: "unwritable" is covered by a path under a
regular file (no one can write there), the chmod variants only when not root.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from fq.cli import main

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
root_only = pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")


def refused(capsys, argv, *needles) -> str:
    """``fq argv`` exits 2 with one stderr line holding every needle."""
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    for n in needles:
        assert str(n) in err, err
    return err


def usage_error(capsys, argv, line: str) -> None:
    """An argparse refusal (exit 2): the usage, then one error line naming the option."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.splitlines()[-1].endswith(line) and "Traceback" not in err, err


@pytest.fixture
def afile(tmp_path) -> Path:
    """A regular file: a path under it can be written by no one, root included."""
    f = tmp_path / "afile"
    f.write_text("not a directory\n")
    return f


@pytest.fixture
def read_only(tmp_path) -> Path:
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    yield d
    d.chmod(0o700)


# --- fq usage: the model is a local directory, the outputs are checked before the 45 s measurement ---
@pytest.fixture
def no_measurement(monkeypatch):
    import fq.model.usage

    def measure(*a, **kw):
        raise AssertionError("measured before the arguments were checked")
    monkeypatch.setattr(fq.model.usage, "measure_usage", measure)


@pytest.fixture
def usage_inputs(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text\n")
    return model, text


def test_usage_missing_model_dir_is_never_a_hub_id(tmp_path, monkeypatch, capsys, no_measurement, usage_inputs):
    """``owner/name`` that does not exist here is a missing directory, not a hub repo to try for a minute."""
    _, text = usage_inputs
    monkeypatch.chdir(tmp_path)
    refused(capsys, ["usage", "--model", "nobody/no-such-model", "--text", text, "--out", "u.json"],
            "--model nobody/no-such-model: no such directory", "never taken for a hub repo id")


def test_usage_model_that_is_a_file(capsys, afile, no_measurement, usage_inputs):
    _, text = usage_inputs
    refused(capsys, ["usage", "--model", afile, "--text", text, "--out", afile.parent / "u.json"],
            f"--model {afile}: is a regular file, not a checkpoint directory")


def test_usage_model_without_config(tmp_path, capsys, no_measurement, usage_inputs):
    _, text = usage_inputs
    (tmp_path / "empty").mkdir()
    refused(capsys, ["usage", "--model", tmp_path / "empty", "--text", text, "--out", tmp_path / "u.json"],
            f"--model {tmp_path / 'empty'}: no config.json")


@pytest.mark.parametrize("option,value", [("--threads", "-3"), ("--seq-len", "0"), ("--batch", "\u00b2")])
def test_usage_counts_are_positive_integers(capsys, option, value, usage_inputs, tmp_path):
    model, text = usage_inputs
    usage_error(capsys, ["usage", "--model", model, "--text", text, "--out", tmp_path / "u.json", option, value],
                f"argument {option}: {value!r} is not a positive integer")


def test_usage_unwritable_out_is_refused_before_measuring(capsys, afile, no_measurement, usage_inputs):
    model, text = usage_inputs
    refused(capsys, ["usage", "--model", model, "--text", text, "--out", afile / "u.json"],
            f"--out {afile / 'u.json'}: {afile} is a regular file, not a directory")


@root_only
def test_usage_out_in_a_read_only_directory(capsys, read_only, no_measurement, usage_inputs):
    model, text = usage_inputs
    refused(capsys, ["usage", "--model", model, "--text", text, "--out", read_only / "u.json"],
            f"cannot write in {read_only}")


def test_usage_text_not_utf8(tmp_path, capsys, no_measurement, usage_inputs):
    model, _ = usage_inputs
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"caf\xe9 latin-1\n")
    refused(capsys, ["usage", "--model", model, "--text", bad, "--out", tmp_path / "u.json"],
            f"--text {bad}: not UTF-8 text at byte 3 (0xe9")


# --- fq eval: text and outputs checked before the tree is read (a dummy key: nothing else is reached) ---
def _eval(tmp_path, **over):
    args = {"--key": tmp_path / "no.pub", "--source": tmp_path / "src", "--text": tmp_path / "held.txt",
            "--out": tmp_path / "eval.json", **over}
    if not (tmp_path / "held.txt").exists():
        (tmp_path / "held.txt").write_text("held-out text\n")
    return ["eval", tmp_path / "published", *(x for kv in args.items() for x in kv)]


def test_eval_missing_text(tmp_path, capsys):
    refused(capsys, _eval(tmp_path, **{"--text": tmp_path / "missing.txt"}),
            f"--text {tmp_path / 'missing.txt'}: cannot read: No such file or directory")


def test_eval_text_that_is_a_directory(tmp_path, capsys):
    refused(capsys, _eval(tmp_path, **{"--text": tmp_path}), f"--text {tmp_path}: is a directory, not a text file")


def test_eval_text_not_utf8(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\n\xff\xfe")
    refused(capsys, _eval(tmp_path, **{"--text": bad}), f"--text {bad}: not UTF-8 text at byte 3 (0xff")


@pytest.mark.parametrize("option", ["--out", "--tsv"])
def test_eval_unwritable_outputs(tmp_path, capsys, afile, option):
    refused(capsys, _eval(tmp_path, **{option: afile / "x"}), f"{option} {afile / 'x'}: {afile} is a regular file")
    refused(capsys, _eval(tmp_path, **{option: tmp_path}), f"{option} {tmp_path}: is a directory")


@pytest.mark.parametrize("option", ["--tokens", "--seq-len"])
def test_eval_counts_blame_the_option(tmp_path, capsys, option):
    usage_error(capsys, _eval(tmp_path, **{option: "0"}), f"argument {option}: '0' is not a positive integer")


# --- fq plan, fq combine, fq promote: outputs checked before the source, the plan or the campaign is read ---
def test_plan_out_unwritable_or_a_directory(tmp_path, capsys, afile):
    argv = ["plan", RECIPES / "demo.json", "--model", tmp_path / "no-model", "--out"]
    refused(capsys, [*argv, afile / "plan.json"], f"--out {afile / 'plan.json'}: {afile} is a regular file")
    refused(capsys, [*argv, tmp_path], f"--out {tmp_path}: is a directory; expected a file name")


def test_combine_out_is_a_directory(tmp_path, capsys, afile):
    argv = ["combine", "--key", tmp_path / "no.pub", "--plan", tmp_path / "p.intoto.jsonl", "--out"]
    refused(capsys, [*argv, tmp_path], f"--out {tmp_path}: is a directory; expected a file name")
    refused(capsys, [*argv, afile / "a.safetensors"], f"{afile} is a regular file, not a directory")
    (tmp_path / "a.safetensors.intoto.jsonl").mkdir()  # where its attestation goes
    refused(capsys, [*argv, tmp_path / "a.safetensors"], "a.safetensors.intoto.jsonl: is a directory")


@pytest.mark.parametrize("dest", ["file", "under"])
def test_promote_local_destination(tmp_path, capsys, afile, dest):
    to = afile if dest == "file" else afile / "pub"
    refused(capsys, ["promote", tmp_path / "campaign", "--to", to, "--key", tmp_path / "no.pub"],
            f"--to {to}: {afile} is a regular file, not a directory")


@root_only
def test_promote_read_only_destination(tmp_path, capsys, read_only):
    refused(capsys, ["promote", tmp_path / "campaign", "--to", read_only / "pub", "--key", tmp_path / "no.pub"],
            f"cannot write in {read_only}")


# --- fq keygen: both key files writable before either is written; a key is never overwritten ---
def test_keygen_prefix_under_a_file(capsys, afile):
    refused(capsys, ["keygen", "--out", afile / "signer"], f"--out {afile / 'signer.key'}: {afile} is a regular file")


@root_only
def test_keygen_read_only_directory(capsys, read_only):
    refused(capsys, ["keygen", "--out", read_only / "signer"], f"cannot write in {read_only}")


def test_keygen_empty_prefix(capsys):
    refused(capsys, ["keygen", "--out", ""], "--out '': expected a path prefix")


def test_keygen_half_a_pair_is_never_written(tmp_path, capsys):
    """PREFIX.pub that cannot be written: refused before PREFIX.key exists; an existing key is kept."""
    (tmp_path / "signer.pub").mkdir()
    refused(capsys, ["keygen", "--out", tmp_path / "signer"], f"--out {tmp_path / 'signer.pub'}: is a directory")
    assert not (tmp_path / "signer.key").exists()
    (tmp_path / "old.key").write_text("the only copy\n")
    refused(capsys, ["keygen", "--out", tmp_path / "old"], "already exists; refusing to overwrite a key")
    assert (tmp_path / "old.key").read_text() == "the only copy\n" and not (tmp_path / "old.pub").exists()


# --- fq demo-model: OUT new, empty, or exactly this demo model; never someone's files ---
def test_demo_model_out_is_a_file_or_under_one(capsys, afile):
    refused(capsys, ["demo-model", afile], f"OUT {afile}: {afile} is a regular file, not a directory")
    refused(capsys, ["demo-model", afile / "model"], f"OUT {afile / 'model'}: {afile} is a regular file")
    assert afile.read_text() == "not a directory\n"


def test_demo_model_text_dir_under_a_file(tmp_path, capsys, afile):
    refused(capsys, ["demo-model", tmp_path / "model", "--text", afile / "text"], f"--text {afile / 'text'}: {afile}")
    assert not (tmp_path / "model").exists(), "nothing written before the refusal"


@root_only
def test_demo_model_read_only_out(capsys, read_only):
    refused(capsys, ["demo-model", read_only / "model"], f"cannot write in {read_only}")


def test_demo_model_refuses_someones_directory(tmp_path, capsys):
    """A directory with another config.json (or any other file) keeps it: refused, nothing written."""
    d = tmp_path / "mine"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "mine"}')
    refused(capsys, ["demo-model", d], f"OUT {d}: config.json is not the demo model's config.json",
            "refusing to overwrite it")
    assert sorted(os.listdir(d)) == ["config.json"] and (d / "config.json").read_text() == '{"model_type": "mine"}'
    (d / "config.json").unlink()
    (d / "notes.txt").write_text("mine\n")
    refused(capsys, ["demo-model", d], f"OUT {d}: holds notes.txt, which the demo model does not write")
    assert sorted(os.listdir(d)) == ["notes.txt"]


def test_demo_model_rewrites_itself(tmp_path, capsys):
    """A previous demo model (or one a crash interrupted) is rewritten; its text splits too; an altered split is not."""
    out, text = tmp_path / "model", tmp_path / "text"
    assert main(["demo-model", str(out), "--text", str(text)]) == 0
    (out / "tokenizer.json").unlink()  # interrupted: a subset, and a temp file of the atomic write
    (out / ".tmp-tokenizer.json.abc123").write_bytes(b"partial")
    assert main(["demo-model", str(out), "--text", str(text)]) == 0
    assert (out / "tokenizer.json").is_file() and len(os.listdir(out)) == 10
    capsys.readouterr()
    (text / "train.txt").write_text("my own training text\n")
    refused(capsys, ["demo-model", out, "--text", text], f"--text {text}: train.txt is not the demo model's train.txt")
    assert (text / "train.txt").read_text() == "my own training text\n"


# --- fq itself: an OSError that slips past the checks is one line too ---
def test_escaped_oserror_is_one_line(tmp_path, capsys, monkeypatch):
    from fq.provenance.attest import keys

    def generate(prefix):
        raise PermissionError(13, "Permission denied", f"{prefix}.key")
    monkeypatch.setattr(keys, "generate", generate)
    err = refused(capsys, ["keygen", "--out", tmp_path / "k"])
    assert err == f"fq keygen: {tmp_path / 'k'}.key: Permission denied\n"
