"""The stages of benchmarks/gpu_check.sh, under one time budget; ``--cpu-smoke`` runs the same
stages on CPU (tiny model, gloo), so that CI proves their logic where no GPU is lent.

    benchmarks/gpu_check.sh                                   # how it is run (finds Python, wheels)
    python benchmarks/gpu_trainer_check.py --out DIR [--start EPOCH] [--budget S] [--steps S]
    python benchmarks/gpu_trainer_check.py --out DIR --cpu-smoke

The budget (``--budget``, GPU_CHECK_BUDGET, 290 s) counts from ``--start`` (the shell script's
start); each stage gets min(its cap, what is left), every subprocess a timeout, after which its
whole process tree is killed (rc 124: the local launcher's ranks run in sessions of their own, so
a process-group kill alone would leave them holding GPUs). ``DIR/gpu_check.json`` is rewritten
after every stage; logs go to ``DIR/gpu_check/``; run directories and checkpoints stay in a
temporary folder. Exit 0 only when every stage that ran passed (skipped and unavailable pass).

1. versions: Python, torch, CUDA, cuDNN, NCCL, the GPUs, ``nvidia-smi -L``, the packages the
   trainer imports. In a subprocess: this driver never creates a CUDA context, which would hold
   memory on GPU 0 beside the runs it measures.
2. gpu-tests: ``pytest -m gpu tests/test_gpu.py`` (skipped by --cpu-smoke: every test needs CUDA).
3. trainer: ``python -m nanotrain.runtime.task`` at world size 1 (the module run as ``__main__``
   by runpy, in a process that reads the CUDA allocator's peaks when it ends), the first job's
   settings (bf16, ZeRO-1, fused AdamW, tp_mode ALL_REDUCE, its env) on a 0.18 B Llama, sequence 2048, the
   stdlib corpus, a constant learning rate after warm-up (so a run extended by a resume follows
   the uninterrupted one step for step):
   * ``uninterrupted``: 3S steps;
   * ``first``: S steps, a sync save at S; ``resumed``: the same run directory with
     ``checkpoints.resume`` to 2S (model, fused AdamW / ZeRO-1 state, scheduler and RNG loaded),
     async saves every S/2 steps (the first one's copies overlap the next step); ``resumed-async``:
     from that async save at 2S to 3S. Steps S+1..3S must give the uninterrupted run's losses: the
     max |difference| is reported; not bit-identical passes only as "within nondeterminism", when
     two fresh runs (``first`` and ``uninterrupted``, steps 1..S) differ too and the resumed
     difference is at most 10 times theirs;
   * ``compiled``: ``training.compile: true`` (decoder layers compiled, forward and backward), 3
     steps: losses finite and within 2% of eager. Skipped by --cpu-smoke: inductor takes ~55 s for
     the tiny model on the CI machine's CPU, past the 20 s this smoke may spend on it;
   * memory of the uninterrupted run: ``max_memory_allocated``, ``max_memory_reserved``, the
     device-wide peak (``mem_get_info``, sampled every 0.25 s: context, NCCL, allocator reserve)
     beside the --dry-run estimate.
   The GPU machine has no ``datasets`` (its wheels are 66 MB, pyarrow alone 55 MB), which the
   trainer needs only to tokenise a corpus that has no cache yet: this stage writes the stdlib
   corpus's byte-tokenised cache itself (``write_token_cache``: the files, ids, separators and
   meta.json nanotrain's own tokenisation writes; --cpu-smoke checks them byte for byte, and runs
   the trainer with ``datasets`` made unimportable, as on the GPU machine).
4. multi-gpu: with >= 4 GPUs tp2 x pp2 1f1b, with 2-3 pp2 1f1b, through ``submit.py --local``: an
   uninterrupted run of 2S steps, S steps with a save, ``submit.py --resume`` to 2S, the same loss
   check. Skipped on one GPU (NCCL refuses two ranks on one device) and by --cpu-smoke (4 ranks
   cost ~20 s on 2 cores: the layout's config is validated instead).
5. flight-recorder: one process (NCCL on GPU 0; gloo under --cpu-smoke) with nanotrain's
   flight-recorder settings (``runtime/hang.py:nccl_debug_env``, the installed torch's variable
   names) all-reduces through ``parallel/collectives.py``, then the hang watchdog writes its
   report: the settings must point into the run's ``hang/`` directory, the report must name the
   last collective and embed torch's record of it (``nccl:all_reduce``), and torch's own dump
   file must be beside it (``hang/nccl_trace_rank_0``, for ``torchfrtrace``). On a GPU, NCCL's
   own dump is also triggered through its debug pipe and looked for there (reported).
6. rehearsal: ``submit.py CONFIG --rehearse --rank 0 --steps 3S --json`` on stage 3's config:
   rehearsed peak total / the uninterrupted run's ``max_memory_allocated``; "unavailable" while
   submit.py has no --rehearse. Skipped by --cpu-smoke (it starts a fresh interpreter for each
   rehearsed rank: 6-20 s on 2 cores) unless GPU_CHECK_SMOKE_REHEARSE=1.
7. masked-attention: ``masked_attention.py --gpu-check``: compiled FlexAttention forward and
   backward (``model.attention_kernel: flex``) on the GPU against the CPU reference (SDPA under
   the materialised document mask, float64), the whole window and a cp2 rank's zig-zag queries;
   then tokens/s and peak memory of causal, sdpa_mask and flex at S = 8192 (bf16); fails when flex
   differs (relative 1e-4) or its peak exceeds 1.1 x causal's. Skipped with less than 45 s of the
   budget left (GPU_CHECK_BUDGET=380 leaves it room); --cpu-smoke runs its logic on the CPU with
   eager FlexAttention, forward only.
8. bench: ``gpu_train_bench.py`` (the ~1.1 B model's tokens/s and MFU) only with GPU_CHECK_BENCH=1
   (GPU_CHECK_COMPILE=1: also compiled, in what is left); --cpu-smoke runs its own smoke.

Under --cpu-smoke the Python runs fork from one process that imported torch and nanotrain once
(nanotrain's fork server, as a local CPU job's ranks do): ~3 CPU seconds less each. On a GPU
every run is a fresh interpreter.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_stages.check import Check, Stopped  # noqa: E402 - nanotrain importable first
from gpu_stages.environment import stage_gpu_tests, stage_versions  # noqa: E402
from gpu_stages.flight_recorder import stage_flight_recorder  # noqa: E402
from gpu_stages.limits import BUDGET_S, ROOT  # noqa: E402
from gpu_stages.measurements import stage_bench, stage_masked_attention, stage_rehearsal  # noqa: E402
from gpu_stages.multi_gpu import stage_multi_gpu  # noqa: E402
from gpu_stages.runs import task_with_memory  # noqa: E402
from gpu_stages.trainer import stage_trainer  # noqa: E402
from gpu_stages.workspace import Workspace  # noqa: E402

STAGES = [
    ("versions", stage_versions),
    ("gpu-tests", stage_gpu_tests),
    ("trainer", stage_trainer),
    ("multi-gpu", stage_multi_gpu),
    ("flight-recorder", stage_flight_recorder),
    ("rehearsal", stage_rehearsal),
    ("masked-attention", stage_masked_attention),
    ("bench", stage_bench),
]


def table(summary: dict) -> str:
    rows = [("stage", "status", "wall s", "limit s", "")]
    rows += [
        (s["name"], s["status"], f"{s['wall_s']:.0f}", str(s["limit_s"]), s.get("note", "")) for s in summary["stages"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines.append(
        f"{summary['elapsed_s']:.0f} s of {summary['budget_s']:.0f}: "
        f"{'every stage that ran passed' if summary['ok'] else 'FAILED'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--task"]:  # one trainer run (stage 3), in its own process
        task = argparse.ArgumentParser()
        task.add_argument("--task", required=True)
        task.add_argument("--memory-out", type=Path, required=True)
        args = task.parse_args(argv)
        task_with_memory(args.task, args.memory_out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="gpu_check.json here, logs in OUT/gpu_check/")
    parser.add_argument("--start", type=float, default=time.time(), help="epoch seconds the budget counts from")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", BUDGET_S)))
    parser.add_argument("--steps", type=int, help="S: the trainer runs 3S steps (default 4; --cpu-smoke 2)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (gloo): the logic, no GPU")
    opts = parser.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # what every run sees as its working directory, forked or not
    check = Check(opts.out.resolve(), opts.start, opts.budget, opts.cpu_smoke, len(STAGES))
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, check.stop)
    status = 0
    with tempfile.TemporaryDirectory(prefix="nanotrain-gpu-check-", ignore_cleanup_errors=True) as tmp:
        check.ws = Workspace(Path(tmp), opts.cpu_smoke, opts.steps or (2 if opts.cpu_smoke else 4))
        try:
            for name, fn in STAGES:
                check.stage(name, fn)
        except Stopped:
            status = 124
        finally:
            check.ws.close()
    check.write()
    print(table(check.summary), flush=True)
    return status or (0 if check.summary["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
