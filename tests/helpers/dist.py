"""Run a function in N gloo/CPU processes for tests, with a hard timeout and no orphans.

    results = run_distributed(fn, 4, arg1, arg2, timeout=120)   # list, one entry per rank

``fn`` must be a module-level (importable) function; its arguments and return value must be
picklable. Each rank runs in its own ``python`` subprocess (a fresh interpreter, like a real
launcher) in its own session, so on a timeout or a failing rank the whole process group of every
rank is killed: a hang is a failure, never a wait. Each rank gets RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port), OMP_NUM_THREADS=1 and
CUDA_VISIBLE_DEVICES="" (tests are CPU/gloo; pass ``env`` to override any of these).
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

_ADDR_IN_USE = ("address already in use", "eaddrinuse", "errno 98")
_TAIL = 4000  # characters of each rank's output shown in a failure


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_distributed(fn, world_size: int, *args, timeout: float = 120, env: dict | None = None) -> list:
    """Run ``fn(*args)`` on ``world_size`` ranks; return each rank's return value, in rank order.

    Raises AssertionError (with the failing rank's traceback and output tail) if any rank raises,
    crashes, or if the ranks do not all finish within ``timeout`` seconds. The launch is retried
    once with a new port when the rendezvous port turns out to be taken.
    """
    if getattr(fn, "__qualname__", "").count("<") or fn.__module__ == "__main__":
        raise ValueError(f"{fn!r} must be a module-level function importable by the child processes")
    try:
        return _launch(fn, world_size, args, timeout, env, retry_ok=True)
    except _AddressInUse:
        return _launch(fn, world_size, args, timeout, env, retry_ok=False)


class _AddressInUse(Exception):
    pass


def _launch(fn, world_size, args, timeout, env, retry_ok):
    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="nanotrain-dist-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "spec.pkl"
        spec.write_bytes(pickle.dumps((fn, args, timeout)))
        base_env = dict(os.environ)
        # The children must import what the parent imports (the test module, the package).
        base_env["PYTHONPATH"] = os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path)
        procs, logs = [], []
        try:
            for rank in range(world_size):
                e = dict(base_env)
                e.update(
                    RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0", NODE_RANK="0",
                    MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                    CUDA_VISIBLE_DEVICES="", PYTHONUNBUFFERED="1",
                )
                e.update({k: str(v) for k, v in (env or {}).items()})
                log = open(tmp / f"rank{rank}.log", "wb")
                logs.append(log)
                procs.append(subprocess.Popen(
                    [sys.executable, __file__, str(spec), str(tmp / f"rank{rank}.result")],
                    env=e, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                ))
            failed, timed_out = _wait(procs, timeout)
        finally:
            _kill_all(procs)
            for log in logs:
                log.close()
        return _collect(tmp, world_size, procs, failed, timed_out, timeout, retry_ok)


def _wait(procs, timeout):
    """Poll until all exit 0, one fails (fail fast: the others would block on it) or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [p.poll() for p in procs]
        failed = [r for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            return failed, False
        if all(c == 0 for c in codes):
            return [], False
        if time.monotonic() > deadline:
            return [], True
        time.sleep(0.05)


def _kill_all(procs) -> None:
    """SIGKILL each rank's whole session (the rank and anything it spawned), then reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        # Also reap stragglers the rank may have left in its session.
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _collect(tmp, world_size, procs, failed, timed_out, timeout, retry_ok):
    results, errors, when = [None] * world_size, {}, {}
    for rank in range(world_size):
        path = tmp / f"rank{rank}.result"
        if path.exists():
            status, value = pickle.loads(path.read_bytes())
            if status == "ok":
                results[rank] = value
            else:
                errors[rank], when[rank] = value, path.stat().st_mtime_ns
        elif not timed_out and rank in failed:
            errors[rank] = f"rank {rank} exited with code {procs[rank].returncode} without a result"
            when[rank] = 0  # a hard crash (signal, os._exit) is the likeliest root cause
    # Once one rank fails, its peers usually fail too (closed connections): report the first.
    order = sorted(errors, key=lambda r: (when[r], r))
    output = {r: (tmp / f"rank{r}.log").read_text(errors="replace") for r in range(world_size)}
    if not errors and not timed_out and not failed:
        for r in range(world_size):  # shown by pytest on failure or with -s
            if output[r].strip():
                print(f"----- rank {r} output -----\n{output[r].rstrip()}")
        return results
    texts = [t.lower() for t in list(output.values()) + list(errors.values())]
    if retry_ok and any(s in t for t in texts for s in _ADDR_IN_USE):
        raise _AddressInUse()
    if timed_out:
        head = f"run_distributed: timed out after {timeout} s ({world_size} ranks); all ranks killed"
        shown = range(world_size)
    else:
        first = order[0] if order else failed[0]
        head = f"run_distributed: rank {first} failed first ({world_size} ranks); all ranks killed"
        shown = [first]
    parts = [head]
    for r in order:
        parts.append(f"----- rank {r} exception -----\n{errors[r]}")
    for r in shown:
        parts.append(f"----- rank {r} output (tail) -----\n{output[r][-_TAIL:]}")
    raise AssertionError("\n".join(parts))


def _child_main(spec_path: str, result_path: str) -> int:
    import faulthandler
    import traceback

    status, value = "ok", None
    try:
        fn, args, timeout = pickle.loads(Path(spec_path).read_bytes())
        # If this rank hangs, print where just before the parent kills it.
        faulthandler.dump_traceback_later(max(1.0, timeout - 3.0), exit=False)
        if "torch" in sys.modules:  # otherwise OMP_NUM_THREADS=1 already applies when it loads
            sys.modules["torch"].set_num_threads(1)
        value = fn(*args)
        dist = sys.modules.get("torch.distributed")
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
        payload = pickle.dumps((status, value))
    except BaseException:
        status, value = "err", traceback.format_exc()
        payload = pickle.dumps((status, value))
    tmp = Path(result_path + ".tmp")
    tmp.write_bytes(payload)
    tmp.rename(result_path)  # atomic: the parent never reads a half-written result
    if status != "ok":
        # Exit now: a failed rank's peers are about to be killed, and a graceful teardown of its
        # process group could block on them.
        sys.stderr.write(value)
        sys.stderr.flush()
        os._exit(1)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main(sys.argv[1], sys.argv[2]))
