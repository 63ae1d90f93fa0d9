"""Config -> submitit SLURM parameters -> the sbatch script.

One function (`executor_parameters`) decides every `#SBATCH` line, and submitit's own
`_make_sbatch_string` renders it, so `--dry-run`, `--emit` and a real submission can never
disagree: dry-run prints what `SlurmExecutor` would write, and `--emit` renders the same
parameters around a plain `python -m nanotrain.runtime.task CONFIG` command instead of
submitit's pickled function, so the emitted file needs no Python driver.
"""

from __future__ import annotations

import functools
import shlex
import sys
from pathlib import Path

from submitit.slurm.slurm import _make_sbatch_string

from nanotrain.config import Config, SlurmLayout
from nanotrain.config.validate_slurm import max_excluded_nodes, node_range
from nanotrain.runtime import exclusions, slurm_commands


def job_folder(run_dir: Path) -> Path:
    """Where SLURM writes the job's stdout/stderr (`%j` = job id, `%t` = task rank)."""
    return run_dir / "job"


def setup_lines(config: Config) -> list[str]:
    """Shell run by the batch script before srun; values are quoted so none can inject shell."""
    s = config.slurm
    lines = list(s.setup)
    env = dict(s.env)
    env.setdefault("OMP_NUM_THREADS", str(s.cpus_per_task))  # torch would use every core per task
    if s.signal != "USR2":
        env["SUBMITIT_PREEMPT_SIGNAL"] = s.signal  # submitit's handler listens for this signal
    lines += [f"export {key}={shlex.quote(value)}" for key, value in env.items()]
    lines += node_range_lines(config)
    return lines


def node_range_lines(config: Config) -> list[str]:
    """slurm.nodes 'min-max': srun's task count from the nodes this allocation has. A requeued
    job's batch environment keeps the task count of its first allocation (SLURM_NTASKS=8 on the
    one node of a requeue after two), and srun would start that many tasks; each incarnation
    derives it again (ints only: no value of the user's reaches this line)."""
    bounds = node_range(config)
    if bounds is None or bounds[0] == bounds[1]:
        return []
    tasks = f"$((SLURM_JOB_NUM_NODES * {int(config.slurm.gpus_per_node or config.slurm.tasks_per_node or 1)}))"
    return [f"export SLURM_NTASKS={tasks} SLURM_NPROCS={tasks}"]


def executor_parameters(config: Config, layout: SlurmLayout, run_dir: Path | None = None) -> dict:
    """Keyword arguments of submitit's `SlurmExecutor.update_parameters` for this job; with
    ``run_dir`` (an existing run: `--resume`) its excluded nodes go to `--exclude`."""
    s = config.slurm
    params: dict = {
        "job_name": config.logging.run_name,
        "nodes": layout.nodes,
        "ntasks_per_node": layout.tasks_per_node,
        "cpus_per_task": s.cpus_per_task,
        "time": s.time,
        "signal_delay_s": s.signal_delay_s,
        "setup": setup_lines(config),
        # One failed rank must end the whole step at once instead of leaving the others hanging
        # in a collective until the time limit. srun of Slurm 22.05 - 23.02 does not inherit
        # --cpus-per-task from the allocation: without it each rank is bound to one core, where
        # its NCCL proxy threads, data pinning and OMP_NUM_THREADS threads would all compete.
        "srun_args": ["--kill-on-bad-exit=1", f"--cpus-per-task={s.cpus_per_task}"],
        "stderr_to_stdout": False,
    }
    if layout.gpus_per_node:
        params["gpus_per_node"] = layout.gpus_per_node
    if s.mem_gb is not None:
        whole = float(s.mem_gb).is_integer() and s.mem_gb >= 1
        params["mem"] = f"{int(s.mem_gb)}G" if whole else f"{max(1, round(s.mem_gb * 1024))}M"
    for name in ("partition", "account", "qos", "constraint"):
        if getattr(s, name) is not None:
            params[name] = getattr(s, name)
    if s.exclusive:
        params["exclusive"] = True
    extra: dict = dict(s.sbatch_extra)
    extra["requeue"] = True  # preemption/time-limit saves requeue the job (off on some clusters)
    if s.signal != "USR2":  # submitit always renders USR2; the configured signal replaces it
        extra["signal"] = f"{s.signal}@{s.signal_delay_s}"
    if layout.min_nodes is not None:  # slurm.nodes 'min-max': replaces the --nodes line; submitit's
        extra["nodes"] = layout.nodes_text  # own `nodes` stays an int (it multiplies it into a task count)
    # --- node exclusion: the nodes the run excludes stay excluded when it is resumed ---
    excluded = exclusions.excluded(run_dir, max_excluded_nodes(config)) if run_dir is not None else []
    if excluded:
        extra["exclude"] = ",".join(([extra["exclude"]] if extra.get("exclude") else []) + excluded)
    # --- end of node exclusion ---
    if extra:
        params["additional_parameters"] = extra
    return params


def side_job_parameters(config: Config, job_name: str, resources, setup: list[str]) -> dict:
    """A one-task, one-node job beside the training (`slurm.prepare`, `checkpoints.eval_job`):
    ``resources``' cpus, time, memory and partition (else the training's), the training's account
    and qos, and its setup lines followed by ``setup``."""
    s = config.slurm
    params: dict = {
        "job_name": job_name,
        "nodes": 1,
        "ntasks_per_node": 1,
        "cpus_per_task": resources.cpus,
        "time": resources.time,
        "stderr_to_stdout": False,
        "setup": setup_lines(config) + setup,
    }
    partition = resources.partition or s.partition
    if partition is not None:
        params["partition"] = partition
    for name in ("account", "qos"):
        if getattr(s, name) is not None:
            params[name] = getattr(s, name)
    if resources.mem_gb is not None:
        params["mem"] = f"{max(1, round(resources.mem_gb * 1024))}M"
    return params


def submitit_command(run_dir: Path) -> str:
    """The command line submitit's executor puts in the script (it runs the pickled task)."""
    return f"{shlex.quote(sys.executable)} -u -m submitit.core._submit {shlex.quote(str(job_folder(run_dir)))}"


def task_command(config_path: Path) -> str:
    """The command of a standalone script: every srun task runs the nanotrain task entry."""
    return f"{shlex.quote(sys.executable)} -u -m nanotrain.runtime.task {shlex.quote(str(config_path))}"


def render_sbatch(config: Config, layout: SlurmLayout, run_dir: Path, command: str) -> str:
    params = executor_parameters(config, layout, run_dir)
    return _make_sbatch_string(command=command, folder=str(job_folder(run_dir)), **params)


@functools.lru_cache(maxsize=1)
def cluster_partitions() -> tuple[str, ...] | None:
    """The partitions of the SLURM cluster here, or None when there is no `sinfo` to ask."""
    out = slurm_commands.answer(["sinfo", "-h", "-o", "%P"])
    if out is None:
        return None
    return tuple(sorted({p.strip().rstrip("*") for p in out.split() if p.strip()}))


def partition_problem(config: Config) -> str | None:
    """Why this cluster's sbatch would refuse `slurm.partition`, or None (also when no `sinfo`).

    A submission makes it an error before anything is written or queued (sbatch itself would
    refuse it only after the run directory and the pickled job exist); --dry-run a warning, since
    a plan may be meant for another cluster."""
    wanted = config.slurm.partition
    known = cluster_partitions() if wanted is not None else None
    if not known:
        return None
    missing = [p for p in wanted.split(",") if p not in known]
    if not missing:
        return None
    return (
        f"slurm.partition: {missing[0]!r} is not a partition of this cluster "
        f"(sinfo lists: {', '.join(known)}): choose one of them"
    )


def sbatch_error(detail: str) -> str:
    """The one informative line of sbatch's (possibly multi-line) refusal."""
    lines = [line.strip() for line in detail.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    if errors:
        return errors[-1]  # "Batch job submission failed: ..." comes last
    return lines[0] if lines else "(no message)"  # getopt's complaint, before "Try sbatch --help"
