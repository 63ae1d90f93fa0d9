"""Context parallelism: what splitting every sequence over 2 ranks costs and saves.

    .venv/bin/python benchmarks/context_parallel.py              # sequences 512, 1024, 2048
    .venv/bin/python benchmarks/context_parallel.py --quick      # fewer timed steps

The same tiny Llama, data and AdamW in three layouts: one process (the reference), cp2 (each
sequence split in zig-zag halves over two ranks) and dp2 (the other way to use two ranks: each
takes half of the sequences). Reported per layout and sequence length: tokens/s of full training
steps (median over timed steps, slowest rank), peak bytes autograd saves for backward in one
micro-batch's forward on a rank (parameters excluded; the activation memory cp divides), and the
first step's loss, which must equal the one process's (a benchmark of a wrong computation is
void). dp2 also halves a rank's activations here, but only down to one sequence per rank; cp is
what splits a single sequence, so it is what lets a sequence too long for one rank train at all.
PyTorch's own ``context_parallel`` cannot be the side-by-side baseline here: in torch 2.13 it
dispatches only the CUDA flash / efficient / cuDNN attention kernels, and on CPU it fails with
"aten._scaled_dot_product_flash_attention_for_cpu.default does not have a sharding strategy".
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_common import max_over_ranks, saved_bytes  # noqa: E402
from bench_launch import entry, run_workers, same_loss  # noqa: E402

# Imported before any process group exists (the model pulls in torch._dynamo, whose import takes
# references to an existing default group that live until interpreter exit).
from nanotrain.config import ModelArgs, OptimizerArgs  # noqa: E402
from nanotrain.models.llama_parallelize import build_llama  # noqa: E402
from nanotrain.optim import build_lr_scheduler, build_optimizer  # noqa: E402
from nanotrain.parallel.data_parallel import BucketedGradSync  # noqa: E402
from nanotrain.parallel.parallel_context import ParallelContext, destroy_process_groups  # noqa: E402
from nanotrain.training.step import train_step  # noqa: E402

MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=4096,
)
SEQUENCES = 4  # per step, global: one process takes all, dp2 two each, cp2 all (halves of each)


def run_layout(layout: str, seq: int, steps: int, warmup: int) -> dict:
    world = dist.get_world_size()
    pc = ParallelContext(
        context_parallel_size=world if layout == "cp2" else 1, data_parallel_size=world if layout == "dp2" else 1
    )
    try:
        return measure(pc, seq, steps, warmup)  # its model, optimizer and sync are freed on return
    finally:
        pc.destroy()


def measure(pc, seq: int, steps: int, warmup: int) -> dict:
    model = build_llama(ModelArgs(**MODEL), pc.tp_pg, seed=0, cp_pg=pc.cp_pg)
    optim_args = OptimizerArgs(lr=1e-3, warmup_steps=0)
    grad_sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    optimizer = build_optimizer(model.named_parameters(), optim_args, pc.dp_cp_pg)
    scheduler = build_lr_scheduler(optimizer, optim_args, steps + warmup)
    tokens = torch.randint(0, MODEL["vocab_size"], (SEQUENCES, seq + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens.chunk(pc.dp_size)[pc.dp_rank]  # cp ranks take the same sequences
    micro = [(mine[:, :-1], mine[:, 1:])]
    activation = saved_bytes(model, *micro[0])
    times, first_loss = [], None
    for step in range(warmup + steps):
        dist.barrier()
        t0 = time.perf_counter()
        stats = train_step(model, micro, grad_sync, optimizer, scheduler, pc, optim_args.clip_grad)
        elapsed = max_over_ranks(time.perf_counter() - t0)
        first_loss = stats.loss if first_loss is None else first_loss
        if step >= warmup:
            times.append(elapsed)
    return {
        "tokens_per_s": SEQUENCES * seq / statistics.median(times),
        "activation_bytes": max_over_ranks(activation),
        "first_loss": first_loss,
    }


def worker(payload: dict) -> dict:
    """One rank of a launch: the layout at every sequence length, in turn."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    results = {seq: run_layout(payload["layout"], seq, payload["steps"], payload["warmup"]) for seq in payload["seqs"]}
    destroy_process_groups()  # every group freed (threads joined) before the interpreter exits
    return results


def launch(layout: str, seqs: list[int], steps: int, warmup: int, timeout_s: float = 1800, log_dir=None) -> dict:
    world = 1 if layout == "1 process" else 2
    results = run_workers(
        __file__, world, {"layout": layout, "seqs": seqs, "steps": steps, "warmup": warmup}, timeout_s, log_dir
    )
    return {int(k): v for k, v in results.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up (default 6 after 2)")
    parser.add_argument("--seq", type=int, nargs="+", default=[512, 1024, 2048])
    opts = parser.parse_args()
    steps, warmup = (2, 1) if opts.quick else (6, 2)
    t0 = time.perf_counter()
    results = {layout: launch(layout, opts.seq, steps, warmup) for layout in ("1 process", "cp2", "dp2")}
    print(
        f"\nContext parallelism — tiny Llama ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"GQA {MODEL['num_attention_heads']}/{MODEL['num_key_value_heads']}), {SEQUENCES} sequences per step, "
        f"gloo, 1 thread per rank, {os.cpu_count()} CPU cores; median of {steps} steps after {warmup} warm-up; "
        f"{time.perf_counter() - t0:.0f} s\n"
    )
    print(
        "| seq | layout | tokens/s | activation MB per rank (one micro-batch) | vs 1 process | first loss | same loss |"
    )
    print("|---|---|---|---|---|---|---|")
    same_everywhere = True
    for seq in opts.seq:
        ref = results["1 process"][seq]
        for layout in ("1 process", "cp2", "dp2"):
            r = results[layout][seq]
            same = same_loss(r["first_loss"], ref["first_loss"])
            same_everywhere &= same
            print(
                f"| {seq} | {layout} | {r['tokens_per_s']:,.0f} | {r['activation_bytes'] / 2**20:.1f} | "
                f"{r['activation_bytes'] / ref['activation_bytes']:.2f} | {r['first_loss']:.6f} | "
                f"{'yes' if same else 'NO'} |"
            )
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    entry(main, worker)
