#!/usr/bin/env python3
"""Many short multi-rank launches, counting the ranks that die by a signal at exit: must be 0.

    .venv/bin/python benchmarks/exit_stress.py                  # 100 launches: dp2, tp2, pp2, cp2 in turn
    .venv/bin/python benchmarks/exit_stress.py --n 20 --layouts tp2 cp2

Why: a gloo rank used to die at exit, once in a while, with "terminate called without an active
exception" (SIGABRT): process groups outlived ``destroy_process_group()`` (kept by an autograd
graph or gradient-sync hooks no collector frees, or by torch._dynamo's import), so their C++
threads were torn down inside interpreter shutdown, or not at all. One launch in a hundred is
enough to fail a SLURM job or a CI run; a single clean run proves nothing.

Launches alternate between the two kinds of rank code (one launcher starts both):
``trainer``: ``submit.py --local`` (``run_local`` + ``nanotrain.runtime.task``: smoke step, two
training steps, the final checkpoint, ``pc.destroy()``) on ``configs/tiny_cpu.yaml``;
``benchmark``: the benchmark workers (``vs_native.py``'s jobs dp2, tp2_ar, pp2_1f1b with one
step per side; ``context_parallel.py``'s cp2 layout), started by the same launcher
(``nanotrain.launch.ranks``) from ``bench_launch.py`` and ``vs_native.py``.
Reported: launches that ended with a signal, other failures, and launches where a rank warned
that a process group survived its destruction (the cause of the abort, seen even when the race
is not lost). Every launch has a hard timeout and its processes are stopped.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

LAYOUTS = {"dp2": {"dp": 2}, "tp2": {"tp": 2}, "pp2": {"pp": 2}, "cp2": {"cp": 2}}
BENCH_JOBS = {"dp2": "dp2", "tp2": "tp2_ar", "pp2": "pp2_1f1b"}  # cp2: context_parallel.py
LEAK = "still referenced after destroy"


def trainer_launch(layout: str, tmp: Path, i: int, timeout_s: float) -> tuple[str, str]:
    """`submit.py --local` of the tiny config at this layout; returns (outcome, log text)."""
    from nanotrain.config import load_config
    from nanotrain.launch.local import run_local, task_command
    from nanotrain.runtime import rundir

    sizes = {"dp": 1, "tp": 1, "pp": 1, "cp": 1, **LAYOUTS[layout]}
    sets = [f"parallelism.{k}={v}" for k, v in sizes.items()] + [
        "training.train_steps=2",
        "checkpoints.interval=0",
        "logging.log_interval=1",
        f"logging.dir={tmp}",
        f"logging.run_name=run{i}",
    ]
    config = load_config(ROOT / "configs" / "tiny_cpu.yaml", sets)
    run_dir = rundir.resolve_run(config, None)
    path = rundir.write_run_dir(config, run_dir)
    log_dir = run_dir / "job"
    status = run_local(task_command(path), 2, log_dir, quiet=True, timeout_s=timeout_s)
    text = "".join(p.read_text(errors="replace") for p in sorted(log_dir.glob("rank-*.log")))
    if status > 128 and status != 124:
        return f"signal {status - 128}", text
    return ("ok" if status == 0 else f"status {status}"), text


def benchmark_launch(layout: str, tmp: Path, i: int, timeout_s: float) -> tuple[str, str]:
    """The benchmark workers of this layout; returns (outcome, log text)."""
    import context_parallel
    import vs_native

    from nanotrain.launch.ranks import RanksFailed

    log_root = tmp / f"bench{i}"
    try:
        if layout == "cp2":
            context_parallel.launch("cp2", [128], 2, 1, timeout_s=timeout_s, log_dir=log_root / "cp2")
        else:
            vs_native.launch(BENCH_JOBS[layout], 1, 1, 0, timeout_s=timeout_s, log_root=log_root)
        outcome = "ok"
    except RanksFailed as err:
        code = re.search(r"exited with status (\d+)", str(err))
        died = code and int(code.group(1)) > 128  # a shell's status: signal N reads 128 + N
        outcome = f"signal {int(code.group(1)) - 128}" if died else f"failed: {str(err)[:200]}"
    text = "".join(p.read_text(errors="replace") for p in sorted(log_root.glob("*/rank-*.log")))
    return outcome, text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=100, help="launches (default 100)")
    parser.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    parser.add_argument("--paths", nargs="+", default=["trainer", "benchmark"], choices=["trainer", "benchmark"])
    parser.add_argument("--timeout", type=float, default=300, help="seconds per launch (default 300)")
    opts = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    signals, failures, leaks = [], [], []
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="nanotrain-exit-stress-") as tmp:
        for i in range(opts.n):
            layout = opts.layouts[i % len(opts.layouts)]
            path = opts.paths[(i // len(opts.layouts)) % len(opts.paths)]
            t = time.perf_counter()
            launch = trainer_launch if path == "trainer" else benchmark_launch
            outcome, text = launch(layout, Path(tmp), i, opts.timeout)
            aborted = "terminate called" in text
            leaked = LEAK in text
            name = f"{path} {layout}"
            if outcome.startswith("signal"):
                signals.append(name)
            elif outcome != "ok":
                failures.append(name)
            if leaked:
                leaks.append(name)
            print(
                f"[{i + 1}/{opts.n}] {name}: {outcome}{' (terminate called)' if aborted else ''}"
                f"{' (process group leaked)' if leaked else ''} {time.perf_counter() - t:.1f} s",
                flush=True,
            )
            if outcome != "ok":
                print(text[-3000:], flush=True)
    print(
        f"\nexit_stress: {opts.n} launches ({', '.join(opts.paths)} x {', '.join(opts.layouts)}) in "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print(f"ended with a signal: {len(signals)}" + (f" ({', '.join(signals)})" if signals else ""))
    print(f"other failures: {len(failures)}" + (f" ({', '.join(failures)})" if failures else ""))
    print(f"process group alive after destroy: {len(leaks)}" + (f" ({', '.join(leaks)})" if leaks else ""))
    return 1 if signals or failures or leaks else 0


if __name__ == "__main__":
    sys.exit(main())
