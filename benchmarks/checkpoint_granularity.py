"""Checkpoint save / load time and size, one file per rank vs one per parameter (CPU, gloo).

    .venv/bin/python benchmarks/checkpoint_granularity.py --model tiny --dp 2 --tp 2 \
        [--granularity rank|param] [--dir /tmp/x]
    .venv/bin/python benchmarks/checkpoint_granularity.py --model 100m --dp 2 --tp 2

The measurement behind the choice of one file per rank (``nanotrain/checkpoint/__init__.py``).
Per setting: the median over ``--repeats`` of the save (all ranks, commit included, measured on
rank 0 from a barrier to the return) and of a same-topology load into fresh objects, the bytes
and files on disk; then a one-process load of that checkpoint (resharding to dp1 tp1) and a
sha256 pass over every file. Optimizer states are made real by one AdamW step on constant
gradients. Results are printed as one JSON line. The ranks are local processes started by the
launcher of ``submit.py --local`` (``nanotrain.launch.local.run_local``); their logs go to
``<dir>/ranks/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.config import Config, ModelArgs, OptimizerArgs, ParallelismArgs, TrainingArgs  # noqa: E402

MODELS = {
    # configs/tiny_cpu.yaml's model
    "tiny": dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=256,
        num_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        dtype="float32",
    ),
    # ~96M parameters (Llama-style, tied 32k vocabulary)
    "100m": dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_layers=10,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=1024,
        dtype="float32",
        tie_word_embeddings=True,
    ),
}


def bench_config(model_name: str, dp: int, tp: int, zero: int, seed: int = 0) -> Config:
    """The run being checkpointed, as a config: the model is built from it by ``llama_arch``."""
    return Config(
        parallelism=ParallelismArgs(dp=dp, tp=tp),
        model=ModelArgs(**MODELS[model_name]),
        training=TrainingArgs(seed=seed),
        optimizer=OptimizerArgs(lr=1e-3, warmup_steps=1, zero_stage=zero),
    )


def _build(config: Config, pc):
    """Model, optimizer and scheduler of this rank (``pc=None``: one process) after one step."""
    import torch

    from nanotrain.models.family import LLAMA
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    zero = config.optimizer.zero_stage
    model = LLAMA.build_part(config, pc)
    dp_pg = pc.dp_cp_pg if pc is not None else None
    optimizer = build_optimizer(model.named_parameters(), config.optimizer, dp_pg, zero_stage=zero)
    scheduler = build_lr_scheduler(optimizer, config.optimizer, 100)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad()
    return model, optimizer, scheduler


def _worker(opts) -> None:
    import torch.distributed as dist

    from nanotrain.checkpoint import load_checkpoint, save_checkpoint
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=opts.tp, data_parallel_size=opts.dp)
    model, optimizer, scheduler = _build(bench_config(opts.model, opts.dp, opts.tp, opts.zero), pc)
    fresh = _build(bench_config(opts.model, opts.dp, opts.tp, opts.zero, seed=1), pc)
    saves, loads = [], []
    for i in range(opts.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(
            opts.dir,
            i + 1,
            model,
            optimizer,
            scheduler,
            pc,
            extra={"consumed_samples": i},
            keep_last=1,
            granularity=opts.granularity,
        )
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
    from nanotrain.launch.local import run_local

    world = dp * tp
    result = Path(tempfile.mkstemp(suffix=".json")[1])
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on CPU for every rank, GPUs or not
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--model",
        model,
        "--dp",
        str(dp),
        "--tp",
        str(tp),
        "--zero",
        str(zero),
        "--granularity",
        granularity,
        "--dir",
        directory,
        "--repeats",
        str(repeats),
        "--result",
        str(result),
    ]
    status = run_local(command, world, Path(directory) / "ranks", quiet=True)
    if status:
        raise SystemExit(f"bench ranks failed (status {status}); logs in {Path(directory) / 'ranks'}")
    times = json.loads(result.read_text())
    result.unlink()
    ckpt = sorted(Path(directory).glob("step_*"))[-1]
    files = [p for p in ckpt.rglob("*") if p.is_file()]
    t0 = time.perf_counter()
    assert not verify_checkpoint(ckpt)
    hash_s = time.perf_counter() - t0
    single = _build(bench_config(model, 1, 1, 0, seed=2), None)
    t0 = time.perf_counter()
    load_checkpoint(directory, *single)
    reshard_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in single[0].parameters())
    return {
        "model": model,
        "params": n_params,
        "dp": dp,
        "tp": tp,
        "zero": zero,
        "granularity": granularity,
        "files": len(files),
        "mb": round(sum(p.stat().st_size for p in files) / 1e6, 2),
        "save_s": round(statistics.median(times["save_s"]), 4),
        "load_s": round(statistics.median(times["load_s"]), 4),
        "save_min_s": round(min(times["save_s"]), 4),
        "load_min_s": round(min(times["load_s"]), 4),
        "load_resharded_1proc_s": round(reshard_s, 4),
        "verify_all_s": round(hash_s, 4),
    }


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
