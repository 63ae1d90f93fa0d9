"""Run a function in N gloo/CPU processes for tests, with a hard timeout and no orphans.

    results = run_distributed(fn, 4, arg1, arg2, timeout=120)   # list, one entry per rank

``fn`` must be a module-level (importable) function; its arguments and return value must be
picklable. The ranks are started by the product's local launcher (``nanotrain.launch.ranks``,
the one behind ``submit.py --local``): each in its own ``python`` subprocess and session, so on a
timeout or a failing rank the whole session of every rank is killed: a hang is a failure, never a
wait. Each rank gets the launcher's env:// variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_PORT a
free port...), OMP_NUM_THREADS=1 and CUDA_VISIBLE_DEVICES="" (tests are CPU/gloo; pass ``env`` to
override any of these).
"""

from __future__ import annotations

import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

from nanotrain.launch.ranks import TIMED_OUT, RankProcesses

_ADDR_IN_USE = ("address already in use", "eaddrinuse", "errno 98")
_TAIL = 4000  # characters of each rank's output shown in a failure


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
    with tempfile.TemporaryDirectory(prefix="nanotrain-dist-") as tmp:
        tmp = Path(tmp)
        spec = tmp / "spec.pkl"
        spec.write_bytes(pickle.dumps((fn, args, timeout)))
        # The children must import what the parent imports (the test module, the package).
        extra = {
            "PYTHONPATH": os.pathsep.join(os.path.abspath(p or os.curdir) for p in sys.path),
            "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "",
            **(env or {}),
        }
        # The product's own local launcher (nanotrain.launch.ranks): the same env:// variables,
        # sessions, fail-fast and deadline as `submit.py --local`.
        with RankProcesses([sys.executable, __file__, str(spec)], world_size, tmp, env=extra) as ranks:
            ranks.start()
            status = ranks.wait(time.monotonic() + timeout, poll_s=0.05)
            timed_out = status == TIMED_OUT and not ranks.done()
            failed = [r for r, c in enumerate(ranks.codes()) if c not in (None, 0)]
        return _collect(tmp, world_size, ranks.procs, failed, timed_out, timeout, retry_ok)


def _collect(tmp, world_size, procs, failed, timed_out, timeout, retry_ok):
    results, errors, when = [None] * world_size, {}, {}
    for rank in range(world_size):
        path = tmp / f"rank-{rank}.result"
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
    output = {r: (tmp / f"rank-{r}.log").read_text(errors="replace") for r in range(world_size)}
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


def _child_main(spec_path: str) -> int:
    import faulthandler
    import traceback

    status, value = "ok", None
    result_path = str(Path(spec_path).parent / f"rank-{os.environ['RANK']}.result")
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
    sys.exit(_child_main(sys.argv[1]))
