"""How a rank ends, in one place: the exit code, the one-line errors, requeue or not, and the
order in which what the rank holds is let go.

``ending(...)`` wraps the rank's work after its process groups exist (``runtime/rank.py``):

* a normal end: rank 0 decides what a stop means (``decide_stop``: requeued, cancelled or
  stopped); a stop that was saved but will not be requeued exits ``EXIT_STOPPED``;
* a user's mistake only a rank could find (data, a checkpoint of another model or run, a run
  directory in use): one ``error:`` line, ``EXIT_USER_ERROR``;
* divergence: one line naming the checkpoint left untouched, ``EXIT_DIVERGED``;
* a collective that failed because a peer never answered, while training: a hang, reported as
  the watchdog would, ``EXIT_HUNG`` (and on SLURM requeued like a node failure, without the
  culprit's node: ``exclude_culprit_node``);
* always, in this order: the watchdog stops, the hang record is disarmed, the ownership claim
  is released, the process groups are destroyed (with a barrier only when every rank got here
  the normal way), and stop signals are ignored from then on.

The exit codes are listed in ``runtime/task.py``. Imports torch: imported by a rank once its stop
handler exists and before its process groups do (``runtime/rank.py``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

from nanotrain.checkpoint import CheckpointMismatch, read_latest
from nanotrain.config.cli_args import EXIT_USER_ERROR
from nanotrain.config.validate_slurm import max_excluded_nodes
from nanotrain.data import DataError
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.runtime import exclusions
from nanotrain.runtime.hang import EXIT_HUNG, HangWatchdog, is_comm_failure, is_timeout
from nanotrain.runtime.hang_status import find_culprit, read_reports, requeue_marker
from nanotrain.runtime.ownership import Claim, OwnershipError
from nanotrain.runtime.preemption import (
    SIGNAL_STOP,
    PreemptionHandler,
    classify_sigterm,
    request_requeue,
    requeue_min_nodes,
)
from nanotrain.training.builder import hang_timeouts
from nanotrain.training.outcome import Outcome
from nanotrain.training.stop_vote import TrainingDiverged

EXIT_DIVERGED = 3
EXIT_STOPPED = 75  # EX_TEMPFAIL: saved, but not requeued; resume with --resume


@dataclass
class Ending:
    """What the rank's work tells its ending: the claim to release, and how training ended."""

    claim: Optional[Claim] = None
    outcome: Optional[Outcome] = None
    step: int = 0
    stop_code: int = 0  # the stop request all ranks agreed on (runtime.preemption codes)


def hang_watchdog(config, env, run_dir: Path) -> HangWatchdog:
    """This rank's hang watchdog, started: it fires before the process groups time out
    (``hang_timeouts``) and, on SLURM, requeues the job as ``after_hang`` does."""
    watchdog_s, _ = hang_timeouts(config.training.collective_timeout_s)
    return HangWatchdog(
        run_dir, env.rank, env.world_size, watchdog_s, on_hang=lambda: after_hang(config, env, run_dir)
    ).start()


@contextlib.contextmanager
def ending(config, env, run_dir: Path, pc, watchdog: HangWatchdog, preemption: PreemptionHandler) -> Iterator[Ending]:
    """The rank's ending around its work (see the module docstring); the work fills in the
    ``Ending`` it yields. Raises SystemExit with the exit code of any end but a normal one."""
    end, finished = Ending(), False
    try:
        yield end
        if end.outcome == Outcome.PREEMPTED and env.rank == 0:
            end.outcome = decide_stop(end.step, end.stop_code, config, env, run_dir, preemption)
        finished = True
    except (DataError, CheckpointMismatch, OwnershipError) as exc:
        # Errors every rank finds together are said once, by rank 0; a data error by the rank
        # that read the data.
        if env.rank == 0 or isinstance(exc, DataError):
            print(f"error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(EXIT_USER_ERROR) from None
    except TrainingDiverged as exc:
        if env.rank == 0:
            latest = read_latest(Path(config.checkpoints.path))
            kept = f"latest checkpoint {latest} is untouched" if latest else "no checkpoint was written"
            print(
                f"error: {exc}; {kept}; resume from it with other settings (e.g. a lower optimizer.lr): "
                f"python submit.py --resume {run_dir} --set ...",
                file=sys.stderr,
                flush=True,
            )
        raise SystemExit(EXIT_DIVERGED) from None
    except Exception as exc:
        if not (HANG_RECORD.armed and is_comm_failure(exc)):
            raise
        # A peer never answered (or went away) during training: a hang, reported like the
        # watchdog's (whichever comes first writes this rank's report).
        watchdog.report_failure(exc)
        if is_timeout(exc):  # a peer that went away (a crash: its own error) is not requeued here
            after_hang(config, env, run_dir)
        traceback.clear_frames(exc.__traceback__)  # its frames hold process groups: let them go
        raise SystemExit(EXIT_HUNG) from None
    finally:
        watchdog.stop()
        HANG_RECORD.disarm()
        if end.claim is not None:
            end.claim.release()
        # Groups go before the interpreter does (see ParallelContext.destroy); the barrier only
        # when every rank got here the normal way, since a failed rank's peers may never arrive.
        pc.destroy(synchronize=finished)
        # Never restore submitit's handler (it would fail a finished job on a late time-limit
        # signal) nor let Python's shutdown restore the default action (it would kill us).
        preemption.ignore_from_now_on()
    if end.outcome in (Outcome.STOPPED, Outcome.CANCELLED):  # saved, not requeued: not COMPLETED
        raise SystemExit(EXIT_STOPPED)


def decide_stop(step: int, stop_code: int, config, env, run_dir: Path, preemption: PreemptionHandler) -> Outcome:
    """Rank 0, after every rank saved: PREEMPTED (requeued, or local), CANCELLED (a user's
    scancel: no requeue) or STOPPED (SLURM will not run it again). Why SIGTERM needs the
    scheduler's word: see `preemption.py`."""
    saved = (
        "checkpoint saved"
        if config.checkpoints.save_on_preemption
        else "not saved (checkpoints.save_on_preemption: false)"
    )
    resume = f"resume with: python submit.py --resume {run_dir}"
    received = preemption.received or "signal on another rank"
    if env.launcher != "slurm":
        print(f"preempted at step {step} ({received}): {saved}; {resume}", flush=True)
        return Outcome.PREEMPTED
    if stop_code == SIGNAL_STOP:
        kind, why = "preempted", f"slurm.signal SIG{config.slurm.signal}"
    else:
        kind, why = classify_sigterm(str(env.job_id), env.restart_count)
    if kind == "cancelled":
        print(
            f"cancelled at step {step} (SIGTERM, a user's scancel: {why}): {saved}; not requeued; {resume}", flush=True
        )
        return Outcome.CANCELLED
    print(f"preempted at step {step} ({received}, {kind}: {why}): {saved}; {resume}", flush=True)
    requeued = request_requeue(config.slurm.max_requeues, run_dir, max_excluded_nodes(config))
    return Outcome.PREEMPTED if requeued else Outcome.STOPPED


def after_hang(config, env, run_dir: Path) -> None:
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
    limit = max_excluded_nodes(config)
    if limit > 0:
        exclude_culprit_node(run_dir, env, limit, min_nodes=requeue_min_nodes())
    request_requeue(config.slurm.max_requeues, run_dir, limit)


HANG_SETTLE_S = 2.0  # how long the requeueing rank waits for its peers' reports (SLURM kills after KillWait)


def exclude_culprit_node(
    run_dir: Path, env, limit: int, settle_s: float = HANG_SETTLE_S, min_nodes: int | None = None
) -> None:
    """Exclude the hang's culprit rank's node (``exclusions.py``) once the reports name it.

    The peers' watchdogs fire within moments of each other, so this waits up to ``settle_s`` for
    every report but the culprit's (a stopped rank writes none) — all of them, or all but one
    with none new for half a second. Fewer than that: the culprit is unclear and no node is
    excluded. The ranks are being ended meanwhile (srun --kill-on-bad-exit): SIGTERM, which the
    stop handler takes, then SIGKILL after SLURM's KillWait (30 s by default, 5 s here)."""
    deadline = time.monotonic() + settle_s
    seen, changed = -1, time.monotonic()
    while True:
        reports = read_reports(run_dir)
        if len(reports) != seen:
            seen, changed = len(reports), time.monotonic()
        complete = seen >= env.world_size or (seen >= env.world_size - 1 and time.monotonic() - changed >= 0.5)
        if complete or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if seen < env.world_size - 1:
        print(f"hang: culprit unclear ({seen} of {env.world_size} reports): no node excluded", flush=True)
        return
    found = find_culprit(reports, run_dir)
    if not found or not found.get("node"):
        print("hang: the culprit's node is unknown: no node excluded", flush=True)
        return
    added, note = exclusions.add(
        run_dir,
        found["node"],
        "hang",
        f"rank {found['rank']} hung the job: {found['text']}",
        limit,
        env.job_id,
        env.restart_count,
    )
    print(f"hang: node {found['node']} of culprit rank {found['rank']}: {note}", flush=True)
    warning = exclusions.fit_warning(run_dir, limit, min_nodes=min_nodes) if added else None
    if warning:
        print(f"hang: warning: {warning}", flush=True)
