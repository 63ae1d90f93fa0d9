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
from nanotrain.launch.rundir import run_dir_of, write_run_dir


EXIT_STOPPED = 75  # EX_TEMPFAIL: preempted and saved, but not requeued; resume with --resume


def run_task(config_path: str) -> dict:
    config = load_config(config_path)
    validate(config)
    # First thing: a stop signal that arrives while torch imports must set the flag, not kill us.
    from nanotrain.launch.preemption import PreemptionHandler

    preemption = PreemptionHandler(config.slurm.signal)
    export_user_env(config.slurm.env)
    env = setup_distributed_env()
    check_world_size(config, env.world_size, f"this {env.launcher} job")
    run_dir = run_dir_of(config)
    if env.rank == 0 and not (run_dir / "config.yaml").is_file():
        write_run_dir(config, run_dir)  # an emitted script's first run creates its run directory

    # Before any process group exists: importing the model pulls in torch._dynamo, whose import
    # takes references to an existing default group that are only dropped at interpreter exit.
    from nanotrain.launch.smoke import smoke_step
    from nanotrain.parallel.context import ParallelContext
    from nanotrain.trainer import DistributedTrainer

    p = config.parallelism
    pc = ParallelContext(tensor_parallel_size=p.tp, pipeline_parallel_size=p.pp,
                         data_parallel_size=p.dp, context_parallel_size=p.cp,
                         expert_parallel_size=p.ep)
    finished = False
    try:
        report = smoke_step(pc, env, Path(run_dir))  # a cheap preflight: every group answers
        report["outcome"] = _train(DistributedTrainer(config, Path(run_dir), env, pc, preemption))
        finished = True
    finally:
        # Groups go before the interpreter does (see ParallelContext.destroy); the barrier only
        # when every rank got here the normal way, since a failed rank's peers may never arrive.
        pc.destroy(synchronize=finished)
        # Never restore submitit's handler (it would fail a finished job on a late time-limit
        # signal) nor let Python's shutdown restore the default action (it would kill us).
        preemption.ignore_from_now_on()
    if report["outcome"] == "stopped":  # saved, but SLURM will not requeue it: not COMPLETED
        raise SystemExit(EXIT_STOPPED)
    return report


def _train(trainer) -> str:
    """Train, close and drop ``trainer``; returns the outcome. Handed over rather than kept in
    ``run_task``'s frame, so that everything it holds on to a process group (model, gradient
    sync, optimizer, pipeline engine) is freed before ``pc.destroy()`` checks that no group
    outlives its destruction."""
    try:
        return trainer.train()
    finally:
        trainer.close()


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
