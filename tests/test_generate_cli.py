"""``fq generate`` on a machine without CUDA (as CI): the product is verified under the pinned key first, so a tampered
or unknown product is refused for what it is; a verified one is then refused for want of a CUDA device, with exit 2 and
one line, never a traceback. The generation itself runs on the H200 (tests/test_exl3_runtime.py)."""
from __future__ import annotations

import pytest
import torch

from fq.cli import main


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _gen(c, product, *extra):
    return main(["generate", str(c.root), product, "--key", str(c.pub_path), "--prompt", "hello", "--no-state",
                 *extra])


def test_a_verified_product_is_refused_for_want_of_cuda_after_verification(pristine_campaign, capsys, no_cuda):
    assert _gen(pristine_campaign, "k2r1") == 2
    err = capsys.readouterr().err
    assert err.startswith("fq generate: ") and "no CUDA device here (the product verified" in err, err
    assert "Traceback" not in err


def test_a_tampered_stage_is_refused_before_any_runtime(campaign_copy, capsys, no_cuda):
    c = campaign_copy
    frag = c.path(c.frag("r1", 1, 0))
    data = bytearray(frag.read_bytes())
    data[-1] ^= 1
    frag.write_bytes(bytes(data))
    assert _gen(c, "k2r1") == 2
    err = capsys.readouterr().err
    assert "CUDA" not in err and c.frag("r1", 1, 0).split("/")[-1] in err, err


def test_an_unknown_product_and_bad_arguments_are_named(pristine_campaign, capsys, no_cuda, tmp_path):
    assert _gen(pristine_campaign, "k9") == 2
    err = capsys.readouterr().err
    assert "no product 'k9'" in err and "k2r1" in err, err
    assert _gen(pristine_campaign, "k2r1", "--cache-tokens", "1000") == 2
    assert "multiple of 256" in capsys.readouterr().err
    empty = tmp_path / "prompts.txt"
    empty.write_text("\n\n")
    assert main(["generate", str(pristine_campaign.root), "k2r1", "--key", str(pristine_campaign.pub_path),
                 "--prompt-file", str(empty), "--no-state"]) == 2
    assert "no prompt" in capsys.readouterr().err


@pytest.mark.parametrize("n", ["100000", "8192", str(10**30)])
def test_more_new_tokens_than_the_cache_holds_is_refused_up_front(pristine_campaign, capsys, no_cuda, monkeypatch, n):
    """Issue 42: refused before the product is verified or a runtime loaded (a completion and its prompt share the
    KV cache), in one line naming both options."""
    import fq.provenance.publication

    def never(*a, **k):
        raise AssertionError("read the publication before refusing the arguments")

    monkeypatch.setattr(fq.provenance.publication, "read_publication", never)
    assert _gen(pristine_campaign, "k2r1", "--max-new-tokens", n) == 2
    err = capsys.readouterr().err
    assert err == (f"fq generate: --max-new-tokens {n}: a completion and its prompt must fit in the KV cache "
                   f"(--cache-tokens 8192); expected at most 8191\n"), err
    assert _gen(pristine_campaign, "k2r1", "--max-new-tokens", "600", "--cache-tokens", "512") == 2
    assert "--max-new-tokens 600: a completion and its prompt must fit in the KV cache (--cache-tokens 512)" in \
        capsys.readouterr().err


def test_a_json_output_nothing_can_be_created_in_is_refused_up_front(pristine_campaign, capsys, no_cuda):
    """/proc passes os.access(W_OK) for root (as these tests run) yet refuses every new file; /dev/null exists and would
    be renamed over: both refused before verification, naming --json."""
    assert _gen(pristine_campaign, "k2r1", "--json", "/proc/x") == 2
    err = capsys.readouterr().err
    assert err.startswith("fq generate: --json /proc/x: cannot write in /proc (") and err.count("\n") == 1, err
    assert _gen(pristine_campaign, "k2r1", "--json", "/dev/null") == 2
    err = capsys.readouterr().err
    assert err.startswith("fq generate: --json /dev/null: is a character device; expected a regular file name"), err
