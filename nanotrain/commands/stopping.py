"""Ending `submit.py` with one line when it is told to stop before any rank runs.

The entry point holds SIGTERM (with SIGUSR1/2) from its first line, so a stop that lands while
a local run starts is delivered to ranks that can save (entry.py, local.run_local). Held for the
whole command, it also meant that a command stuck while validating, writing or submitting (a
FIFO given as data, a hung `sinfo`) could only be ended by SIGKILL. So while the command checks,
writes and submits, SIGTERM ends it (`Terminated`, exit 128 + 15, one line, the run directory
undone where a refused submission would undo it), as Ctrl-C does (exit 130); once a local run is
about to start its ranks the hold is back, and a SIGTERM waits for their handlers as before.
"""

from __future__ import annotations

import contextlib
import signal
import threading

from nanotrain.config.cli_args import EXIT_INTERRUPTED

EXIT_TERMINATED = 128 + signal.SIGTERM


class Terminated(BaseException):
    """SIGTERM arrived while the command was checking, writing or submitting (a BaseException,
    like KeyboardInterrupt: no `except Exception` of the checks may swallow it)."""


def _terminate(_signum, _frame):
    raise Terminated()


@contextlib.contextmanager
def sigterm_ends_command():
    """Within the block SIGTERM raises Terminated (a SIGTERM held pending since start-up at once);
    after it, SIGTERM's previous action and the previous signal mask are back. Off the main
    thread (where no handler can be set) it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _terminate)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        signal.signal(signal.SIGTERM, previous)


def stop_line(stop: BaseException, what: str) -> tuple[str, int]:
    """The line and exit status for Ctrl-C (KeyboardInterrupt) or SIGTERM (Terminated); ``what``
    says what was (not) started."""
    if isinstance(stop, Terminated):
        return f"terminated: {what}", EXIT_TERMINATED
    return f"\ninterrupted: {what}", EXIT_INTERRUPTED
