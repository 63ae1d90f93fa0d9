#!/usr/bin/env python3
"""Single-GPU training throughput and MFU of a ~1B Llama (bf16 autocast, fp32 master weights).

    python benchmarks/gpu_train_bench.py                     # configs/3d_16gpu.yaml's model, seq 2048
    python benchmarks/gpu_train_bench.py --micro-batch 8 --steps 10 --out result.json
    python benchmarks/gpu_train_bench.py --compile           # also torch.compile each decoder layer

The real training step of nanotrain at (dp, tp, pp) = (1, 1, 1): ``ParallelContext`` (NCCL, world
size 1), ``LlamaModel`` on the GPU with ``compute_dtype=bfloat16`` (autocast; weights, grads and
AdamW states fp32), ``BucketedGradSync``, ``build_optimizer`` (AdamW, ZeRO-0), global-norm clipping
and the LR schedule, through ``nanotrain.training.step.train_step``. Synthetic tokens (throughput
only). The micro-batch is the largest of ``--micro-batch`` candidates whose step fits in memory.

tokens/s = micro-batch * seq * accumulation / median step time (CUDA-synchronised);
MFU = tokens/s * ``training_flops_per_token(model, seq)`` / ``peak_bf16_tflops(device name)``
(PaLM convention, nanotrain/logging/flops.py). Prints one JSON object; ``--out`` also writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# configs/3d_16gpu.yaml's model (TinyLlama shape, ~1.1 B parameters); repeated here so that the
# script also runs where PyYAML is missing (``--config`` reads a YAML instead).
MODEL_1B = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    dtype="bfloat16",
    init_std=0.02,
)


def model_args(config: str | None):
    from nanotrain.config import ModelArgs

    if config is None:
        return ModelArgs(**MODEL_1B)
    from nanotrain.config import load_config

    return load_config(config).model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="take the model from this YAML config (default: 3d_16gpu's model)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument(
        "--micro-batch",
        type=int,
        nargs="+",
        default=[16, 12, 8, 4, 2, 1],
        help="candidates, largest first; the first that fits is used",
    )
    parser.add_argument("--accumulation", type=int, default=1, help="micro-batches per optimizer step")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="torch.compile every decoder layer")
    parser.add_argument("--out", type=Path, help="also write the JSON result here")
    parser.add_argument(
        "--cpu-smoke", action="store_true", help="a tiny model on the CPU (gloo): checks this script without a GPU"
    )
    opts = parser.parse_args()

    for key, value in (
        ("RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("LOCAL_RANK", "0"),
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
    ):
        os.environ.setdefault(key, value)
    import torch

    from nanotrain.config import OptimizerArgs
    from nanotrain.logging.flops import peak_bf16_tflops
    from nanotrain.models.llama_arch import parameter_count, training_flops_per_token
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.training.step import train_step

    if not torch.cuda.is_available() and not opts.cpu_smoke:
        print(json.dumps({"error": "no CUDA device", "torch": torch.__version__}))
        return 2
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 matmuls outside autocast (none in the hot path)
    pc = ParallelContext()  # world size 1: NCCL on the GPU
    device = pc.device
    args = model_args(opts.config)
    if opts.cpu_smoke:  # the check's tiny CPU model (gpu_stages/limits.py), at this sequence length
        from gpu_stages.limits import CPU_MODEL

        from nanotrain.config import ModelArgs

        args = ModelArgs(**dict(CPU_MODEL, max_position_embeddings=opts.seq))
    t0 = time.perf_counter()
    model = build_llama(
        args, pc.tp_pg, seed=0, device=device, compute_dtype=torch.bfloat16, compile_layers=opts.compile
    )
    init_s = time.perf_counter() - t0
    optim_args = OptimizerArgs(lr=3e-4, weight_decay=0.1, clip_grad=1.0, warmup_steps=0, lr_decay_style="constant")
    grad_sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    optimizer = build_optimizer(model.named_parameters(), optim_args, pc.dp_cp_pg, zero_stage=0)
    scheduler = build_lr_scheduler(optimizer, optim_args, 10_000)
    gen = torch.Generator(device=device).manual_seed(0)

    def batches(mb: int):
        ids = torch.randint(0, args.vocab_size, (opts.accumulation, mb, opts.seq + 1), device=device, generator=gen)
        return [(b[:, :-1], b[:, 1:]) for b in ids]

    def step(mb: int) -> float:
        stats = train_step(model, batches(mb), grad_sync, optimizer, scheduler, pc, optim_args.clip_grad)
        return stats.loss

    micro, errors = None, []
    for mb in opts.micro_batch:
        try:
            step(mb)
            if device.type == "cuda":
                torch.cuda.synchronize()
            micro = mb
            break
        except torch.cuda.OutOfMemoryError as err:
            errors.append(f"micro-batch {mb}: out of memory")
            optimizer.zero_grad(set_to_none=False)
            grad_sync.zero_grad()
            del err
            torch.cuda.empty_cache()
    if micro is None:
        print(json.dumps({"error": "no micro-batch fits", "tried": errors}))
        return 1
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(opts.warmup):
        step(micro)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(opts.steps):
        sync()
        t = time.perf_counter()
        losses.append(step(micro))  # .item() inside: the step is complete when it returns
        sync()
        times.append(time.perf_counter() - t)
    step_s = statistics.median(times)
    tokens = micro * opts.seq * opts.accumulation
    tps = tokens / step_s
    flops_per_token = training_flops_per_token(args, opts.seq)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    peak = peak_bf16_tflops(name)
    memory = {"peak_memory_gib": None, "peak_reserved_gib": None, "device_used_gib": None}
    if device.type == "cuda":  # reserved and device-wide: the allocator's reserve, the CUDA context,
        free, total = torch.cuda.mem_get_info(device)  # cuBLAS workspaces, NCCL buffers besides the peak
        memory = {
            "peak_memory_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
            "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 1),
            "device_used_gib": round((total - free) / 2**30, 1),
        }
    result = {
        "device": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if device.type == "cuda" else None,
        "backend": pc.backend,
        "params": parameter_count(args).total,
        "seq": opts.seq,
        "micro_batch": micro,
        "accumulation": opts.accumulation,
        "tokens_per_step": tokens,
        "compile": opts.compile,
        "step_ms_median": round(1e3 * step_s, 1),
        "step_ms": [round(1e3 * t, 1) for t in times],
        "tokens_per_s": round(tps),
        "model_tflops_per_s": round(tps * flops_per_token / 1e12, 1),
        "peak_bf16_tflops": peak,
        "mfu": round(tps * flops_per_token / (peak * 1e12), 4) if peak else None,
        "flops_per_token": flops_per_token,
        **memory,
        "loss_first_last": [losses[0], losses[-1]],
        "init_s": round(init_s, 1),
        "oom_tried": errors,
    }
    text = json.dumps(result)
    print(text)
    if opts.out:
        opts.out.parent.mkdir(parents=True, exist_ok=True)
        opts.out.write_text(json.dumps(result, indent=1) + "\n")
    step = model = grad_sync = optimizer = scheduler = None  # they hold the groups pc.destroy() frees
    pc.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
