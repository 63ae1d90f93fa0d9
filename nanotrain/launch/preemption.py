"""Preemption and time limits: SLURM signals the job (`--signal=USR2@delay`) before killing it.

The handler only sets a flag: nothing collective can run inside a signal handler, and only some
ranks may receive the signal. The trainer polls the flag every step and the ranks vote on it with
one tiny all-reduce (MAX, `training/stop_vote.py`), so all ranks agree on the same step, save the
same checkpoint together, and exit. This module imports no torch, so the handler is in place
before the seconds of importing it. On SLURM, rank 0 then asks for a requeue (`scontrol requeue`, bounded by
`slurm.max_requeues`); the restarted job (`SLURM_RESTART_COUNT` > 0) resumes from the checkpoint.
This replaces submitit's own USR2 handler inside the task: submitit calls `checkpoint()` on rank 0
from the handler itself, where no collective sharded save is possible.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys


class PreemptionHandler:
    def __init__(self, signal_name: str = "USR2", also_sigterm: bool = True):
        self.received: str | None = None
        self._signals = [getattr(signal, f"SIG{signal_name}")]
        if also_sigterm and signal.SIGTERM not in self._signals:
            self._signals.append(signal.SIGTERM)  # SLURM's own TERM at the end; `kill` locally
        for sig in self._signals:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, _frame) -> None:
        self.received = signal.Signals(signum).name

    def ignore_from_now_on(self) -> None:
        """The work is saved or finished: a late stop signal must not kill the exiting process.
        (CPython resets Python-level handlers to the default action while it shuts down, so a
        time-limit signal landing then would end a finished task with "User defined signal 2".)"""
        for sig in self._signals:
            signal.signal(sig, signal.SIG_IGN)


def request_requeue(max_requeues: int) -> bool:
    """Requeue this SLURM job (rank 0 only); False when the budget is spent or not on SLURM."""
    job_id = os.environ.get("SLURM_JOB_ID")
    if job_id is None:
        return False
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0"))
    if restarts >= max_requeues:
        print(f"preemption: job {job_id} was already requeued {restarts} time(s) = slurm.max_requeues; "
              "not requeueing again", file=sys.stderr, flush=True)
        return False
    proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        print(f"preemption: scontrol requeue {job_id} failed: {proc.stderr.strip()}", file=sys.stderr, flush=True)
        return False
    print(f"preemption: requeued job {job_id} (restart {restarts + 1} of at most {max_requeues})", flush=True)
    return True
