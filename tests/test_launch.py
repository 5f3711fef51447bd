"""The launcher lock at parse time (fq.workflow.launch.on_parse): which command lines take it, as Snakemake's own CLI
reads them, and the refusal. Fast: Snakemake's parser only, no workflow (tests/test_crash.py runs the launchers)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tests.kits import crashkit as k
from fq.workflow import launch, locks


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
    assert launch.runs_jobs(launch.command_line(argv))


@pytest.mark.parametrize("argv", [
    ["-n"], ["-np"], ["--dry-run", "--quiet", "rules"], ["--lint"], ["--list"], ["-l"], ["--list-target-rules"],
    ["--summary"], ["--detailed-summary"], ["--report", "r.html"], ["--dag"], ["--rulegraph"], ["--filegraph"],
    ["--unlock"], ["--cleanup-metadata", "x"], ["--list-changes", "params"], ["--delete-all-output"],
    ["--cores", "1", "--no-hooks", "campaign/campaign.json"],  # a job without the launcher's duties (tests, clusters)
    ["--cores", "1", "--mode", "remote"],
])
def test_a_command_line_that_runs_no_job_leaves_the_lock_alone(argv):
    args = launch.command_line(argv)
    assert args is not None and not launch.runs_jobs(args)


def test_an_argv_that_is_not_a_snakemake_command_line_is_left_to_onstart():
    assert launch.command_line(["-p", "no:cacheprovider", "tests/test_launch.py", "--not-a-snakemake-flag"]) is None
    assert not launch.runs_jobs(None)


def test_on_parse_takes_the_lock_in_the_main_process_only_and_refuses_a_second_launcher(tmp_path, capsys):
    c = SimpleNamespace(out=tmp_path / "campaign")
    run = ["--cores", "2"]
    assert launch.on_parse(c, False, run) is None  # a job re-parsing the Snakefile
    assert launch.on_parse(c, True, ["-n"]) is None and not (tmp_path / "campaign").exists()  # leaves nothing behind
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
        assert launch.on_parse(c, True, ["-n"]) is None  # a dry run beside the running launcher
    finally:
        k.release(h)
