"""Pipeline bubble: measured vs theoretical, and tokens/s, for afab / 1f1b / interleaved_1f1b.

    .venv/bin/python benchmarks/pipeline_bubble.py            # pp 2 and 4, m = 4, 8, 16
    .venv/bin/python benchmarks/pipeline_bubble.py --quick    # fewer timed steps

One local gloo process per pipeline stage (one thread each; ``bench_launch.py``), a tiny Llama (8 layers), full
training steps (engine + optimizer). The engine times each rank's forward and backward compute;
the measured bubble of a stage is ``1 - compute / wall time of the engine's forward_backward``
(idle while waiting for a neighbour, plus the P2P cost), averaged over the stages and the median
over the timed steps. Theoretical: (p - 1) / (m + p - 1), interleaved (p - 1) / (v*m + p - 1).
tokens/s = tokens of the step / step wall time (slowest rank). A pp=1 row is the no-pipeline
baseline of the same model and micro-batches.

Caveat on small machines: with more stages than cores (pp 4 on 2 cores) ranks share cores, so
compute slows down while neighbours compute and the measured bubble understates the idle time a
rank would see with a core (or GPU) of its own.
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

from bench_launch import entry, run_workers  # noqa: E402

MODEL = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=256,
    num_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=64,
)
SEQ, MICRO_BATCH, VIRTUAL = 64, 2, 2
ENGINES = ("afab", "1f1b", "interleaved_1f1b")


def run_config(pc, engine_name: str, m: int, steps: int, warmup: int) -> dict:
    from nanotrain.config import ModelArgs, OptimizerArgs
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.pipeline_parallel import PipelineEngine
    from nanotrain.training.step import train_step

    args = ModelArgs(**MODEL)
    v = VIRTUAL if engine_name == "interleaved_1f1b" else 1
    model = build_llama(args, pc.tp_pg, pp_rank=pc.pp_rank, pp_size=pc.pp_size, virtual_stages=v, seed=0)
    optim_args = OptimizerArgs(lr=1e-3, warmup_steps=0)
    grad_sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    optimizer = build_optimizer(model.named_parameters(), optim_args, pc.dp_cp_pg)
    scheduler = build_lr_scheduler(optimizer, optim_args, steps + warmup)
    engine = PipelineEngine(engine_name, pc.pp_pg) if pc.pp_size > 1 else None
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab_size, (m, MICRO_BATCH, SEQ + 1), generator=gen)
    micro = [(t[:, :-1], t[:, 1:]) for t in tokens]
    step_s, bubbles = [], []
    for step in range(warmup + steps):
        dist.barrier()
        start = time.perf_counter()
        train_step(model, micro, grad_sync, optimizer, scheduler, pc, 1.0, engine)
        elapsed = torch.tensor(time.perf_counter() - start, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        bubble = torch.zeros(pc.pp_size, dtype=torch.float64)
        if engine is not None:
            bubble[pc.pp_rank] = engine.last_stats.bubble
        dist.all_reduce(bubble)  # every stage's bubble, on every rank
        if step >= warmup:
            step_s.append(elapsed.item())
            bubbles.append(bubble.tolist())
    live = engine.last_stats.peak_live_microbatches if engine is not None else 1
    per_stage = [statistics.median(b[s] for b in bubbles) for s in range(pc.pp_size)]
    return {"step_s": statistics.median(step_s), "bubble": per_stage, "live_stage0": live, "v": v}


def worker(payload: dict) -> list:
    """One rank of a launch: every (engine, m) config at pp = world size, in turn."""
    from nanotrain.parallel.parallel_context import ParallelContext

    torch.set_num_threads(1)
    configs, steps, warmup = payload["configs"], payload["steps"], payload["warmup"]
    pc = ParallelContext(pipeline_parallel_size=int(os.environ["WORLD_SIZE"]))
    results = []
    for engine_name, m in configs:
        live = torch.zeros(1)
        result = run_config(pc, engine_name, m, steps, warmup)
        live[0] = result["live_stage0"]
        dist.broadcast(live, src=0)  # report stage 0's peak (it holds the most)
        result["live_stage0"] = int(live.item())
        results.append((engine_name, m, result))
    pc.destroy()
    return results


def launch(pp: int, configs: list, steps: int, warmup: int) -> list:
    return run_workers(__file__, pp, {"configs": configs, "steps": steps, "warmup": warmup})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 timed steps after 1 warm-up (default 8 after 2)")
    parser.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--m", type=int, nargs="+", default=[4, 8, 16])
    opts = parser.parse_args()
    steps, warmup = (3, 1) if opts.quick else (8, 2)
    from nanotrain.parallel.pipeline_parallel import theoretical_bubble

    tokens = {m: m * MICRO_BATCH * SEQ for m in opts.m}
    rows = []
    t0 = time.perf_counter()
    baseline = launch(1, [("afab", m) for m in opts.m], steps, warmup)
    for _, m, r in baseline:
        rows.append((1, "none", 1, m, tokens[m] / r["step_s"], 0.0, 0.0, 0.0, 1))
    for pp in opts.pp:
        configs = [(e, m) for e in ENGINES for m in opts.m if not (e == "interleaved_1f1b" and m % pp)]
        for engine_name, m, r in launch(pp, configs, steps, warmup):
            theory = theoretical_bubble(engine_name, pp, m, r["v"])
            rows.append(
                (
                    pp,
                    engine_name,
                    r["v"],
                    m,
                    tokens[m] / r["step_s"],
                    statistics.mean(r["bubble"]),
                    max(r["bubble"]),
                    theory,
                    r["live_stage0"],
                )
            )
    print(
        f"\nPipeline bubble — tiny Llama ({MODEL['num_layers']} layers, hidden {MODEL['hidden_size']}, "
        f"seq {SEQ}, micro-batch {MICRO_BATCH}), gloo, 1 thread per stage, {os.cpu_count()} CPU cores; "
        f"median of {steps} steps after {warmup} warm-up; {time.perf_counter() - t0:.0f} s\n"
    )
    print(
        "| pp | engine | v | m | tokens/s | bubble measured (mean of stages) | worst stage | "
        "theoretical | peak live micro-batches (stage 0) |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for pp, name, v, m, tps, mean_b, max_b, theory, live in rows:
        print(f"| {pp} | {name} | {v} | {m} | {tps:,.0f} | {mean_b:.2f} | {max_b:.2f} | {theory:.2f} | {live} |")


if __name__ == "__main__":
    entry(main, worker)
