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
import subprocess
import sys
import threading
import time
from pathlib import Path

from nanotrain.config import ConfigError
from nanotrain.launch.env import free_port
from nanotrain.launch.preemption import unblock_stop_signals

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
_CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
            "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_JOB_ID")


def max_local_processes() -> int:
    """More local ranks than this is a typo (dp: 100000), not a test: each rank is a Python
    process with torch loaded (~0.3 GB), all on this one machine."""
    return max(64, 2 * (os.cpu_count() or 1))


def check_process_count(world_size: int) -> None:
    cap = max_local_processes()
    if world_size > cap:
        raise ConfigError(f"parallelism: dp*tp*pp*cp*ep = {world_size:,} local processes; a local run starts "
                          f"at most {cap} (this machine has {os.cpu_count()} CPUs): lower dp/tp/pp/cp, "
                          "or submit to SLURM")


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


def rank_env(rank: int, world_size: int, port: int, threads: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update({
        "NANOTRAIN_LAUNCHER": "local", "RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "PYTHONUNBUFFERED": "1",
    })
    env.setdefault("OMP_NUM_THREADS", str(threads))
    return env


def _tee(stream, sink, log_path: Path) -> None:
    with open(log_path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            sink.write(line)
            sink.flush()


def _stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def task_command(config_path: Path) -> list[str]:
    return [sys.executable, "-u", "-m", "nanotrain.launch.task", str(config_path)]


def run_local(command: list[str], world_size: int, log_dir: Path, *, quiet: bool = False,
              threads: int = 1, stream_ranks: tuple[int, ...] = (0,), timeout_s: float | None = None) -> int:
    """Start `world_size` ranks of `command` (normally `task_command`); return the job's status.

    `stream_ranks` go to the terminal as well as to their log: rank 0, and the rank that logs
    metrics (the last pipeline stage) when that is another one. `timeout_s`: a hard limit for
    scripted launches (status 124, as `timeout` returns); None waits as long as the job runs."""
    log_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: list[subprocess.Popen] = []
    tees: list[threading.Thread] = []
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED_SIGNALS}
    interrupts: list[int] = []  # Ctrl-C count; the handler only records and forwards

    def forward(signum, _frame):
        if signum == signal.SIGINT:
            interrupts.append(signum)
            signum = signal.SIGTERM if len(interrupts) == 1 else signal.SIGKILL
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    # Installed before the first rank starts: a Ctrl-C while they start reaches those started.
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, forward)
    try:
        for rank in range(world_size):
            if interrupts:
                break  # interrupted while starting: start no more
            env = rank_env(rank, world_size, port, threads)
            if rank in stream_ranks and not quiet:
                proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        start_new_session=True)
                tee = threading.Thread(target=_tee, args=(proc.stdout, sys.stdout.buffer,
                                                          log_dir / f"rank-{rank}.log"), daemon=True)
                tee.start()
                tees.append(tee)
            else:
                with open(log_dir / f"rank-{rank}.log", "ab") as log:
                    proc = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
            procs.append(proc)
        # submit.py held stop signals pending since its start (the ranks inherited that mask and
        # release it once their own handler exists): deliver them now that every rank exists, so
        # each gets them (issue 17 item 9). Ctrl-C is not held: it stops the start-up above.
        unblock_stop_signals()
        status = _wait(procs, log_dir, interrupts, None if timeout_s is None else time.monotonic() + timeout_s)
        failed = next((f"rank {r} exited with status {p.returncode} (log: {log_dir / f'rank-{r}.log'})"
                       for r, p in enumerate(procs) if p.returncode not in (0, None)), None)
    finally:
        _stop_all(procs)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for tee in tees:
            tee.join(timeout=5)
    if interrupts:
        raise Interrupted(forced=len(interrupts) > 1, failed=failed)
    return status


def _wait(procs: list[subprocess.Popen], log_dir: Path, interrupts: list[int], deadline: float | None = None) -> int:
    """Block until every rank exits, or the first failure (then the rest are stopped). After
    Ctrl-C every rank is waited for: they are saving together, and none has failed. Past
    ``deadline`` (scripted launches): status 124, as `timeout` returns."""
    told = False
    while True:
        if deadline is not None and time.monotonic() > deadline:
            print(f"error: the job did not finish in time; logs: {log_dir}", file=sys.stderr, flush=True)
            return 124
        codes = [proc.poll() for proc in procs]
        if interrupts:
            if not told:
                print("\ninterrupt: every rank saves and stops at the next step boundary "
                      "(Ctrl-C again to stop at once, without saving)", file=sys.stderr, flush=True)
                told = True
            if all(code is not None for code in codes):
                return 130
            time.sleep(0.2)
            continue
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            status = code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
            how = f" (signal {-code})" if code < 0 else ""
            print(f"error: rank {rank} exited with status {status}{how}; its log: {log_dir / f'rank-{rank}.log'}",
                  file=sys.stderr, flush=True)
            return status
        if all(code == 0 for code in codes):
            return 0
        time.sleep(0.2)
