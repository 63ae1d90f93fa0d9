"""Stop signals: SLURM's preemption / time-limit signal, a user's `scancel`, a local `kill`.

The handler only sets a flag: nothing collective can run inside a signal handler, and only some
ranks may receive the signal. At each step boundary the trainer makes every rank agree on the
strongest flag (one tiny all-reduce, `training/stop_vote.py`), all ranks save the same checkpoint
together and return; the task (`ending.py`) then decides, on rank 0, what the stop means:

* the configured `slurm.signal` (USR2 by default; SLURM sends it before a time limit and, with
  `preempt_send_user_signal`, on preemption): requeue (`scontrol requeue`, bounded by
  `slurm.max_requeues`); the restarted job resumes from the checkpoint;
* SIGTERM alone: ambiguous, so the job's own record decides (`classify_sigterm`): `scancel` leaves
  the job CANCELLED (sacct) with its restart count unchanged and no reason; SLURM's preemption
  has already requeued it (scontrol's `Restarts` is above this incarnation's
  SLURM_RESTART_COUNT, sacct says PREEMPTED); a time limit shows `Reason=TimeLimit` (sacct
  TIMEOUT). Only the last two requeue; without evidence of either it is a user's stop — the safe
  side: a cancel that requeues runs a job the user ended, a preemption that does not requeue
  only needs `--resume`. (Slurm 22.05's answers; tests/test_slurm_cancel.py replays them.)

This module imports nothing but the standard library (and `slurm_commands`, which runs the
scheduler's commands with a bound and imports nothing else), so a task installs the handler
before it imports torch or submitit (a signal during those seconds would kill the process),
and the local launcher blocks the stop signals until its ranks have their handlers.
"""

from __future__ import annotations

import os
import re
import signal
import sys

from nanotrain.runtime import slurm_commands

STOP_SIGNALS = (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM)  # what a launcher forwards
NO_STOP, TERM_STOP, SIGNAL_STOP = 0, 1, 2  # agreed with MAX: the configured signal wins


def block_stop_signals() -> None:
    """Hold stop signals pending (children inherit the mask across exec) until a handler exists."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def unblock_stop_signals() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


class PreemptionHandler:
    """Records stop signals. `PreemptionHandler.early()` first thing, `.use(config.slurm.signal)`
    once the config is read (signals it does not use get their previous action back)."""

    def __init__(self, signal_name: str | None = "USR2", also_sigterm: bool = True):
        self.received: str | None = None  # the first stop signal's name
        self.names: set[str] = set()
        self._previous: dict = {}
        self._before_training = None  # see `act_before_training`
        self.use(signal_name, also_sigterm)

    @classmethod
    def early(cls) -> "PreemptionHandler":
        """Catch every possible stop signal before anything slow is imported."""
        return cls(None)

    def use(self, signal_name: str | None, also_sigterm: bool = True) -> "PreemptionHandler":
        """Handle `signal_name` (+ SIGTERM); None: every stop signal (until the config is read)."""
        self.signal_name = signal_name
        wanted = list(STOP_SIGNALS) if signal_name is None else [getattr(signal, f"SIG{signal_name}")]
        if also_sigterm and signal.SIGTERM not in wanted:
            wanted.append(signal.SIGTERM)  # scancel, SLURM's TERM at the end, `kill` locally
        for sig in wanted:
            if sig not in self._previous:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        for sig in [s for s in self._previous if s not in wanted]:
            signal.signal(sig, self._previous.pop(sig))
            self.names.discard(signal.Signals(sig).name.removeprefix("SIG"))
        self._signals = wanted
        return self

    def _on_signal(self, signum, _frame) -> None:
        name = signal.Signals(signum).name.removeprefix("SIG")
        self.names.add(name)
        self.received = self.received or f"SIG{name}"
        if name == self.signal_name and self._before_training is not None:
            action, self._before_training = self._before_training, None
            action()

    def act_before_training(self, action) -> None:
        """Run `action()` at once if the configured signal arrives before the trainer first polls
        (`poll`, at the end of the first step).

        Why: the trainer answers a stop at a step boundary, but start-up (imports, rendezvous,
        building the model, reading a checkpoint) can outlast the warning SLURM gives before a
        time limit, and the job would then end TIMEOUT, never requeued. Before the first step
        there is nothing to save, so rank 0 requeues right away."""
        self._before_training = action

    def poll(self) -> int:
        """`code`, for the trainer's step-boundary vote: from the first poll on, a stop is the vote's."""
        self._before_training = None
        return self.code

    @property
    def code(self) -> int:
        """What this rank received: SIGNAL_STOP (the configured signal), TERM_STOP, NO_STOP."""
        if self.signal_name in self.names:
            return SIGNAL_STOP
        return TERM_STOP if "TERM" in self.names else NO_STOP

    def ignore_from_now_on(self) -> None:
        """The work is saved or finished: a late stop signal must not kill the exiting process.
        (CPython resets Python-level handlers to the default action while it shuts down, so a
        time-limit signal landing then would end a finished task with "User defined signal 2".)"""
        for sig in self._signals:
            signal.signal(sig, signal.SIG_IGN)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def _run(argv: list[str]) -> str:
    return slurm_commands.answer(argv) or ""


def classify_sigterm(job_id: str, restart_count: int) -> tuple[str, str]:
    """("cancelled" | "preempted" | "timeout", the evidence) for a SIGTERM in SLURM job `job_id`."""
    fields = dict(re.findall(r"(?<![\w/])(\w+)=(\S*)", _run(["scontrol", "show", "job", job_id])))
    rows = [row for row in _run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"]).splitlines() if row.strip()]
    acct = rows[-1].split()[0] if rows else ""  # "CANCELLED by 0": the state is the first word
    state, reason, restarts = fields.get("JobState", ""), fields.get("Reason", ""), fields.get("Restarts", "")
    seen = f"scontrol JobState={state or '?'} Reason={reason or '?'} Restarts={restarts or '?'}, sacct {acct or '?'}"
    if reason == "TimeLimit" or "TIMEOUT" in (state, acct):
        return "timeout", seen
    if (restarts.isdigit() and int(restarts) > restart_count) or "PREEMPTED" in (state, acct):
        return "preempted", seen
    return "cancelled", seen


def requeued_by_slurm(job_id: str, restart_count: int) -> bool:
    """SLURM's own preemption (PreemptMode=REQUEUE) requeues before the TERM arrives."""
    match = re.search(r"Restarts=(\d+)", _run(["scontrol", "show", "job", job_id]))
    return bool(match) and int(match.group(1)) > restart_count


def request_requeue(max_requeues: int, run_dir=None, max_excluded: int = 0) -> bool:
    """Requeue this SLURM job (rank 0 only); False when the budget is spent or not on SLURM.

    ``run_dir`` and ``max_excluded`` (slurm.max_excluded_nodes): the nodes the run excludes
    (``exclusions.py``: health check, hangs, stragglers) that the job does not avoid yet are
    added to its ExcNodeList on the way (hold, update, release)."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return False
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        print(
            f"preemption: job {job_id} was already requeued {restarts} time(s) = slurm.max_requeues; "
            "not requeueing again",
            file=sys.stderr,
            flush=True,
        )
        return False
    # The exclusion record (``exclusions.py``) imports the config package: only here, after the
    # handler of this module has long been installed.
    from nanotrain.runtime import exclusions

    exclude = exclusions.to_exclude(run_dir, job_id, restarts, max_excluded) if run_dir is not None else []
    if requeued_by_slurm(job_id, restarts):
        print(f"preemption: SLURM requeued job {job_id} itself (restart {restarts + 1})", flush=True)
        _restore_node_range(job_id)
        if exclude:
            _, note = exclusions.requeue_excluding(job_id, exclude, already_requeued=True)
            exclusions.note_applied(run_dir, job_id, restarts + 1, exclude, note)
            print(f"preemption: job {job_id} now avoids {', '.join(exclude)}: {note}", flush=True)
        return True
    _restore_node_range(job_id)  # before the requeue: SLURM ends this process with the job
    if exclude:
        requeued, note = exclusions.requeue_excluding(job_id, exclude)
        if requeued:
            exclusions.note_applied(run_dir, job_id, restarts + 1, exclude, note)
        print(
            f"preemption: {'requeued' if requeued else 'could not requeue'} job {job_id} (restart {restarts + 1} "
            f"of at most {max_requeues}) avoiding {', '.join(exclude)}: {note}",
            flush=True,
        )
        return requeued
    try:
        proc = slurm_commands.run(["scontrol", "requeue", job_id])
    except slurm_commands.SlurmCommandError as exc:
        print(f"preemption: scontrol requeue {job_id} failed: {exc}", file=sys.stderr, flush=True)
        return False
    if proc.returncode != 0:
        print(f"preemption: scontrol requeue {job_id} failed: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    print(f"preemption: requeued job {job_id} (restart {restarts + 1} of at most {max_requeues})", flush=True)
    return True


# --- continue on another number of nodes: a requeued job gets its node range back ---
_NODE_RANGE: list[tuple[str, int, int]] = []  # slurm.nodes, its minimum's tasks and CPUs (set by the rank)


def keep_node_range_on_requeue(nodes: str, tasks: int, cpus: int) -> None:
    """This job was submitted with the node range ``nodes`` ('min-max') whose fewest nodes run
    ``tasks`` tasks on ``cpus`` CPUs: a requeue of it sets them back
    (``node_range.restore_after_requeue``)."""
    _NODE_RANGE[:] = [(nodes, tasks, cpus)]


def requeue_min_nodes() -> int | None:
    """The fewest nodes a requeue of this job may land on (its node range's minimum), or None
    for a job of a fixed node count."""
    return int(_NODE_RANGE[0][0].split("-")[0]) if _NODE_RANGE else None


def _restore_node_range(job_id: str) -> None:
    if _NODE_RANGE:
        from nanotrain.runtime.node_range import restore_after_requeue

        restore_after_requeue(job_id, *_NODE_RANGE[0])


# --- end: continue on another number of nodes ---
