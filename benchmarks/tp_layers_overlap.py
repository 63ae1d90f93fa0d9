"""Does async TP communication overlap help on gloo? An MLP block (column H->F, row F->H) fwd+bwd.

    .venv/bin/torchrun --standalone --nproc-per-node 2 benchmarks/tp_layers_overlap.py [S B H F]

Prints the median ms per fwd+bwd (MAX over ranks) for each mode with async off/on and the ratio.
Gloo runs collectives on a background thread, so overlap is real when a core is free for it; with
1 compute thread per rank and ranks <= cores it can hide part of the communication.
"""

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.tensor_parallel import TensorParallelColumnLinear, TensorParallelRowLinear


def bench(pc, mode, async_, S, B, H, Fdim, iters=15, warmup=3):
    torch.manual_seed(0)
    up = TensorParallelColumnLinear(H, Fdim, pc.tp_pg, mode, async_communication=async_)
    down = TensorParallelRowLinear(Fdim, H, pc.tp_pg, mode, async_communication=async_)
    for p in (*up.parameters(), *down.parameters()):
        p.data.normal_(0, 0.02)
    s = S // pc.tp_size if mode == "REDUCE_SCATTER" else S
    x = torch.randn(s, B, H, requires_grad=True)
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=pc.tp_pg)
        t0 = time.perf_counter()
        down(torch.relu(up(x))).sum().backward()
        dt = torch.tensor(time.perf_counter() - t0)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=pc.tp_pg)
        if i >= warmup:
            times.append(dt.item() * 1e3)
    return statistics.median(times)


def main():
    S, B, H, Fdim = (int(a) for a in (sys.argv[1:5] or (512, 4, 512, 2048)))
    torch.set_num_threads(1)
    pc = ParallelContext(tensor_parallel_size=int(os.environ["WORLD_SIZE"]))  # all ranks are tp
    for mode in ("ALL_REDUCE", "REDUCE_SCATTER"):
        sync, asyn = bench(pc, mode, False, S, B, H, Fdim), bench(pc, mode, True, S, B, H, Fdim)
        if pc.world_rank == 0:
            print(
                f"tp={pc.tp_size} {mode:15s} S={S} B={B} H={H} F={Fdim}: sync {sync:7.1f} ms, "
                f"async {asyn:7.1f} ms, async/sync {asyn / sync:.2f}",
                flush=True,
            )
    pc.destroy()


if __name__ == "__main__":
    main()
