"""The ``fq-slurm`` Snakemake executor: snakemake-executor-plugin-slurm, with each SLURM job running its
Snakemake jobs with Snakemake's local executor, so a group job parses the Snakefile once.

Why it exists. The pinned SLURM plugin (2.8.0, requirements.lock) submits one ``sbatch`` per Snakemake job
or group job. The job script runs ``snakemake --target-jobs ... --executor slurm-jobstep --jobs 1``
(``additional_general_args``, hardcoded), which parses the Snakefile and then starts *every* job it runs -- a
lone job or each member of a group -- as ``srun snakemake --target-jobs <one job>``: another process, another
parse, another plan of the campaign, per member (slurm-jobstep 0.6.1 leaves "group levels via srun" as a TODO).
profiles/slurm groups a layer's encodes into one SLURM job to pay those costs once per layer; with the
jobstep executor it still paid them once per member.

What it changes: only the job script's Snakemake, which runs its jobs with ``--executor local``. That executor
runs ``script:`` and ``shell:`` jobs from the Snakemake process itself (a thread per job; a script is a Python
subprocess handed the pickled job, with no Snakefile parse) and only starts a new ``snakemake`` for ``run:``
directives, which fq's rules do not use. A SLURM job now pays one Snakefile parse, whether it holds one
Snakemake job or a whole layer. Submission, status polling, cancelling, log files (``.snakemake/slurm_logs``)
and every setting are the parent's; its settings are spelled ``--fq-slurm-*`` (profile keys ``fq-slurm-*``).

Inside the allocation the local executor's scheduler decides what runs at once, where the jobstep executor
ran one member at a time (``--jobs 1``). It gets the allocation's size: ``--cores`` is the CPUs the job
asked ``sbatch`` for (``--cpus-per-task``, or ``--cpus-per-gpu`` x GPUs) and ``--resources gpu=N`` its
``--gpus=N``, so the members running at once never take more than the group job holds: a chain (a layer's
recipe nodes with ``encode.per_job: layer``) runs one after another; independent members (a layer's blocks with
``per_job: block``) run side by side as far as cores and GPUs allow.

The trade-off: the local executor does not wrap a member in ``srun``, so members are not job steps. They
share the batch step's cgroup and CPU binding (the allocation's, as a whole) instead of each getting a step
sized to its own threads and GPUs, and ``sstat``/accounting see one step per group job. GPUs are still never
shared: fq's encode jobs claim a GPU by an flock named after the allocation (fq/workflow/devices.py), so two
members of one allocation take turns on its GPU and members of different allocations never wait on each
other.

What names "slurm" in the parent, and how it stands under the name fq-slurm: the settings class is the parent's,
so its fields are read under the new prefix (the parent's help texts and messages still say ``--slurm-...``); the
log directory ``.snakemake/slurm_logs`` and the ``SNAKEMAKE_SLURM_PARTITIONS`` variable are fixed names, not
derived from the executor's, and keep working; the jobstep's own arguments are gone from the job script:
``--slurm-jobstep-pass-command-as-script`` (``--fq-slurm-pass-command-as-script`` still feeds sbatch its script
on stdin) and ``--slurm-jobstep-array-execs``, which array jobs need to dispatch their tasks -- so array jobs
(``--fq-slurm-array-jobs``) are refused.
"""
from __future__ import annotations

from snakemake_executor_plugin_slurm import Executor as SlurmExecutor
from snakemake_executor_plugin_slurm import ExecutorSettings, common_settings
from snakemake_executor_plugin_slurm_jobstep import get_cpu_setting
from snakemake_interface_common.exceptions import WorkflowError

__all__ = ["Executor", "ExecutorSettings", "common_settings", "allocation_cpus"]


def allocation_cpus(job) -> int | None:
    """The CPUs ``sbatch`` allocates to ``job``, from the option the parent submits it with; None if it sets none."""
    gpus = job.resources.get("gpu") or 0
    gpu_job = bool(gpus) or "gpu" in str(job.resources.get("gres") or "")  # as the parent's get_submit_command
    setting = get_cpu_setting(job, gpu_job)  # exactly the option get_submit_command adds
    if setting.startswith("--cpus-per-task="):
        return int(setting.split("=", 1)[1])
    if setting.startswith("--cpus-per-gpu=") and isinstance(gpus, int) and gpus > 0:
        return int(setting.split("=", 1)[1]) * gpus
    return None  # the cluster's default: the job script's Snakemake takes the CPUs it may run on (--cores all)


class Executor(SlurmExecutor):
    def __post_init__(self, test_mode: bool = False):
        super().__post_init__(test_mode)
        if self.array_jobs:
            raise WorkflowError("fq-slurm runs no array jobs (their tasks are dispatched by the slurm-jobstep "
                                "executor): drop --fq-slurm-array-jobs, or use --executor slurm")

    def additional_general_args(self):
        # the parent's "--executor slurm-jobstep --jobs 1" (+ --slurm-jobstep-pass-command-as-script, a jobstep
        # setting): the job script's Snakemake runs its jobs in its own process, within the sizes get_job_args sets
        return "--executor local"

    def get_job_args(self, job):
        args = super().get_job_args(job)
        cpus = allocation_cpus(job)
        if cpus is not None:  # a second --cores wins over the parent's (the launcher's --cores, or all)
            args += f" --cores {cpus}"
        gpus = job.resources.get("gpu")
        if isinstance(gpus, int) and gpus > 0:  # the parent's sbatch --gpus=N
            args += f" --resources gpu={gpus}"
        return args
