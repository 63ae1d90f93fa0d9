"""Run a job as local processes (one per rank, gloo on CPU): `submit.py --local`.

Why not submitit's local executor: it neither streams output nor ends the other ranks when one
fails. Here rank 0's output (and the metrics rank's) streams to the terminal (and to `job/rank-R.log`), every other rank
writes `job/rank-R.log`, the first rank that fails ends the rest within seconds (a hang is a
failure), and SIGTERM/SIGUSR1/SIGUSR2 sent to the launcher are passed on to every rank — the
same signals SLURM sends before a preemption or time limit. Ctrl-C (SIGINT) becomes SIGTERM for
the ranks: they save at the next step boundary and stop, as on a preemption, and the launcher
then says what was saved and how to resume (exit 130); a second Ctrl-C kills them at once.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from nanotrain.config import ConfigError
from nanotrain.launch.ranks import TIMED_OUT, RankProcesses
from nanotrain.runtime.preemption import unblock_stop_signals

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)


def max_local_processes() -> int:
    """More local ranks than this is a typo (dp: 100000), not a test: each rank is a Python
    process with torch loaded (~0.3 GB), all on this one machine."""
    return max(64, 2 * (os.cpu_count() or 1))


def check_process_count(world_size: int) -> None:
    """Raises ConfigError when a local run would start more than ``max_local_processes()`` ranks."""
    cap = max_local_processes()
    if world_size > cap:
        raise ConfigError(
            f"parallelism: dp*tp*pp*cp*ep = {world_size:,} local processes; a local run starts "
            f"at most {cap} (this machine has {os.cpu_count()} CPUs): lower dp/tp/pp/cp, "
            "or submit to SLURM"
        )


class Interrupted(Exception):
    """Ctrl-C ended a local run; `forced`: a second Ctrl-C killed the ranks without a save;
    `failed`: a rank that did not stop cleanly (its status and log), or None."""

    def __init__(self, forced: bool, failed: str | None = None):
        super().__init__("interrupted")
        self.forced, self.failed = forced, failed


def report_interrupt(run_dir: Path, checkpoints: Path, stop: Interrupted) -> str:
    """What a user needs after Ctrl-C: the checkpoint a resume starts from, and the command."""
    from nanotrain.checkpoint.format import load_candidates  # torch: only now, not at every launch

    if stop.forced:
        how = "the ranks were killed (second Ctrl-C)"
    elif stop.failed:
        how = f"{stop.failed} while stopping"
    else:
        how = "the ranks saved at a step boundary and stopped"
    found = load_candidates(checkpoints)
    resume = f"python submit.py --resume {run_dir}"
    if not found:
        return f"interrupted: {how}; no checkpoint was saved yet, so {resume} starts from step 0"
    return f"interrupted: {how}; latest checkpoint: {found[0]}; resume with: {resume}"


def task_command(config_path: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "nanotrain.runtime.task", str(config_path)]


def run_local(
    command: list[str],
    world_size: int,
    log_dir: Path,
    *,
    quiet: bool = False,
    threads: int = 1,
    stream_ranks: tuple[int, ...] = (0,),
    timeout_s: float | None = None,
) -> int:
    """Start `world_size` ranks of `command` (normally `task_command`); return the job's status.

    `stream_ranks` go to the terminal as well as to their log: rank 0, and the rank that logs
    metrics (the last pipeline stage) when that is another one. `timeout_s`: a hard limit for
    scripted launches (status 124, as `timeout` returns); None waits as long as the job runs.
    The first rank that fails ends the others, and its status is the job's.

    Raises:
        Interrupted: Ctrl-C ended the run (the ranks saved and stopped, or, after a second
            Ctrl-C, were killed).
    """
    ranks = RankProcesses(command, world_size, log_dir, threads=threads)
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    interrupts: list[int] = []  # Ctrl-C count; the handler only records and forwards

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            interrupts.append(signum)
            signum = signal.SIGTERM if len(interrupts) == 1 else signal.SIGKILL
        ranks.send(signum)

    # Installed before the first rank starts: a Ctrl-C while they start reaches those started.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        ranks.start(stream_ranks=() if quiet else stream_ranks, stop_starting=lambda: bool(interrupts))
        # submit.py held stop signals pending since its start (the ranks inherited that mask and
        # release it once their own handler exists): deliver them now that every rank exists, so
        # each gets them. Ctrl-C is not held: it stops the start-up above.
        unblock_stop_signals()
        status = _wait(ranks, interrupts, None if timeout_s is None else time.monotonic() + timeout_s)
        failed = ranks.failure()
        failed = (
            None
            if failed is None
            else f"rank {failed[0]} exited with status {failed[1]} (log: {ranks.log_path(failed[0])})"
        )
    finally:
        ranks.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if interrupts:
        raise Interrupted(forced=len(interrupts) > 1, failed=failed)
    return status


def _wait(ranks: RankProcesses, interrupts: list[int], deadline: float | None) -> int:
    """Block until every rank exits, or the first failure (then the rest are stopped). After
    Ctrl-C every rank is waited for: they are saving together, and none has failed. Past
    ``deadline`` (scripted launches): status 124, as `timeout` returns."""
    told = False
    while True:
        if interrupts:
            if not told:
                print(
                    "\ninterrupt: every rank saves and stops at the next step boundary "
                    "(Ctrl-C again to stop at once, without saving)",
                    file=sys.stderr,
                    flush=True,
                )
                told = True
            if ranks.done():
                return 130
            time.sleep(0.2)
            continue
        status = ranks.wait(deadline, poll_s=0.2)
        if interrupts:
            continue  # Ctrl-C arrived while waiting: every rank now stops at a step boundary
        if status == TIMED_OUT and not ranks.done():
            print(f"error: the job did not finish in time; logs: {ranks.log_dir}", file=sys.stderr, flush=True)
            return status
        failed = ranks.failure()
        if failed is not None:
            rank, code = failed
            raw = ranks.procs[rank].returncode
            how = f" (signal {-raw})" if raw < 0 else ""
            print(
                f"error: rank {rank} exited with status {code}{how}; its log: {ranks.log_path(rank)}",
                file=sys.stderr,
                flush=True,
            )
        return status
