"""The hang watchdog: a thread per rank that ends a stuck job loudly, with a report.

Why a thread of our own: a rank that waits for a peer that never comes (a stopped process, a
dead node, a rank asleep in its own code) is only noticed by the process-group timeout, and
only on the ranks that wait — they then die with "timed out" and no word of where they were or
whom they waited for. The watchdog watches the training thread's record (``parallel/observe/hang_record``:
step, phase, last collective), and when it has not moved for ``training.collective_timeout_s``
writes ``<run>/hang/rank-R.json`` — step, phase, the collective and its group (name and global
ranks), its node and host, the Python stack of every thread, torch's flight-recorder dump where
there is one (NCCL, and gloo with torch 2.13), also as torch's own dump file beside it
(``<run>/hang/nccl_trace_rank_R``, for ``torchfrtrace``) — and ends the process with
``EXIT_HUNG``. A collective that fails on the training thread first (the timeout of gloo, a peer
that closed its socket) writes the same report (``report_failure``).

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

from nanotrain.config.atomic_files import atomic_write_bytes, atomic_write_text
from nanotrain.parallel.observe.hang_record import HANG_RECORD, HangRecord
from nanotrain.parallel.observe.nodes import node_name
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


# torch's flight recorder: its variables by torch version (each newer name read first where both
# exist: c10d's getCvar* take a list, the first one set wins), and its dump functions.
FR_BUFFER_VARS = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # 2.7+, 2.5-2.6 (still read)
FR_FILE_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")  # newer, and 2.5's
FR_FILE_PREFIX = "nccl_trace_rank_"  # + rank: the dump's file name in <run>/hang/ (torch's own default name)
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives kept per communicator, as torchtitan keeps


def fr_buffer_var(version: str | None = None) -> str:
    """The flight recorder's buffer-size variable of the installed torch (or ``version``):
    TORCH_FR_BUFFER_SIZE from torch 2.7 (when the recorder left ProcessGroupNCCL), else
    TORCH_NCCL_TRACE_BUFFER_SIZE."""
    parts = (version or torch.__version__).split("+")[0].split(".")
    try:
        major, minor = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return FR_BUFFER_VARS[0]
    return FR_BUFFER_VARS[0] if (major, minor) >= (2, 7) else FR_BUFFER_VARS[1]


def _fr_function(json_dump: bool):
    """torch's flight-recorder dump function of this torch: ``_dump_fr_trace[_json]`` (every
    backend that records: NCCL, and gloo since torch 2.8-ish), else ``_dump_nccl_trace[_json]``
    (2.5-2.7, NCCL only); None when this torch has neither."""
    c10d = getattr(torch._C, "_distributed_c10d", None)
    names = ("_dump_fr_trace_json", "_dump_nccl_trace_json") if json_dump else ("_dump_fr_trace", "_dump_nccl_trace")
    for name in names:
        fn = getattr(c10d, name, None)
        if fn is not None:
            return name, fn
    return None, None


def _recording(environ=os.environ) -> bool:
    size = next((environ[v] for v in FR_BUFFER_VARS if environ.get(v)), "0")
    return size.strip().isdigit() and int(size) > 0


FR_REPORT_ENTRIES = 64  # the newest entries a report embeds (the dump file keeps them all)


def flight_recorder(last: int = FR_REPORT_ENTRIES) -> Optional[object]:
    """torch's flight-recorder dump as JSON — process groups, their status (last enqueued,
    started, completed collective) and the ``last`` newest entries, completed ones included (the
    collective a rank hangs in is active; the ones before it say how far each group got) — or
    None: no process group, no recorder in this torch, its buffer size 0 (``nccl_debug_env``
    sets it), or on gloo with a torch whose recorder is NCCL's only."""
    if not (dist.is_available() and dist.is_initialized()) or not _recording():
        return None
    name, dump = _fr_function(json_dump=True)
    if dump is None or (name == "_dump_nccl_trace_json" and dist.get_backend() != "nccl"):
        return None
    try:
        data = json.loads(dump(True, False))  # include collectives, every entry
    except Exception as exc:  # a dump is a bonus: never let it hide the report
        return {"error": f"{type(exc).__name__}: {exc}"}
    if isinstance(data, dict) and isinstance(data.get("entries"), list):
        data["entries_total"] = len(data["entries"])
        data["entries"] = data["entries"][-last:]
    return data


def write_flight_recorder_file(rank: int, environ=os.environ) -> Optional[str]:
    """torch's own dump file (pickled, every recorded collective), where NCCL's timeout dump
    goes: the prefix of the torch's file variable + the rank, ``<run>/hang/nccl_trace_rank_R`` by
    default — so ``torchfrtrace <run>/hang -p nccl_trace_rank_`` (torch's analyser) reads every
    rank's. Returns the path, or None (no recorder, no prefix, nothing recorded)."""
    prefix = next((environ[v] for v in FR_FILE_VARS if environ.get(v)), None)
    if not prefix or not (dist.is_available() and dist.is_initialized()) or not _recording(environ):
        return None
    name, dump = _fr_function(json_dump=False)
    if dump is None or (name == "_dump_nccl_trace" and dist.get_backend() != "nccl"):
        return None
    try:
        data = dump(True, False, False)  # collectives, no C++ stacks (slow to symbolise), all entries
        path = f"{prefix}{rank}"
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(path, data)
        return path
    except Exception:  # noqa: BLE001 - as above: the report matters more than its dump
        return None


def nccl_debug_env(run_dir: Path, environ=os.environ) -> None:
    """The flight recorder and NCCL's dump on a timeout, unless the user set them: set before the
    process groups exist (torch reads them then). Each setting is known to torch by two names
    (``FR_BUFFER_VARS``, ``FR_FILE_VARS``: the TORCH_FR_* names of newer torch, read before the
    TORCH_NCCL_* ones that 2.5 and 2.6 know), and the user's value under either name is the one
    used. The buffer size goes under the installed torch's name only (``fr_buffer_var``: torch
    2.13 warns that the old one is deprecated); the file prefix under both (torch 2.13 reads the
    new one first and the old one after it, 2.5 the old one only), so a user's prefix under the
    old name is never overridden by ours under the new one.
    The dump files are named by appending the rank to the file prefix, ``<run>/hang/`` unless
    the user chose another; the directory is made here (torch does not make it). gloo records
    too with torch 2.13: the hang reports then carry its dump on CPU as well."""
    size = next((environ[v] for v in FR_BUFFER_VARS if environ.get(v)), FLIGHT_RECORDER_ENTRIES)
    environ.setdefault(fr_buffer_var(), size)
    environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    hang_dir = Path(run_dir) / HANG_DIR
    prefix = next((environ[v] for v in FR_FILE_VARS if environ.get(v)), str(hang_dir / FR_FILE_PREFIX))
    for var in FR_FILE_VARS:
        environ.setdefault(var, prefix)
    try:
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
    except OSError:
        pass  # the user's directory: torch says so when it cannot write there


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
                "node": node_name(),
                "flight_recorder": flight_recorder(),
                "flight_recorder_file": write_flight_recorder_file(self.rank),
            }
            self.path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.path, json.dumps(report, indent=1, default=str))
            coll = snap["collective"]
            where = (
                f"; last collective {coll['name']} on {coll['group']['name']} {coll['group']['ranks']}" if coll else ""
            )
            node, host = report["node"], report["host"]
            at = f" (node {node}, host {host})" if node != host else f" (host {host})"
            print(
                f"hang: rank {self.rank}{at} at step {snap['step']} in {snap['phase']}{where}: {reason}; "
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
