"""The one way the package runs a SLURM client command (sbatch, sinfo, squeue, sacct, scontrol,
scancel): bounded in time, its whole process tree ended when it does not answer.

A hung slurmctld makes every client command wait (sbatch retries for minutes, squeue blocks):
without a bound a launch, a `--status` or a rank's requeue request would hang with it. Each
command has its own bound (a submission or a requeue may legitimately take longer than a query);
`NANOTRAIN_SLURM_TIMEOUT_S` replaces all of them (a slow cluster, or a test of a hung command).
The command runs in its own session, so a timeout (or a Ctrl-C / SIGTERM of ours while it runs)
kills the command and anything it started, never leaving an orphan behind.

Standard library only: `preemption.py` uses it before torch is imported.
"""

from __future__ import annotations

import os
import signal
import subprocess

TIMEOUT_ENV = "NANOTRAIN_SLURM_TIMEOUT_S"
ACTION_TIMEOUT_S = 60.0  # sbatch, scontrol requeue, scancel: the controller acts, then answers
QUERY_TIMEOUT_S = 15.0  # sinfo, squeue, sacct, scontrol show: a read
TIMEOUTS_S = {
    "sbatch": ACTION_TIMEOUT_S,
    "scontrol": ACTION_TIMEOUT_S,
    "scancel": ACTION_TIMEOUT_S,
    "sinfo": QUERY_TIMEOUT_S,
    "squeue": QUERY_TIMEOUT_S,
    "sacct": QUERY_TIMEOUT_S,
}


class SlurmCommandError(ValueError):
    """A SLURM command that is missing or did not answer in time; the message is one line."""


def timeout_s(command: str, default: float | None = None) -> float:
    """The bound of ``command``: ``NANOTRAIN_SLURM_TIMEOUT_S`` when set (a positive number of
    seconds), else ``default``, else its entry of TIMEOUTS_S. Raises SlurmCommandError for a
    malformed variable."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return default or TIMEOUTS_S.get(command, ACTION_TIMEOUT_S)
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0 or seconds == float("inf"):
        raise SlurmCommandError(f"{TIMEOUT_ENV}={value!r}: give a positive number of seconds, or unset it")
    return seconds


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.communicate()  # reap it and close its pipes


# ``run(..., survive_term=True)``: the command ignores SIGTERM (an ignored signal stays ignored
# across exec). A requeue from inside the job (runtime/exclusions.py) sends every process of the
# job step SIGTERM — the commands this task starts after it too — and SIGKILL only KillWait
# seconds later; the commands that follow the requeue (update ExcNodeList, release) must finish.
_IGNORE_TERM = ["/bin/sh", "-c", 'trap "" TERM; exec "$@"', "sh"]


def run(argv: list[str], limit_s: float | None = None, survive_term: bool = False) -> subprocess.CompletedProcess:
    """Run ``argv`` (argv[0] a SLURM command), stdout and stderr captured as text; the caller
    judges the exit status. ``limit_s`` replaces the command's default bound; ``survive_term``:
    the command ignores SIGTERM (see ``_IGNORE_TERM``). Raises SlurmCommandError when the command
    cannot be started (not installed) or runs past its bound (it and its children are killed
    first)."""
    name = os.path.basename(argv[0])
    limit = timeout_s(name, limit_s)
    try:
        proc = subprocess.Popen(
            (_IGNORE_TERM + argv) if survive_term else argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
    except OSError as exc:
        raise SlurmCommandError(f"{name} could not be run ({exc.strerror}): is SLURM installed here?") from None
    try:
        out, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        _kill_tree(proc)
        raise SlurmCommandError(
            f"{name} did not answer in {limit:g} s: is slurmctld up? (a slow cluster: raise {TIMEOUT_ENV})"
        ) from None
    except BaseException:  # Ctrl-C, or SIGTERM turned into an exception: take the command with us
        _kill_tree(proc)
        raise
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def answer(argv: list[str]) -> str | None:
    """stdout of a query that succeeded; None when the command is missing, fails or does not
    answer in time (for callers that can go on without the answer)."""
    try:
        done = run(argv, QUERY_TIMEOUT_S)
    except SlurmCommandError:
        return None
    return done.stdout if done.returncode == 0 else None
