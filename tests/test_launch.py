"""The launcher lock at parse time (fq.workflow.launch.on_parse): which command lines take it, as Snakemake's own CLI
reads them, and the refusal. Fast: Snakemake's parser only, no workflow (tests/test_crash.py runs the launchers)."""
from __future__ import annotations

import contextlib
import io
from types import SimpleNamespace

import pytest

from tests.kits import crashkit as k
from fq.workflow import launch, locks


def parsed(argv: list[str]):
    """``argv`` as Snakemake's CLI reads it (the Namespace its args_to_api acts on, which command_line() finds)."""
    from snakemake.cli import parse_args

    with contextlib.redirect_stderr(io.StringIO()):  # its "Using workflow specific profile ..." line
        return parse_args(argv)[1]


@pytest.fixture(autouse=True)
def _forget_held():
    yield
    for key in list(locks._HELD):
        locks.release(key)


@pytest.mark.parametrize("argv", [
    ["--cores", "2"],
    ["--cores", "2", "campaign/published.verified", "--forcerun", "finalize"],
    ["--cores", "1", "--touch"],  # touches the campaign's files: a writer
    ["--cores", "1", "--report", "r.html", "--report-after-run"],  # runs the workflow, then reports
    ["--cores", "1", "--until", "retire", "--profile", str(k.REPO / "profiles" / "local-gpu")],
])
def test_a_command_line_that_runs_jobs_takes_the_lock(argv):
    assert launch.runs_jobs(parsed(argv))


@pytest.mark.parametrize("argv", [
    ["-n"], ["-np"], ["--dry-run", "--quiet", "rules"], ["--lint"], ["--list"], ["-l"], ["--list-target-rules"],
    ["--summary"], ["--detailed-summary"], ["--report", "r.html"], ["--dag"], ["--rulegraph"], ["--filegraph"],
    ["--unlock"], ["--cleanup-metadata", "x"], ["--list-changes", "params"], ["--delete-all-output"],
    ["--cores", "1", "--no-hooks", "campaign/campaign.json"],  # a job without the launcher's duties (tests, clusters)
    ["--cores", "1", "--mode", "remote"],
])
def test_a_command_line_that_runs_no_job_leaves_the_lock_alone(argv):
    assert not launch.runs_jobs(parsed(argv))


def test_outside_snakemake_s_cli_the_command_line_is_unknown_and_left_to_onstart():
    assert launch.command_line() is None  # no snakemake.cli.args_to_api on this stack (as under Snakemake's API)
    assert not launch.runs_jobs(None)
    assert launch.on_parse(SimpleNamespace(out="/nonexistent/campaign"), True) is None


def test_command_line_is_the_namespace_snakemake_s_cli_acts_on():
    """Found on the stack: the ``args`` of a function ``args_to_api`` of the module ``snakemake.cli`` (where Snakemake
    9's CLI parses the Snakefile from); a function of that name elsewhere is not it."""
    args = parsed(["--cores", "2"])

    def args_to_api(args, parser):
        return launch.command_line()

    assert args_to_api(args, None) is None  # this module's
    as_snakemake_cli = type(args_to_api)(args_to_api.__code__, {"__name__": "snakemake.cli", "launch": launch})
    assert as_snakemake_cli(args, None) is args


def test_on_parse_takes_the_lock_in_the_main_process_only_and_refuses_a_second_launcher(tmp_path, capsys):
    c = SimpleNamespace(out=tmp_path / "campaign")
    run = parsed(["--cores", "2"])
    assert launch.on_parse(c, False, run) is None  # a job re-parsing the Snakefile
    assert launch.on_parse(c, True, parsed(["-n"])) is None and not (tmp_path / "campaign").exists()  # nothing made
    path = tmp_path / "campaign" / "locks" / "campaign.lock"
    assert launch.on_parse(c, True, run) == path and "this launcher holds" in capsys.readouterr().err
    assert launch.on_parse(c, True, run) == path and not capsys.readouterr().err  # once per process
    locks.release(path)
    h = k.holder(f"locks.hold_campaign({str(c.out)!r})")
    try:
        with pytest.raises(SystemExit) as e:
            launch.on_parse(c, True, run)
        assert e.value.code == 1
        err = capsys.readouterr().err
        assert err.startswith("fq: campaign ") and "another launcher holds" in err and err.count("\n") == 1
        assert launch.on_parse(c, True, parsed(["-n"])) is None  # a dry run beside the running launcher
    finally:
        k.release(h)
