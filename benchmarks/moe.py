"""Expert parallelism: what holding half the experts per rank costs against plain data parallelism.

    .venv/bin/python benchmarks/moe.py            # 8 experts top-2, seq 256
    .venv/bin/python benchmarks/moe.py --quick    # fewer timed steps

The same tiny MoE Llama (8 experts, top-2, every layer MoE), data and AdamW in three layouts with
the same global batch: one process (ep1, two micro-batches), ep2 (two ranks, each holding 4 of
the 8 experts of every layer and reading its half of the batch; tokens cross ranks in two
all-to-alls per layer and direction) and dp2 (two ranks, each holding all 8 experts). Reported:
tokens/s of full training steps (median over timed steps, slowest rank), the share of the step
spent in ``all_to_all_single`` (counts and rows, forward and backward, max over ranks), the
expert-load imbalance (busiest expert over mean, max over layers, first step), parameter bytes
and the peak bytes autograd saves in one micro-batch's forward per rank, and the first step's
loss, which must equal the one process's (a benchmark of a wrong computation is void).
PyTorch has no native MoE / expert-parallel module to run side by side (torchtitan builds its own
on DTensor and CUDA grouped GEMMs), so dp2 — the layout ep competes with — is the baseline.
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

from nanotrain.config import ModelArgs, MoEArgs, OptimizerArgs  # noqa: E402
from nanotrain.logging.moe_stats import step_scalars  # noqa: E402
from nanotrain.models.llama_parallelize import build_llama  # noqa: E402
from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups  # noqa: E402
from nanotrain.parallel.data_parallel import build_grad_sync  # noqa: E402
from nanotrain.parallel.parallel_context import ParallelContext, destroy_process_groups  # noqa: E402
from nanotrain.training.step import train_step  # noqa: E402

MOE = dict(num_experts=8, top_k=2, expert_intermediate_size=256, aux_loss_coef=0.01)
MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=1024,
    dtype="float32",
)
SEQUENCES = 4  # per step, global


class A2ATimer:
    """Wall time inside ``dist.all_to_all_single`` (the expert dispatch calls it through ``dist``)."""

    def __init__(self):
        self.seconds, self._orig = 0.0, dist.all_to_all_single

    def __enter__(self):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return self._orig(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        dist.all_to_all_single = timed
        return self

    def __exit__(self, *exc):
        dist.all_to_all_single = self._orig


def measure(layout: str, seq: int, steps: int, warmup: int) -> dict:
    world = dist.get_world_size()
    pc = ParallelContext(
        expert_parallel_size=world if layout == "ep2" else 1, data_parallel_size=world if layout == "dp2" else 1
    )
    try:
        return _measure(pc, seq, steps, warmup)
    finally:
        pc.destroy()


def _measure(pc, seq: int, steps: int, warmup: int) -> dict:
    args = ModelArgs(**MODEL, moe=MoEArgs(**MOE))
    model = build_llama(args, pc.tp_pg, seed=0, ep_pg=pc.ep_pg)
    optim_args = OptimizerArgs(lr=1e-3, warmup_steps=0)
    grad_sync = build_grad_sync(list(model.parameters()), pc)
    optimizer = build_optimizer(model.named_parameters(), optim_args, **optimizer_groups(pc))
    scheduler = build_lr_scheduler(optimizer, optim_args, steps + warmup)
    tokens = torch.randint(0, MODEL["vocab_size"], (SEQUENCES, seq + 1), generator=torch.Generator().manual_seed(0))
    mine = tokens.chunk(pc.data_size)[pc.data_rank]
    micro = [(mb[:, :-1], mb[:, 1:]) for mb in mine.split(SEQUENCES // 2)]  # 2 sequences per micro-batch
    model.begin_step(1)  # the MoE auxiliary losses' share of one micro-batch
    activation = saved_bytes(model, *micro[0])
    times, shares, first_loss, imbalance = [], [], None, None
    for step in range(warmup + steps):
        dist.barrier()
        with A2ATimer() as a2a:
            t0 = time.perf_counter()
            stats = train_step(model, micro, grad_sync, optimizer, scheduler, pc, optim_args.clip_grad)
            loss = stats.loss
            elapsed = time.perf_counter() - t0
        if first_loss is None:
            first_loss = loss
            imbalance = step_scalars(model.moe_state)["moe/load_max_over_mean"]
        if step >= warmup:
            times.append(max_over_ranks(elapsed))
            shares.append(max_over_ranks(a2a.seconds / elapsed))
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    return {
        "tokens_per_s": SEQUENCES * seq / statistics.median(times),
        "a2a_share": statistics.median(shares),
        "imbalance": max_over_ranks(imbalance),
        "param_bytes": max_over_ranks(params),
        "activation_bytes": max_over_ranks(activation),
        "first_loss": first_loss,
    }


def worker(payload: dict) -> dict:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    result = measure(payload["layout"], payload["seq"], payload["steps"], payload["warmup"])
    destroy_process_groups()
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 timed steps after 1 warm-up (default 6 after 2)")
    parser.add_argument("--seq", type=int, default=256)
    opts = parser.parse_args()
    steps, warmup = (2, 1) if opts.quick else (6, 2)
    t0 = time.perf_counter()
    layouts = {"ep1": 1, "ep2": 2, "dp2": 2}
    results = {
        name: run_workers(__file__, world, {"layout": name, "seq": opts.seq, "steps": steps, "warmup": warmup})
        for name, world in layouts.items()
    }
    print(
        f"\nExpert parallelism — MoE Llama ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"{MOE['num_experts']} experts top-{MOE['top_k']}, expert width {MOE['expert_intermediate_size']}), "
        f"{SEQUENCES} x {opts.seq} tokens per step, gloo, 1 thread per rank, {os.cpu_count()} CPU cores; "
        f"median of {steps} steps after {warmup} warm-up; {time.perf_counter() - t0:.0f} s\n"
    )
    print(
        "| layout | tokens/s | vs dp2 | all-to-all share | load max/mean | param MB per rank "
        "| activation MB per rank | first loss | same loss |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    ref, dp2 = results["ep1"], results["dp2"]
    same_everywhere = True
    for name, r in results.items():
        same = same_loss(r["first_loss"], ref["first_loss"])
        same_everywhere &= same
        print(
            f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / dp2['tokens_per_s']:.2f} | "
            f"{r['a2a_share']:.1%} | {r['imbalance']:.2f} | {r['param_bytes'] / 2**20:.2f} | "
            f"{r['activation_bytes'] / 2**20:.1f} | {r['first_loss']:.6f} | {'yes' if same else 'NO'} |"
        )
    return 0 if same_everywhere else 1


if __name__ == "__main__":
    entry(main, worker)
