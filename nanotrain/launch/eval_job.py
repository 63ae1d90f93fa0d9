"""Starting the evaluation of one committed checkpoint (``checkpoints.eval_job``):

    python -m nanotrain.launch.eval_job RUN_DIR STEP [--local]

The training job's rank 0 starts this as a child process after each commit and does not wait
for it (``runtime/eval_jobs.py``). On SLURM it submits one small job through submitit, with the
``checkpoints.eval_job`` resources (one task: ``cpus``, ``gpus``, ``time``, ``mem_gb``, the
``partition`` or ``slurm.partition``; ``slurm.account``, ``qos`` and ``setup`` as the training
job's), whose task (``runtime/eval_task.EvalTask``) evaluates the checkpoint; the record gets
the job id, or ``not submitted`` with sbatch's line. With ``--local`` (a ``--local`` training
run) it evaluates the checkpoint itself, in this process. Either way nothing here can reach the
training: a separate process, whose failure only its record and log tell.

Why a child process and not a call: sbatch can hang or be slow, submitit's executor and (local)
the evaluation's model and data must not share the training rank's memory or threads, and it
works alike under every launch path (submitit, an emitted script, the local launcher).
"""

from __future__ import annotations

import sys
from pathlib import Path

from nanotrain.config import Config
from nanotrain.launch import sbatch
from nanotrain.launch.submission import SubmitRefused, submit
from nanotrain.runtime import eval_record
from nanotrain.runtime.eval_task import EvalTask, run_config, run_recorded


def job_folder(run_dir: Path) -> Path:
    """The evaluation jobs' submitit folder (stdout, stderr, pickles), apart from the training's."""
    return eval_record.eval_dir(run_dir) / "job"


def executor_parameters(config: Config, step: int) -> dict:
    """One task on one node with the `checkpoints.eval_job` resources; the training job's setup."""
    e = config.checkpoints.eval_job
    name = f"{config.logging.run_name}-eval-{step}"
    params = sbatch.side_job_parameters(config, name, e, [f"export OMP_NUM_THREADS={e.cpus}"])
    if e.gpus:
        params["gpus_per_node"] = e.gpus
    return params


def describe(config: Config, local: bool) -> str:
    """`--dry-run`'s line for `checkpoints.eval_job`."""
    if local:
        return "eval job: after each checkpoint, a process beside the ranks evaluates it (--local)"
    e = config.checkpoints.eval_job
    partition = e.partition or config.slurm.partition or "the default partition"
    gpus = f", {e.gpus} GPU(s)" if e.gpus else ""
    return f"eval job: after each checkpoint, 1 task x {e.cpus} cpus{gpus}, {e.time} min, on {partition}"


def submit_eval_job(run_dir: Path, step: int) -> int:
    """Submit the evaluation job of ``step``; 0 once queued, 1 when sbatch refused it (recorded)."""
    config = run_config(run_dir)
    try:
        job = submit(
            job_folder(run_dir),
            0,
            executor_parameters(config, step),
            EvalTask(),
            str(run_dir),
            step,
            what="the evaluation job",
        )
    except SubmitRefused as exc:
        eval_record.update_record(run_dir, step, state="not submitted", error=str(exc))
        print(f"error: step {step}: {exc}", file=sys.stderr, flush=True)
        return 1
    eval_record.update_record(
        run_dir,
        step,
        only_if_state=("submitting",),
        state="queued",
        job_id=str(job.job_id),
        launcher="slurm",
        log=str(job.paths.stdout),
    )
    print(f"step {step}: submitted evaluation job {job.job_id} (log {job.paths.stdout})", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    local = "--local" in args
    args = [a for a in args if a != "--local"]
    if len(args) != 2 or not args[1].isdigit():
        print("usage: python -m nanotrain.launch.eval_job RUN_DIR STEP [--local]", file=sys.stderr)
        return 2
    run_dir, step = Path(args[0]), int(args[1])
    if not local:
        return submit_eval_job(run_dir, step)
    try:
        run_recorded(run_dir, step, "local")
    except Exception as exc:  # recorded as failed; the log keeps the line
        print(f"error: step {step}: {' '.join(str(exc).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
