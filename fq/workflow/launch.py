"""The launcher's share of crash safety: the campaign lock and the checks before the first job.

Snakemake's own lock (``.snakemake/locks``) covers one working directory and is a file's existence:
two working directories can point ``out`` at one campaign, and a SIGKILLed Snakemake leaves its lock
behind (``snakemake --unlock`` removes it). fq's launcher lock is an flock on
``OUT/locks/campaign.lock``, held by the Snakemake process until it exits, however it exits, so a
second launcher on the same campaign is refused with one line, from any directory.

The launcher takes it while Snakemake parses the Snakefile (``on_parse``, from rules/common.smk), before
Snakemake builds its DAG: a second launcher is refused in the seconds of its parse, and always with fq's
line. Taken later (in ``onstart:``, as it was), the second launcher first built its DAG beside the running
one and went through Snakemake's own checks, whose failures (an incomplete output of a running job, a
directory lock where ``nolock`` is off) could come first and read as something else. Only the process a
user started takes it (Snakemake's main process, not the jobs that re-parse the Snakefile), and only for a
command line that runs jobs with its hooks on (``runs_jobs``): ``snakemake -n``, ``--lint``, ``--list``,
``--summary``, ``--report``, ``--dag`` and the other commands that start no job never take the lock and
are never blocked by it, and leave nothing behind in the campaign directory. Jobs that Snakemake spawns
(local sub-processes, cluster jobs) run in another mode or with ``--no-hooks`` and do not take it either.
Where Snakemake was not started from its CLI (driven through its Python API: no command line to read),
``onstart:`` takes it (``on_start``), before the first job, as before.

Before the first job starts, the launcher also checks the campaign's bindings (``campaign.json``): the
signer key must be the bound one, and when encode jobs are pending the encoder build must be the bound
one, so a wrong key or a rebuilt encoder is refused in seconds, before a window is staged.
"""
from __future__ import annotations

import sys
from pathlib import Path

from fq.core import canonical
from fq.errors import FqError
from fq.provenance.attest import keys
from fq.workflow import locks
from fq.workflow.campaign import is_encode_rule
from fq.workflow.common import check_signer
from fq.workflow.init import encoder_differences


def check_launch(c, key_path: str, device: str, pending: set[str] | None) -> None:
    """Refuse (FqError) a launch whose key or encoder build contradicts campaign.json (if bound yet).
    ``pending``: the rules with jobs to run (None: unknown, then only the key is checked here; every
    encode job checks the encoder itself)."""
    if not Path(c.campaign_json).is_file():
        return
    doc = canonical.load(c.campaign_json)
    if Path(key_path).is_file():
        check_signer(doc, keys.load_private(key_path).public_key(), key_path)
    if pending is not None and any(is_encode_rule(r) for r in pending):
        from fq.provenance.identity import encoder_identity

        # on a GPU campaign everything but the GPU's architecture: the launcher never touches a GPU (it would hold
        # a CUDA context on one for the whole campaign); each encode job checks its GPU's after claiming it
        problem = encoder_differences(doc["encoder"], encoder_identity("cpu"),
                                      ignore=() if device == "cpu" else ("device_arch",))
        if problem:
            raise FqError(f"{c.campaign_json}: {problem}; encode with the bound build or start a new campaign")


# Snakemake 9's commands that start no job (snakemake.cli.args_to_api tries each, in this order, before it runs the
# workflow): none runs ``onstart:``, none takes the campaign lock. The report is one of them unless --report-after-run.
NO_JOB_COMMANDS = ("lint", "list_target_rules", "list_rules", "print_compilation", "containerize",
                   "generate_unit_tests", "dag", "rulegraph", "filegraph", "d3dag", "unlock", "cleanup_metadata",
                   "conda_cleanup_envs", "conda_create_envs_only", "list_conda_envs", "cleanup_shadow",
                   "container_cleanup_images", "list_changes", "list_input_changes", "list_params_changes",
                   "list_untracked", "summary", "detailed_summary", "archive", "delete_all_output",
                   "delete_temp_output")


def command_line():
    """The command line Snakemake's CLI is acting on, as it read it (with its profiles): the ``args`` of
    ``snakemake.cli.args_to_api``, which is on the stack while it parses the Snakefile. None where Snakemake was not
    started from its CLI (its Python API). Read where it is, not parsed again: a second parse costs a launch about
    0.1-0.2 s of CPU, and a profile could make it read otherwise."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "args_to_api" and frame.f_globals.get("__name__") == "snakemake.cli":
            return frame.f_locals.get("args")
        frame = frame.f_back
    return None


def runs_jobs(args) -> bool:
    """Whether Snakemake given the command line ``args`` (``command_line()``) runs the workflow's jobs with its hooks
    on: the launches that run ``onstart:``. Not a dry run, not ``--no-hooks`` (how fq's cluster jobs and tests
    run a job without the launcher's duties), not a command that starts no job (NO_JOB_COMMANDS)."""
    if args is None or getattr(args, "dryrun", False) or getattr(args, "no_hooks", False):
        return False
    if getattr(getattr(args, "mode", None), "name", "DEFAULT") != "DEFAULT":  # a job's process (subprocess, remote)
        return False
    if (getattr(args, "report", None) or getattr(args, "reporter", None)) and not getattr(args, "report_after_run",
                                                                                            False):
        return False
    return not any(getattr(args, name, None) for name in NO_JOB_COMMANDS)


def _hold(c) -> Path:
    """The campaign lock for the life of this process; on refusal one line and exit 1."""
    try:
        return locks.hold_campaign(c.out)
    except FqError as e:
        print(f"fq: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


def on_parse(c, main_process: bool, args=None) -> Path | None:
    """At parse time (rules/common.smk): in Snakemake's main process, for a command line that runs jobs, take the
    campaign lock before Snakemake builds its DAG (refused: one line, exit 1). ``args``: the command line (default:
    ``command_line()``). The path held, or None where this process leaves the lock alone (a job's re-parse, a dry
    run, --lint, --list, ...) or does not know its command line (then ``on_start`` takes it)."""
    if not main_process:
        return None
    if not runs_jobs(args if args is not None else command_line()):
        return None
    if locks.holds(locks.campaign_path(c.out)):  # the Snakefile parsed again in this process
        return locks.campaign_path(c.out)
    path = _hold(c)
    print(f"fq: this launcher holds {path} until it exits", file=sys.stderr, flush=True)
    return path


def on_start(c, key_path: str, device: str, pending: set[str] | None = None, held: Path | None = None) -> Path:
    """The Snakefile's ``onstart:``: the campaign lock for the life of this process, unless ``on_parse`` took it
    (``held``), and the bindings; on refusal print one line and exit 1 (before any job has started)."""
    path = held or _hold(c)
    try:
        check_launch(c, key_path, device, pending)
    except FqError as e:
        print(f"fq: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if held is None:
        print(f"fq: this launcher holds {path} until it exits", file=sys.stderr, flush=True)
    return path
