"""The per-process entry point of every job: `python -m nanotrain.runtime.task CONFIG`.

The same function runs under submitit (pickled), an emitted sbatch script, torchrun, and the
local launcher, so the four launch paths differ only in how the environment is mapped. The task,
not the trainer, decides what an ending means: exit codes, requeue or not, one-line errors.

    0   completed, or stopped and saved (preempted and requeued; locally: any stop signal)
    2   a user error found inside a rank (data, a checkpoint of another model or run, a run
        directory in use): one `error:` line, from the rank that found it
    3   training diverged (non-finite loss or grad norm): nothing saved after the last finite step
    4   the job hung: a rank's step did not advance for training.collective_timeout_s (or a
        collective failed because a peer never answered); reports in <run>/hang/rank-R.json,
        `submit.py --status` names the culprit. On SLURM it is requeued like a node failure
        (from the last complete checkpoint, while slurm.max_requeues allows)
    75  stopped and saved, but not requeued (a user's scancel, or the requeue budget is spent)
"""
from __future__ import annotations

# Stop signals first: the handler's module is standard library only, and under
# `python -m nanotrain.runtime.task` a signal during the imports below (submitit, then torch:
# seconds) would otherwise kill the task.
from nanotrain.runtime.preemption import (
    SIGNAL_STOP,
    PreemptionHandler,
    classify_sigterm,
    request_requeue,
    unblock_stop_signals,
)

_EARLY = PreemptionHandler.early() if __name__ == "__main__" else None

import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import submitit.helpers  # noqa: E402

from nanotrain.config import ConfigError, check_world_size, load_config, validate  # noqa: E402
from nanotrain.config.cli_args import EXIT_USER_ERROR  # noqa: E402
from nanotrain.runtime import ownership  # noqa: E402
from nanotrain.runtime.env import export_user_env, setup_distributed_env  # noqa: E402
from nanotrain.runtime.hang_status import requeue_marker  # noqa: E402
from nanotrain.runtime.rundir import resolve_run, write_run_dir  # noqa: E402

EXIT_DIVERGED = 3
EXIT_STOPPED = 75  # EX_TEMPFAIL: saved, but not requeued; resume with --resume


def run_task(config_path: str, preemption: PreemptionHandler | None = None) -> dict:
    """One rank's whole job from its resolved config: environment, process groups, ownership,
    the smoke step, training, and on a stop the save and the requeue decision (rank 0).

    Args:
        config_path: the run's ``config.yaml`` (or any config: torchrun, a direct run).
        preemption: the stop-signal handler installed before torch was imported (default: one
            installed now).

    Returns:
        The smoke step's report with ``outcome``: "completed", or "preempted" (saved; on SLURM
        requeued by rank 0).

    Raises:
        ConfigError: the config is invalid or does not match the world size.
        SystemExit: 2 for a user error only a rank can find (data, checkpoint, ownership; one
            ``error:`` line), 3 when training diverged, 4 for a hang, 75 when stopped and saved
            but not requeued.
    """
    preemption = preemption or PreemptionHandler.early()
    unblock_stop_signals()  # the local launcher holds them blocked until this handler exists
    config = load_config(config_path)
    validate(config)
    preemption.use(config.slurm.signal)
    export_user_env(config.slurm.env)
    env = setup_distributed_env()
    check_world_size(config, env.world_size, f"this {env.launcher} job")
    if config.logging.run_name is None:  # a config handed to the task directly (torchrun, a GPU
        config.logging.run_name = Path(config_path).stem  # check): a name every rank derives alike
    run_dir = resolve_run(config, config_path)  # absolute paths, checkpoints.path defaulted
    if env.rank == 0 and not (run_dir / "config.yaml").is_file():
        write_run_dir(config, run_dir)  # an emitted script's first run creates its run directory
    if env.launcher == "slurm" and env.rank == 0:
        preemption.act_before_training(lambda: _requeue_during_startup(config))

    from nanotrain.checkpoint import CheckpointMismatch
    from nanotrain.checkpoint.comm import World
    from nanotrain.data import DataError
    from nanotrain.parallel.hang_record import HANG_RECORD

    # Imported only now, with the stop handler installed (they import torch: seconds), and before
    # any process group exists: importing the model pulls in torch._dynamo, whose import takes
    # references to an existing default group that are only dropped at interpreter exit.
    from nanotrain.runtime.hang import EXIT_HUNG, HangWatchdog, is_comm_failure, is_timeout, nccl_debug_env
    from nanotrain.runtime.smoke import smoke_step
    from nanotrain.training.builder import build_parallel_context, hang_timeouts
    from nanotrain.training.stop_vote import TrainingDiverged
    from nanotrain.training.trainer import DistributedTrainer

    nccl_debug_env(run_dir)  # NCCL's flight recorder (the hang reports' dump) and its own dump
    pc = build_parallel_context(config)  # its groups time out after the watchdog (hang_timeouts)
    claim, finished = None, False
    watchdog_s, _ = hang_timeouts(config.training.collective_timeout_s)
    watchdog = HangWatchdog(run_dir, env.rank, env.world_size, watchdog_s,
                            on_hang=lambda: _after_hang(config, env, run_dir)).start()
    try:
        checkpoint_dir = Path(config.checkpoints.path or run_dir / "checkpoints")
        claim = ownership.claim(run_dir, checkpoint_dir, env.rank == 0, World(pc).broadcast)
        for note in claim.notes if env.rank == 0 else []:
            print(f"warning: {note}", file=sys.stderr, flush=True)
        report = smoke_step(pc, env, Path(run_dir))  # a cheap preflight: every group answers
        trainer = DistributedTrainer(config, Path(run_dir), pc, preemption.poll, run_id=claim.run_id)
        report["outcome"], step, stop_code = _train(trainer)
        del trainer  # _train dropped what it holds; nothing here may keep a group alive
        if report["outcome"] == "preempted" and env.rank == 0:
            report["outcome"] = decide_stop(step, stop_code, config, env, run_dir, preemption)
        finished = True
    except (DataError, CheckpointMismatch, ownership.OwnershipError) as exc:
        # A user's mistake that only a rank could find: one line, no traceback. Errors every rank
        # finds together are said once, by rank 0; a data error by the rank that read the data.
        if env.rank == 0 or isinstance(exc, DataError):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    except TrainingDiverged as exc:
        if env.rank == 0:
            from nanotrain.checkpoint import read_latest

            latest = read_latest(Path(config.checkpoints.path))
            kept = f"latest checkpoint {latest} is untouched" if latest else "no checkpoint was written"
            print(f"error: {exc}; {kept}; resume from it with other settings (e.g. a lower optimizer.lr): "
                  f"python submit.py --resume {run_dir} --set ...", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_DIVERGED) from None
    except Exception as exc:
        if not (HANG_RECORD.armed and is_comm_failure(exc)):
            raise
        # A peer never answered (or went away) during training: a hang, reported like the
        # watchdog's (whichever comes first writes this rank's report).
        watchdog.report_failure(exc)
        if is_timeout(exc):  # a peer that went away (a crash: its own error) is not requeued here
            _after_hang(config, env, run_dir)
        traceback.clear_frames(exc.__traceback__)  # its frames hold process groups: let them go
        raise SystemExit(EXIT_HUNG) from None
    finally:
        watchdog.stop()
        HANG_RECORD.disarm()
        if claim is not None:
            claim.release()
        # Groups go before the interpreter does (see ParallelContext.destroy); the barrier only
        # when every rank got here the normal way, since a failed rank's peers may never arrive.
        pc.destroy(synchronize=finished)
        # Never restore submitit's handler (it would fail a finished job on a late time-limit
        # signal) nor let Python's shutdown restore the default action (it would kill us).
        preemption.ignore_from_now_on()
    if report["outcome"] in ("stopped", "cancelled"):  # saved, not requeued: not COMPLETED
        raise SystemExit(EXIT_STOPPED)
    return report


def _train(trainer) -> tuple[str, int, int]:
    """Train and close ``trainer``; returns (outcome, last step, agreed stop code). The caller
    drops its own reference right after, so that everything the trainer holds on to a process
    group (model, gradient sync, optimizer, pipeline engine) is freed before ``pc.destroy()``
    checks that no group outlives its destruction."""
    try:
        outcome = trainer.train()
        return outcome, trainer.step, trainer.stop_code
    finally:
        trainer.close()


def _after_hang(config, env, run_dir: Path) -> None:
    """On SLURM a hang counts like a node failure: requeue (from the last complete checkpoint)
    while ``slurm.max_requeues`` allows. Every hung rank gets here; the first to create the
    incarnation's marker file (shared run directory) asks, so one request goes out per hang."""
    if env.launcher != "slurm":
        return
    marker = requeue_marker(run_dir, env.job_id, env.restart_count)
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    except OSError as exc:
        print(f"hang: cannot create {marker} ({exc}); requeueing anyway", file=sys.stderr, flush=True)
    else:
        os.close(fd)
    print(f"hang: rank {env.rank} requeues job {env.job_id} from its last complete checkpoint", flush=True)
    request_requeue(config.slurm.max_requeues)


def _requeue_during_startup(config) -> None:
    """Rank 0, inside the signal handler: SLURM's warning came before the first step (nothing to
    save). Requeue now; SLURM then ends every task of this incarnation and starts the next."""
    print(f"preemption: SIG{config.slurm.signal} during start-up, before any step: nothing to save, "
          "requeueing now", flush=True)
    request_requeue(config.slurm.max_requeues)


def decide_stop(step: int, stop_code: int, config, env, run_dir: Path, preemption: PreemptionHandler) -> str:
    """Rank 0, after every rank saved: "preempted" (requeued, or local), "cancelled" (a user's
    scancel: no requeue) or "stopped" (SLURM will not run it again). Why SIGTERM needs the
    scheduler's word: see `preemption.py`."""
    saved = ("checkpoint saved" if config.checkpoints.save_on_preemption
             else "not saved (checkpoints.save_on_preemption: false)")
    resume = f"resume with: python submit.py --resume {run_dir}"
    received = preemption.received or "signal on another rank"
    if env.launcher != "slurm":
        print(f"preempted at step {step} ({received}): {saved}; {resume}", flush=True)
        return "preempted"
    if stop_code == SIGNAL_STOP:
        kind, why = "preempted", f"slurm.signal SIG{config.slurm.signal}"
    else:
        kind, why = classify_sigterm(str(env.job_id), env.restart_count)
    if kind == "cancelled":
        print(f"cancelled at step {step} (SIGTERM, a user's scancel: {why}): {saved}; not requeued; "
              f"{resume}", flush=True)
        return "cancelled"
    print(f"preempted at step {step} ({received}, {kind}: {why}): {saved}; {resume}", flush=True)
    return "preempted" if request_requeue(config.slurm.max_requeues) else "stopped"


class TrainingTask(submitit.helpers.Checkpointable):
    """What `submit.py` hands to submitit: `run_task`, made requeue-able by submitit itself.

    Our own flag handler takes over the preemption signal as soon as `run_task` starts. A signal
    that lands earlier (while submitit unpickles the job and imports) reaches submitit's handler,
    which requeues a `Checkpointable`; nothing is lost since training has not begun.
    """

    def __call__(self, config_path: str) -> dict:
        return run_task(config_path)


def main(argv: list[str] | None = None) -> int:
    """``python -m nanotrain.runtime.task CONFIG.yaml``: ``run_task``; returns 0, or 2 for a usage
    or config error (one ``error:`` line). Other exits are ``run_task``'s ``SystemExit``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nanotrain.runtime.task CONFIG.yaml", file=sys.stderr)
        return 2
    try:
        run_task(args[0], _EARLY)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
