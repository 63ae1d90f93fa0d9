"""The per-process entry point of every job: `python -m nanotrain.launch.task CONFIG`.

The same function runs under submitit (pickled), an emitted sbatch script, torchrun, and the
local launcher, so the four launch paths differ only in how the environment is mapped.
"""
from __future__ import annotations

import sys
from pathlib import Path

import submitit.helpers

from nanotrain.config import ConfigError, check_world_size, load_config, validate
from nanotrain.launch.env import export_user_env, setup_distributed_env
from nanotrain.launch.preemption import PreemptionHandler, request_requeue
from nanotrain.launch.rundir import resolve_run, write_run_dir

EXIT_STOPPED = 75  # EX_TEMPFAIL: preempted and saved, but not requeued; resume with --resume


def run_task(config_path: str) -> dict:
    config = load_config(config_path)
    validate(config)
    # First thing: a stop signal that arrives while torch imports must set the flag, not kill us.
    preemption = PreemptionHandler(config.slurm.signal)
    export_user_env(config.slurm.env)
    env = setup_distributed_env()
    check_world_size(config, env.world_size, f"this {env.launcher} job")
    if config.logging.run_name is None:  # a config handed to the task directly (torchrun, a GPU
        config.logging.run_name = Path(config_path).stem  # check): a name every rank derives alike
    run_dir = resolve_run(config, config_path)  # absolute paths, checkpoints.path defaulted
    if env.rank == 0 and not (run_dir / "config.yaml").is_file():
        write_run_dir(config, run_dir)  # an emitted script's first run creates its run directory

    # Imported only now, with the stop handler installed: they import torch (seconds).
    from nanotrain.launch.smoke import smoke_step
    from nanotrain.parallel.context import ParallelContext
    from nanotrain.training.trainer import DistributedTrainer

    p = config.parallelism
    pc = ParallelContext(tensor_parallel_size=p.tp, pipeline_parallel_size=p.pp,
                         data_parallel_size=p.dp, context_parallel_size=p.cp,
                         expert_parallel_size=p.ep, timeout_s=config.training.collective_timeout_s)
    try:
        report = smoke_step(pc, env, Path(run_dir))  # a cheap preflight: every group answers
        trainer = DistributedTrainer(config, Path(run_dir), pc, lambda: preemption.received is not None)
        try:
            report["outcome"] = trainer.train()
        finally:
            trainer.close()
        if report["outcome"] == "preempted" and env.rank == 0:
            report["outcome"] = after_preemption(config, env, run_dir, trainer.step, preemption.received)
        if report["outcome"] == "stopped":  # saved, but SLURM will not requeue it: not COMPLETED
            raise SystemExit(EXIT_STOPPED)
        return report
    finally:
        pc.destroy()
        # Never restore submitit's handler (it would fail a finished job on a late time-limit
        # signal) nor let Python's shutdown restore the default action (it would kill us).
        preemption.ignore_from_now_on()


def after_preemption(config, env, run_dir, step: int, signal_name) -> str:
    """Rank 0, once every rank saved: say how to resume and, on SLURM, requeue the job. Returns
    "preempted", or "stopped" when SLURM will not run it again (requeue budget spent or refused):
    then the job must not look COMPLETED, and the task exits non-zero."""
    print(f"preempted at step {step} ({signal_name or 'signal on another rank'}): checkpoint saved; "
          f"resume with: python submit.py --resume {run_dir}", flush=True)
    if env.launcher == "slurm" and not request_requeue(config.slurm.max_requeues):
        return "stopped"
    return "preempted"


class TrainingTask(submitit.helpers.Checkpointable):
    """What `submit.py` hands to submitit: `run_task`, made requeue-able by submitit itself.

    Our own flag handler takes over the preemption signal as soon as `run_task` starts. A signal
    that lands earlier (while submitit unpickles the job and imports) reaches submitit's handler,
    which requeues a `Checkpointable`; nothing is lost since training has not begun.
    """

    def __call__(self, config_path: str) -> dict:
        return run_task(config_path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nanotrain.launch.task CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        run_task(args[0])
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
