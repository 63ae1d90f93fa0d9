"""The per-process entry point of every job: `python -m nanotrain.runtime.task CONFIG`.

The same function runs under submitit (pickled), an emitted sbatch script, torchrun, and the
local launcher, so the four launch paths differ only in how the environment is mapped. Here the
stop handler is installed first; `runtime/rank.py` then runs the rank step by step, and
`runtime/ending.py` — not the trainer — decides what its ending means: exit codes, requeue or
not, one-line errors:

    0   completed, or stopped and saved (preempted and requeued; locally: any stop signal), or
        requeued at start-up without a node that failed the health check (slurm.health)
    2   a user error found inside a rank (data, a checkpoint of another model or run, a run
        directory in use): one `error:` line, from the rank that found it
    3   training diverged (non-finite loss or grad norm): nothing saved after the last finite step
    4   the job hung: a rank's step did not advance for training.collective_timeout_s (or a
        collective failed because a peer never answered); reports in <run>/hang/rank-R.json,
        `submit.py --status` names the culprit. On SLURM it is requeued like a node failure
        (from the last complete checkpoint, while slurm.max_requeues allows), without the
        culprit's node while slurm.max_excluded_nodes allows
    75  stopped and saved, but not requeued (a user's scancel, or the requeue budget is spent)
"""

from __future__ import annotations

# Stop signals first: the handler's module is standard library only, and under
# `python -m nanotrain.runtime.task` a signal during the imports below (submitit, then torch:
# seconds) would otherwise kill the task.
from nanotrain.runtime.preemption import PreemptionHandler, unblock_stop_signals

_EARLY = PreemptionHandler.early() if __name__ == "__main__" else None

import sys  # noqa: E402

import submitit.helpers  # noqa: E402

from nanotrain.config import ConfigError  # noqa: E402
from nanotrain.runtime.rank import run_rank  # noqa: E402


def run_task(config_path: str, preemption: PreemptionHandler | None = None) -> dict:
    """One rank's whole job from its resolved config (``runtime/rank.py`` runs it step by step):
    environment, process groups, ownership, the smoke step, training, and on a stop the save and
    the requeue decision (rank 0).

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
    return run_rank(config_path, preemption)


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
