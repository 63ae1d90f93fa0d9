"""The stop-signal handler in this process, with real signals (the SLURM paths that use it are in
test_slurm_preemption.py / test_slurm_cancel.py)."""

from __future__ import annotations

import os
import signal

from nanotrain.runtime.preemption import NO_STOP, SIGNAL_STOP, TERM_STOP, PreemptionHandler


def test_signal_before_training_acts_at_once_and_only_then():
    """SLURM's warning during start-up (before the trainer's first poll) runs the requeue action in
    the handler itself; once the trainer polls, a signal is only recorded for its vote."""
    handler = PreemptionHandler("USR2")
    calls = []
    try:
        handler.act_before_training(lambda: calls.append("requeue"))
        os.kill(os.getpid(), signal.SIGTERM)  # not the configured signal: recorded only
        assert calls == [] and handler.code == TERM_STOP
        os.kill(os.getpid(), signal.SIGUSR2)
        assert calls == ["requeue"] and handler.code == SIGNAL_STOP
        os.kill(os.getpid(), signal.SIGUSR2)  # the action runs once
        assert calls == ["requeue"]
    finally:
        handler.restore()


def test_after_the_first_poll_the_vote_decides():
    handler = PreemptionHandler("USR1")
    calls = []
    try:
        handler.act_before_training(lambda: calls.append("requeue"))
        assert handler.poll() == NO_STOP
        os.kill(os.getpid(), signal.SIGUSR1)
        assert calls == [] and handler.poll() == SIGNAL_STOP
    finally:
        handler.restore()
