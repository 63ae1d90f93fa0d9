"""Measure checkpoint save / load time and size (CPU, gloo, local processes).

    python -m nanotrain.checkpoint.bench --model tiny --dp 2 --tp 2 [--granularity rank|param] [--dir /tmp/x]
    python -m nanotrain.checkpoint.bench --model 100m --dp 2 --tp 2

Per setting: the median over ``--repeats`` of the save (all ranks, commit included, measured on
rank 0 from a barrier to the return) and of a same-topology load into fresh objects, the bytes
and files on disk; then a one-process load of that checkpoint (resharding to dp1 tp1) and a
sha256 pass over every file. Optimizer states are made real by one AdamW step on constant
gradients. Results are printed as one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODELS = {
    # configs/tiny_cpu.yaml's model
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=256, num_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256, dtype="float32"),
    # ~96M parameters (Llama-style, tied 32k vocabulary)
    "100m": dict(vocab_size=32000, hidden_size=768, intermediate_size=2048, num_layers=10, num_attention_heads=12,
                 num_key_value_heads=12, max_position_embeddings=1024, dtype="float32", tie_word_embeddings=True),
}


def _build(model_name: str, pc, zero: int, seed: int = 0):
    import torch

    from nanotrain.config import ModelArgs, OptimizerArgs
    from nanotrain.models.llama import LlamaModel
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    args = ModelArgs(**MODELS[model_name])
    opt_args = OptimizerArgs(lr=1e-3, warmup_steps=1, zero_stage=zero)
    model = LlamaModel(args, pc.tp_pg if pc is not None else None, seed=seed)
    dp_pg = pc.dp_cp_pg if pc is not None else None
    optimizer = build_optimizer(model.named_parameters(), opt_args, dp_pg, zero_stage=zero)
    scheduler = build_lr_scheduler(optimizer, opt_args, 100)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return model, optimizer, scheduler


def _worker(opts) -> None:
    import torch.distributed as dist

    from nanotrain.checkpoint import load_checkpoint, save_checkpoint
    from nanotrain.parallel.context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=opts.tp, data_parallel_size=opts.dp)
    model, optimizer, scheduler = _build(opts.model, pc, opts.zero)
    fresh = _build(opts.model, pc, opts.zero, seed=1)
    saves, loads = [], []
    for i in range(opts.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(opts.dir, i + 1, model, optimizer, scheduler, pc, extra={"consumed_samples": i},
                        keep_last=1, granularity=opts.granularity)
        saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        load_checkpoint(opts.dir, *fresh, pc)
        loads.append(time.perf_counter() - t0)
    if pc.world_rank == 0:
        Path(opts.result).write_text(json.dumps({"save_s": saves, "load_s": loads}))
    pc.destroy()


def run(model: str, dp: int, tp: int, zero: int, granularity: str, directory: str, repeats: int) -> dict:
    from nanotrain.checkpoint import load_checkpoint
    from nanotrain.checkpoint.format import verify_checkpoint
    from nanotrain.launch.env import free_port

    world = dp * tp
    result = Path(tempfile.mkstemp(suffix=".json")[1])
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "nanotrain.checkpoint.bench", "--worker", "--model", model, "--dp", str(dp),
             "--tp", str(tp), "--zero", str(zero), "--granularity", granularity, "--dir", directory,
             "--repeats", str(repeats), "--result", str(result)], env=env))
    codes = [p.wait() for p in procs]
    if any(codes):
        raise SystemExit(f"bench ranks failed: {codes}")
    times = json.loads(result.read_text())
    result.unlink()
    ckpt = sorted(Path(directory).glob("step_*"))[-1]
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    t0 = time.perf_counter()
    assert not verify_checkpoint(ckpt)
    hash_s = time.perf_counter() - t0
    single = _build(model, None, 0, seed=2)
    t0 = time.perf_counter()
    load_checkpoint(directory, *single)
    reshard_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in single[0].parameters())
    return {"model": model, "params": n_params, "dp": dp, "tp": tp, "zero": zero, "granularity": granularity,
            "files": len(files), "mb": round(sum(p.stat().st_size for p in files) / 1e6, 2),
            "save_s": round(statistics.median(times["save_s"]), 4),
            "load_s": round(statistics.median(times["load_s"]), 4),
            "save_min_s": round(min(times["save_s"]), 4), "load_min_s": round(min(times["load_s"]), 4),
            "load_resharded_1proc_s": round(reshard_s, 4), "verify_all_s": round(hash_s, 4)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS), default="tiny")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--granularity", choices=("rank", "param"), default="rank")
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--result")
    opts = ap.parse_args(argv)
    if opts.worker:
        _worker(opts)
        return
    directory = opts.dir or tempfile.mkdtemp(prefix="ckpt-bench-")
    print(json.dumps(run(opts.model, opts.dp, opts.tp, opts.zero, opts.granularity, directory, opts.repeats)))


if __name__ == "__main__":
    main()
