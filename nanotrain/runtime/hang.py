"""The hang watchdog: a thread per rank that ends a stuck job loudly, with a report.

Why a thread of our own: a rank that waits for a peer that never comes (a stopped process, a
dead node, a rank asleep in its own code) is only noticed by the process-group timeout, and
only on the ranks that wait — they then die with "timed out" and no word of where they were or
whom they waited for. The watchdog watches the training thread's record (``parallel/observe/hang_record``:
step, phase, last collective), and when it has not moved for ``training.collective_timeout_s``
writes ``<run>/hang/rank-R.json`` — step, phase, the collective and its group (name and global
ranks), the Python stack of every thread, NCCL's flight-recorder dump where there is one — and
ends the process with ``EXIT_HUNG``. A collective that fails on the training thread first (the
timeout of gloo, a peer that closed its socket) writes the same report (``report_failure``).

The stopped rank itself writes nothing (a SIGSTOPped process runs no thread); its peers'
reports name it: ``hang_status.py`` deduces the culprit from who is missing or behind.
The watchdog's clock is the last phase change, which comes before every collective; NCCL's
counts from when a collective is enqueued, which may be earlier (the host runs ahead of the
device), and NCCL then aborts the process with no report. So the process groups get a longer
timeout than the watchdog (``training.builder.hang_timeouts``), and if NCCL fires anyway its
own dump lands in ``<run>/hang/`` (``nccl_debug_env``).
"""

from __future__ import annotations

import json
import linecache
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nanotrain.config.atomic_files import atomic_write_text
from nanotrain.parallel.observe.hang_record import HANG_RECORD, HangRecord
from nanotrain.runtime.hang_status import HANG_DIR

EXIT_HUNG = 4  # the job hung (watchdog or a failed collective); reports under <run>/hang/
# Phrases of the errors a collective raises when a peer never answers or went away, as gloo, the
# TCP store and NCCL/c10d word them ("Timed out waiting ... for recv", "Connection closed by peer",
# "Watchdog caught collective operation timeout", "NCCL communicator was aborted on rank 3",
# NCCL's "remote process exited or there was a network error" / ncclRemoteError). Not the bare
# backend names: an NCCL "invalid argument" or "unhandled cuda error" is a bug, not a hang.
_COMM_FAILURE_WORDS = (
    "timed out",
    "timeout",
    "connection closed",
    "remote peer closed",
    "connection reset",
    "broken pipe",
    "remote process exited",
    "ncclremoteerror",
    "communicator was aborted",
)


def is_comm_failure(exc: BaseException) -> bool:
    """A collective that failed because of a peer (timeout, closed connection), not our bug.

    torch's network and store errors (``DistNetworkError``, ``DistStoreError``) always count; any
    other ``RuntimeError`` (``DistBackendError`` included, which NCCL raises for bugs too) counts
    only when its message says a peer timed out, closed or exited."""
    kinds = tuple(k for k in (getattr(dist, "DistNetworkError", None), getattr(dist, "DistStoreError", None)) if k)
    if kinds and isinstance(exc, kinds):
        return True
    return isinstance(exc, RuntimeError) and any(w in str(exc).lower() for w in _COMM_FAILURE_WORDS)


def is_timeout(exc: BaseException) -> bool:
    """The collective gave up waiting (the rank itself saw the hang), as opposed to a peer that
    went away — which is how every rank sees another rank's crash, bug or not."""
    return any(w in str(exc).lower() for w in ("timed out", "timeout"))


def thread_stacks() -> dict[str, list[str]]:
    """The Python stack of every thread, innermost frame last (``traceback`` format)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    return {
        f"{names.get(ident, 'thread')} ({ident})": traceback.format_stack(frame)
        for ident, frame in sys._current_frames().items()
    }


def waiting_in_communication(thread_id: int) -> bool:
    """Whether that thread sits in torch.distributed or on a work handle's ``wait()``: a rank
    blocked by a peer, as opposed to one stuck in its own code."""
    frame = sys._current_frames().get(thread_id)
    if frame is None:
        return False
    filename = frame.f_code.co_filename.replace(os.sep, "/")
    line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
    return "torch/distributed" in filename or ".wait(" in line


def nccl_flight_recorder() -> Optional[object]:
    """NCCL's flight-recorder dump (the last collectives of every communicator, torch >= 2.5,
    filled when its buffer size is > 0: ``nccl_debug_env``), or None off NCCL / when torch has none."""
    if not (torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl"):
        return None
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace_json", None)
    if dump is None:
        return None
    try:
        return json.loads(dump(True, True))  # include collectives, only active ones
    except Exception as exc:  # a dump is a bonus: never let it hide the report
        return {"error": f"{type(exc).__name__}: {exc}"}


FLIGHT_RECORDER_ENTRIES = "2000"  # collectives kept per communicator, as torchtitan keeps


def nccl_debug_env(run_dir: Path, environ=os.environ) -> None:
    """NCCL's flight recorder and its dump on a timeout, unless the user set them: set before the
    process groups exist (NCCL reads them then); unused on gloo. The recorder's size variable
    is TORCH_FR_BUFFER_SIZE since torch 2.7 and TORCH_NCCL_TRACE_BUFFER_SIZE in 2.5 and 2.6, so
    both are set, to the user's value of either. NCCL names its dump files by appending the
    rank to TORCH_NCCL_DEBUG_INFO_TEMP_FILE, in a directory that must exist (made where NCCL
    can run: with CUDA)."""
    size = environ.get("TORCH_FR_BUFFER_SIZE") or environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or FLIGHT_RECORDER_ENTRIES
    environ.setdefault("TORCH_FR_BUFFER_SIZE", size)
    environ.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", size)
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    hang_dir = Path(run_dir) / HANG_DIR
    environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(hang_dir / "nccl_trace_rank_"))
    if torch.cuda.is_available():
        hang_dir.mkdir(parents=True, exist_ok=True)


class HangWatchdog:
    """``start()`` once the process groups exist; ``stop()`` before they are destroyed."""

    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world_size: int,
        timeout_s: float,
        on_hang: Callable[[], None] = lambda: None,
        record: HangRecord = HANG_RECORD,
    ):
        self.path = Path(run_dir) / HANG_DIR / f"rank-{rank}.json"
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.on_hang, self.record = on_hang, record
        self._lock = threading.Lock()
        self._written = False
        self.frozen_s = 0.0  # the longest this process did not run at all (SIGSTOP, a frozen VM)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="nanotrain-hang-watchdog", daemon=True)
        self._main = threading.main_thread().ident

    def start(self) -> "HangWatchdog":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        poll = min(1.0, max(0.05, self.timeout_s / 20))
        woke = time.monotonic()
        while not self._stop.wait(poll):
            # A poll that comes back far later than asked: the whole process was not running
            # (stopped, then continued, e.g. by SLURM's SIGCONT before it kills a job step).
            now = time.monotonic()
            if now - woke > max(10 * poll, 2.0):
                self.frozen_s = max(self.frozen_s, now - woke - poll)
            woke = now
            p = self.record
            idle = time.monotonic() - p.beat
            if p.armed and idle > self.timeout_s:
                self.report(
                    f"watchdog: no progress for {idle:.1f} s (training.collective_timeout_s = {self.timeout_s:g})"
                )
                self._end()

    def report(self, reason: str, waiting: Optional[bool] = None) -> Optional[Path]:
        """Write this rank's report once (the first of the watchdog and a failed collective);
        returns its path, or None when it was written already. ``waiting``: whether the
        training thread was blocked in communication (None: judged from its stack now)."""
        with self._lock:
            if self._written:
                return None
            self._written = True
            snap = self.record.snapshot()
            report = {
                "rank": self.rank,
                "world_size": self.world_size,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "time": time.time(),
                "reason": reason,
                **snap,
                "waiting_in_communication": waiting_in_communication(self._main) if waiting is None else waiting,
                "frozen_s": round(self.frozen_s, 3),
                "job_id": os.environ.get("SLURM_JOB_ID"),
                "restart": int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0),
                "stacks": thread_stacks(),
                "nccl_flight_recorder": nccl_flight_recorder(),
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(report, indent=1, default=str))
            coll = snap["collective"]
            where = (
                f"; last collective {coll['name']} on {coll['group']['name']} {coll['group']['ranks']}" if coll else ""
            )
            print(
                f"hang: rank {self.rank} at step {snap['step']} in {snap['phase']}{where}: {reason}; "
                f"report: {self.path}",
                file=sys.stderr,
                flush=True,
            )
            return self.path

    def report_failure(self, exc: BaseException) -> None:
        """The training thread's collective failed (a peer timed out or went away)."""
        self.report(f"collective failed: {type(exc).__name__}: {str(exc).strip()[:500]}", waiting=True)

    def _end(self) -> None:
        """The training thread is stuck (it may never return): act for it, then leave at once."""
        try:
            self.on_hang()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(EXIT_HUNG)
