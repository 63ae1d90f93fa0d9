"""One rank, from its config file to its ending: `run_rank`, whose body is the list of steps in
the order they happen.

Two constraints fix that order. Everything before the torch import is standard library and
`nanotrain.config` only, so it takes a fraction of a second: on SLURM the configured signal
requeues at once from the moment the config is read (`act_before_training`), however long the
imports and the build take. The modules that import torch come next, before any process group
exists: importing the model pulls in torch._dynamo, whose import takes references to an existing
default group that are only dropped at interpreter exit. (The stop handler itself is installed
before this module runs: `runtime/task.py`.)
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from nanotrain.config import Config, check_world_size, load_config, validate
from nanotrain.config.validate_slurm import max_excluded_nodes
from nanotrain.runtime import ownership
from nanotrain.runtime.env import DistEnv, export_user_env, setup_distributed_env
from nanotrain.runtime.preemption import PreemptionHandler, keep_node_range_on_requeue, request_requeue
from nanotrain.runtime.rundir import resolve_run, run_dir_of, write_run_dir


def run_rank(config_path: str, preemption: PreemptionHandler) -> dict:
    """Run this rank of the job ``config_path`` describes; returns its smoke report with the
    ``outcome``. Exit codes other than 0 leave as SystemExit (``runtime/ending.py``)."""
    config = read_config(config_path)
    preemption.use(config.slurm.signal)  # the configured stop signal and SIGTERM (the others: as before)
    env = rank_env(config.slurm.env)
    allocated = layout_for_allocation(config, env)  # slurm.nodes 'min-max': the layout of the nodes given
    check_world_size(allocated, env.world_size, f"this {env.launcher} job")
    run_dir = run_directory(config, config_path, env)  # the run keeps its own config (full size)
    config = with_layout(config, allocated)
    if env.launcher == "slurm" and env.rank == 0:  # a warning before the first step: nothing to save
        preemption.act_before_training(lambda: requeue_during_startup(config))

    # torch, and what is built on it: only now (see the module docstring)
    from nanotrain.checkpoint.comm import World
    from nanotrain.runtime.ending import ending, hang_watchdog
    from nanotrain.runtime.eval_jobs import EvalJobs
    from nanotrain.runtime.hang import nccl_debug_env
    from nanotrain.runtime.health import startup_health
    from nanotrain.runtime.smoke import smoke_step
    from nanotrain.training.builder import build_parallel_context, build_parts
    from nanotrain.training.outcome import Outcome
    from nanotrain.training.trainer import DistributedTrainer, train_and_close

    nccl_debug_env(run_dir)  # NCCL's flight recorder (the hang reports' dump) and its own dump
    pc = build_parallel_context(config)  # its groups time out after the watchdog (hang_timeouts)
    watchdog = hang_watchdog(config, env, run_dir)
    evals = EvalJobs(config, run_dir, env.launcher, env.rank)
    try:
        with ending(config, env, run_dir, pc, watchdog, preemption) as end:
            end.claim = claim_run(run_dir, Path(config.checkpoints.path), env, World(pc).broadcast)
            report = smoke_step(pc, env, run_dir)  # a cheap preflight: every group answers
            # slurm.health: a slow node is excluded and the job requeued before training
            health = startup_health(pc, config, env, run_dir, World(pc).broadcast)
            if health is not None and health["requeued"]:
                end.outcome = Outcome.REQUEUED
            else:
                parts = build_parts(config, pc, run_dir, run_id=end.claim.run_id)
                trainer = DistributedTrainer(parts, preemption.poll, evals)
                end.outcome, end.step, end.stop_code = train_and_close(trainer)
                del trainer, parts  # nothing here may keep a group alive when the ending destroys them
    finally:  # rank 0: the evaluations (locally) or submissions it started (checkpoints.eval_job)
        evals.wait()
    report["outcome"] = end.outcome
    return report


def read_config(config_path: str) -> Config:
    """The config, validated; a config handed to the task directly (torchrun, a GPU check) is
    named after its file, a name every rank derives alike."""
    config = load_config(config_path)
    validate(config)
    if config.logging.run_name is None:
        config.logging.run_name = Path(config_path).stem
    return config


def rank_env(user_env: dict) -> DistEnv:
    """``slurm.env`` (``user_env``) exported, then the launcher's variables mapped to torch's
    env:// ones."""
    export_user_env(user_env)
    return setup_distributed_env()


def layout_for_allocation(config: Config, env: DistEnv) -> Config:
    """The config this rank trains with: ``config`` itself, or, for a SLURM job with a node range
    (``slurm.nodes``), the layout for the nodes this allocation has (``estimate/resize.py``),
    which every rank derives alike from the config and ``SLURM_JOB_NUM_NODES``; rank 0 prints it
    in one line, and a requeue of the job gets the range back (``node_range.py``)."""
    if env.launcher != "slurm" or config.slurm.nodes is None:
        return config
    from nanotrain.config.validate_slurm import slurm_layout
    from nanotrain.estimate.resize import allocation_line, layout_for_nodes

    layout = slurm_layout(config)
    if layout.min_nodes is None:
        return config
    tasks = layout.min_nodes * layout.tasks_per_node
    keep_node_range_on_requeue(layout.nodes_text, tasks, tasks * config.slurm.cpus_per_task)
    chosen = layout_for_nodes(config, env.num_nodes)
    if env.rank == 0:
        print(allocation_line(config, chosen, env.num_nodes), flush=True)
    return chosen


def with_layout(config: Config, allocated: Config) -> Config:
    """``config`` (its paths resolved by ``run_directory``) at ``allocated``'s layout: the sections
    the planner chooses from (parallelism, training, optimizer) and its exact-count ``slurm``."""
    if allocated is config:
        return config
    return dataclasses.replace(
        config,
        parallelism=allocated.parallelism,
        training=allocated.training,
        optimizer=allocated.optimizer,
        slurm=allocated.slurm,
    )


def run_directory(config: Config, config_path: str, env: DistEnv) -> Path:
    """The run directory (absolute paths in ``config``, ``checkpoints.path`` set); rank 0 writes
    it when it is not there yet, as an emitted script's first run finds it."""
    run_dir = resolve_run(config, config_path)
    if env.rank == 0 and not (run_dir / "config.yaml").is_file():
        write_run_dir(config, run_dir)
    return Path(run_dir)


def claim_run(run_dir: Path, checkpoint_dir: Path, env: DistEnv, broadcast) -> ownership.Claim:
    """One owner per run and checkpoint directory (``ownership.py``): rank 0 takes the locks and
    says what it took over, every rank gets the run id (``broadcast``: rank 0's object to all)."""
    claim = ownership.claim(run_dir, checkpoint_dir, env.rank == 0, broadcast)
    for note in claim.notes if env.rank == 0 else []:
        print(f"warning: {note}", file=sys.stderr, flush=True)
    return claim


def requeue_during_startup(config: Config) -> None:
    """Rank 0, inside the signal handler: SLURM's warning came before the first step (nothing to
    save). Requeue now; SLURM then ends every task of this incarnation and starts the next."""
    print(
        f"preemption: SIG{config.slurm.signal} during start-up, before any step: nothing to save, requeueing now",
        flush=True,
    )
    request_requeue(config.slurm.max_requeues, run_dir_of(config), max_excluded_nodes(config))
