#!/usr/bin/env python3
"""Tokens/s of the pp=1 training step at several (dp, tp, tp_mode, async) layouts, tiny model.

    .venv/bin/python benchmarks/tp_dp_throughput.py [--repeats 3] [--steps 10]

Strong scaling: the global batch is fixed (16 sequences of 64 tokens = 1,024 tokens per step, as
in benchmarks/README.md), so dp=2 runs half the micro-batches per replica.
Each layout is a fresh set of local processes (1 thread per rank); layouts run alternately
(A B C A B C ...) and the median over repeats is reported. A step is timed from a barrier to the
slowest rank's end (all-reduce MAX), after warm-up steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYOUTS = [  # name, dp, tp, mode, async
    ("1 process", 1, 1, "ALL_REDUCE", False),
    ("dp2", 2, 1, "ALL_REDUCE", False),
    ("tp2 ALL_REDUCE", 1, 2, "ALL_REDUCE", False),
    ("tp2 REDUCE_SCATTER", 1, 2, "REDUCE_SCATTER", False),
    ("tp2 ALL_REDUCE async", 1, 2, "ALL_REDUCE", True),
    ("tp2 REDUCE_SCATTER async", 1, 2, "REDUCE_SCATTER", True),
]
SEQ, GLOBAL_SEQS = 64, 16


def worker(dp: int, tp: int, mode: str, async_comm: bool, steps: int, warmup: int, micro_batch: int, out: str) -> None:
    import torch
    import torch.distributed as dist

    from nanotrain.config import load_config
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.training.step import train_step

    torch.set_num_threads(1)
    config = load_config(ROOT / "configs" / "tiny_cpu.yaml")
    pc = ParallelContext(tensor_parallel_size=tp, data_parallel_size=dp)
    model = build_llama(config.model, pc.tp_pg, mode=mode, async_communication=async_comm, seed=1)
    grad_sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    optimizer = build_optimizer(model.named_parameters(), config.optimizer, pc.dp_cp_pg)
    scheduler = build_lr_scheduler(optimizer, config.optimizer, warmup + steps)
    gen = torch.Generator().manual_seed(0)
    per_replica = GLOBAL_SEQS // dp
    times, losses = [], []
    for step in range(warmup + steps):
        batch = torch.randint(0, config.model.vocab_size, (GLOBAL_SEQS, SEQ + 1), generator=gen)
        mine = batch[pc.dp_rank * per_replica : (pc.dp_rank + 1) * per_replica]
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(micro_batch)]
        dist.barrier()
        start = time.perf_counter()
        stats = train_step(model, micro, grad_sync, optimizer, scheduler, pc, config.optimizer.clip_grad)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        if step >= warmup:
            times.append(elapsed.item())
        losses.append(stats.loss)
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"times": times, "losses": losses}))
    del model, grad_sync, optimizer, scheduler, stats  # they hold the groups pc.destroy() frees
    pc.destroy()


def run_layout(dp, tp, mode, async_comm, steps, warmup, micro_batch) -> dict:
    from nanotrain.launch.local import run_local

    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [
            sys.executable,
            __file__,
            "--worker",
            str(dp),
            str(tp),
            mode,
            str(int(async_comm)),
            str(steps),
            str(warmup),
            str(micro_batch),
            str(out),
        ]
        status = run_local(command, dp * tp, Path(tmp) / "logs", quiet=True)
        if status != 0:
            raise RuntimeError(f"layout dp{dp} tp{tp} {mode} failed: see logs")
        return json.loads(out.read_text())


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        dp, tp, mode, async_comm, steps, warmup, micro_batch, out = sys.argv[2:]
        worker(int(dp), int(tp), mode, bool(int(async_comm)), int(steps), int(warmup), int(micro_batch), out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--micro-batch", type=int, default=8, help="sequences per micro-batch (16 sequences per step in all)"
    )
    args = parser.parse_args()
    medians: dict[str, list[float]] = {name: [] for name, *_ in LAYOUTS}
    first_loss: dict[str, float] = {}
    for _ in range(args.repeats):
        for name, dp, tp, mode, async_comm in LAYOUTS:
            result = run_layout(dp, tp, mode, async_comm, args.steps, args.warmup, args.micro_batch)
            medians[name].append(statistics.median(result["times"]))
            first_loss[name] = result["losses"][0]
    tokens = GLOBAL_SEQS * SEQ
    base = statistics.median(medians[LAYOUTS[0][0]])
    print(f"{tokens} tokens/step, micro-batch {args.micro_batch} x {SEQ} tokens, median of {args.repeats}")
    print("| layout | ranks | ms/step | tokens/s | vs 1 process | first loss |")
    print("|---|---|---|---|---|---|")
    for name, dp, tp, *_ in LAYOUTS:
        step = statistics.median(medians[name])
        print(
            f"| {name} | {dp * tp} | {step * 1e3:.0f} | {tokens / step:,.0f} | {base / step:.2f} | "
            f"{first_loss[name]:.6f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
