"""Start the ranks of one job as processes on this machine, watch them, and end them together.

This is the one local process launcher: `submit.py --local` (`launch/local.py`), the benchmarks
(`benchmarks/vs_native.py`, `context_parallel.py`, `pipeline_bubble.py`, `exit_stress.py`) and the
tests (`tests/helpers/dist.py`) all start ranks through `RankProcesses`. The parts that are easy
to get subtly wrong are done once here:
- a fresh rendezvous port per job, and the env:// variables of each rank with nothing stale
  from an outer launcher (a SLURM job id or torchrun's variables would make `runtime/env.py`
  take the wrong path);
- each rank in its own session, so that ending a rank also ends whatever it spawned (data
  workers, a compiler), and nothing outlives the job;
- fail fast: the first rank that exits non-zero ends the others, which would otherwise block
  forever in a collective waiting for it (a hang is a failure, never a wait);
- a hard deadline for scripted launches;
- on CPU, Python ranks are forked from one process that imported torch and the package once
  (`launch/forkserver.py`: the imports paid once per job, not per rank), and `log_dir/ranks.json` names each
  rank's pid (a forked rank's command line is the fork server's).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

from nanotrain.config.atomic_files import atomic_write_text
from nanotrain.launch.forkserver import ForkServer, python_target, use_fork_server
from nanotrain.runtime.env import free_port

# Variables an outer launcher may have set that must not leak into a local rank.
_CLEARED = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "GROUP_RANK",
    "NODE_RANK",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "SLURM_PROCID",
    "SLURM_JOB_ID",
)
TIMED_OUT = 124  # the status `timeout` returns; scripted launches past their deadline report it


def rank_env(
    rank: int, world_size: int, port: int, threads: int = 1, extra: Mapping[str, str] | None = None
) -> dict[str, str]:
    """This process's environment for local rank `rank`: env:// variables, marked as our launcher."""
    env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
    env.update(
        {
            "NANOTRAIN_LAUNCHER": "local",
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONUNBUFFERED": "1",
        }
    )
    env.setdefault("OMP_NUM_THREADS", str(threads))
    env.update({k: str(v) for k, v in (extra or {}).items()})
    return env


def exit_status(code: int) -> int:
    """A shell's view of a return code: killed by signal N reads 128 + N."""
    return code if code >= 0 else 128 - code


def _tee(stream, sink, log_path: Path) -> None:
    with open(log_path, "ab") as log:
        for line in iter(stream.readline, b""):
            log.write(line)
            log.flush()
            sink.write(line)
            sink.flush()


class RankProcesses:
    """The `world_size` processes of one local job, each running `command` with its rank's env.

    Each rank writes `log_dir/rank-R.log`; ranks in `stream_ranks` also stream to this process's
    stdout. Use as a context manager (or call `kill`) so that no rank outlives its launcher."""

    def __init__(
        self,
        command: Sequence[str],
        world_size: int,
        log_dir: Path,
        *,
        threads: int = 1,
        env: Mapping[str, str] | None = None,
        port: int | None = None,
    ):
        self.command, self.world_size, self.log_dir = list(command), world_size, Path(log_dir)
        self.threads, self.env = threads, dict(env or {})
        self.port = free_port() if port is None else port
        self.procs: list = []  # subprocess.Popen, or forkserver.ForkedProcess (the same surface)
        self._tees: list[threading.Thread] = []
        self._server: ForkServer | None = None

    def log_path(self, rank: int) -> Path:
        return self.log_dir / f"rank-{rank}.log"

    def start(self, stream_ranks: Sequence[int] = (), stop_starting: Callable[[], bool] = lambda: False) -> None:
        """Start rank 0, 1, ...; `stop_starting()` true (Ctrl-C while starting) starts no more."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        target = python_target(self.command)
        common = rank_env(0, self.world_size, self.port, self.threads, self.env)
        if target is not None and self.world_size > 1 and use_fork_server(common):
            # The server imports with the job's environment less the per-rank variables.
            self._server = ForkServer({k: v for k, v in common.items() if k not in ("RANK", "LOCAL_RANK")})
        for rank in range(self.world_size):
            if stop_starting():
                break
            env = rank_env(rank, self.world_size, self.port, self.threads, self.env)
            stream = rank in stream_ranks
            if self._server is not None:
                proc = self._fork(rank, target, env, stream)
            elif stream:
                proc = subprocess.Popen(
                    self.command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
                )
            else:
                with open(self.log_path(rank), "ab") as log:
                    proc = subprocess.Popen(
                        self.command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                    )
            if stream:
                tee = threading.Thread(
                    target=_tee, args=(proc.stdout, sys.stdout.buffer, self.log_path(rank)), daemon=True
                )
                tee.start()
                self._tees.append(tee)
            self.procs.append(proc)
        pids = {str(rank): proc.pid for rank, proc in enumerate(self.procs)}
        atomic_write_text(self.log_dir / "ranks.json", json.dumps({"ranks": pids}))

    def _fork(self, rank: int, target, env: dict, stream: bool):
        if stream:
            read_end, write_end = os.pipe()
            try:
                return self._server.start(rank, target, env, write_end, stdout=os.fdopen(read_end, "rb"))
            finally:
                os.close(write_end)
        with open(self.log_path(rank), "ab") as log:
            return self._server.start(rank, target, env, log.fileno())

    def codes(self) -> list[int | None]:
        return [proc.poll() for proc in self.procs]

    def failure(self) -> tuple[int, int] | None:
        """(rank, shell-style status) of the lowest rank that exited non-zero, or None."""
        return next(
            ((rank, exit_status(code)) for rank, code in enumerate(self.codes()) if code not in (None, 0)), None
        )

    def done(self) -> bool:
        return len(self.procs) > 0 and all(code is not None for code in self.codes())

    def wait(self, deadline: float | None = None, poll_s: float = 0.1) -> int:
        """Until every rank exits 0 (status 0), the first failure (its status; the others are
        then left to `stop`/`kill`) or past `deadline` on the monotonic clock (TIMED_OUT)."""
        while True:
            failed = self.failure()
            if failed is not None:
                return failed[1]
            if self.done():
                return 0
            if deadline is not None and time.monotonic() > deadline:
                return TIMED_OUT
            time.sleep(poll_s)

    def send(self, signum: int) -> None:
        """Deliver `signum` to every rank still running (not to what it spawned: the rank decides)."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signum)

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM every running rank (they save and stop), then SIGKILL what remains after `grace_s`."""
        self.send(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self.kill()

    def kill(self) -> None:
        """SIGKILL each rank's whole session (the rank and anything it spawned), reap, join the tees."""
        for proc in self.procs:
            _kill_session(proc)
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _kill_session(proc)  # stragglers a rank left in its session after it exited
        for tee in self._tees:
            tee.join(timeout=5)
        if self._server is not None:
            self._server.close()

    def __enter__(self) -> RankProcesses:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def _kill_session(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        if proc.poll() is None:
            proc.kill()


class RanksFailed(RuntimeError):
    """A scripted local job failed or ran past its deadline; the message holds the log tail."""


def run_ranks(
    command: Sequence[str],
    world_size: int,
    log_dir: Path,
    timeout_s: float,
    *,
    threads: int = 1,
    env: Mapping[str, str] | None = None,
    tail: int = 3000,
) -> None:
    """Run a scripted job to completion (benchmarks): return when every rank exited 0, else raise
    `RanksFailed` with the failing rank's log tail; every rank is ended either way."""
    with RankProcesses(command, world_size, log_dir, threads=threads, env=env) as ranks:
        ranks.start()
        status = ranks.wait(time.monotonic() + timeout_s)
        if status == TIMED_OUT and not ranks.done():
            raise RanksFailed(f"{world_size} ranks ran past {timeout_s:.0f} s and were killed; logs in {log_dir}")
        failed = ranks.failure()
        if failed is not None:
            rank, code = failed
            text = ranks.log_path(rank).read_text(errors="replace")[-tail:]
            raise RanksFailed(f"rank {rank} exited with status {code}; {ranks.log_path(rank)}:\n{text}")
