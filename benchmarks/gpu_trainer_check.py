"""The real training path on GPUs: the task entry point and the CLI, not hand-made batches.

    python benchmarks/gpu_trainer_check.py --out DIR            # on a GPU machine (gpu_check.sh)
    python benchmarks/gpu_trainer_check.py --out DIR --cpu-smoke  # the script itself, on CPU (CI)

1. ``python -m nanotrain.launch.task CONFIG`` at world size 1: bf16, async TP on, N steps of a
   ~0.4B Llama on the stdlib corpus — data from the sampler, batches moved by the trainer, the
   trainer's own metrics (tokens/s, MFU, peak CUDA memory = ``max_memory_allocated`` from
   ``progress.json``) — beside the ``--dry-run`` memory estimate of the same config and their
   ratio; once with ``training.recompute: none`` and once with ``full`` (memory saved, HFU);
2. with 2 or more GPUs, the same config through ``submit.py --local`` at tp2 (async, sequence
   parallel) and at pp2 (1f1b): NCCL collectives and pipeline P2P for real.
Run directories (with their checkpoints) live in a temporary folder; only the summary
(``gpu_trainer.json``) and each run's console log are written under ``--out``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GPU_MODEL = dict(vocab_size=256, hidden_size=1536, intermediate_size=4096, num_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, max_position_embeddings=2048, dtype="bfloat16")
CPU_MODEL = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, dtype="bfloat16")


def make_config(path: Path, logs: Path, steps: int, cpu: bool) -> Path:
    config = {
        "parallelism": {"tp_linear_async_communication": True},
        "model": CPU_MODEL if cpu else GPU_MODEL,
        "training": {"train_steps": steps, "sequence_length": 64 if cpu else 2048, "micro_batch_size": 2 if cpu else 4,
                     "batch_accumulation_per_replica": 2, "seed": 0},
        "optimizer": {"lr": 3e-4, "warmup_steps": 2},
        "data": {"source": "stdlib"},
        "checkpoints": {"interval": 0, "resume": False},
        "logging": {"dir": str(logs), "log_interval": max(1, steps // 4), "tensorboard": False},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def dry_run_memory_gb(config_path: Path, overrides: list[str]) -> float:
    from nanotrain.config import load_config
    from nanotrain.launch.memory_estimate import GB, estimate_memory

    return round(estimate_memory(load_config(config_path, overrides)).total / GB, 2)


def run(name: str, cmd: list[str], env: dict, logs: Path, out: Path, timeout: float) -> dict:
    t0 = time.perf_counter()
    with open(out / f"{name}.log", "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT)
    result = {"name": name, "rc": proc.returncode, "wall_s": round(time.perf_counter() - t0, 1)}
    progress = logs / name / "progress.json"
    if progress.is_file():
        p = json.loads(progress.read_text())
        result.update({k: p.get(k) for k in ("step", "loss", "tokens_per_sec", "tflops_per_gpu", "mfu", "peak_mem_gb")})
    shutil.rmtree(logs / name, ignore_errors=True)  # checkpoints: gigabytes that must not reach --out
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--timeout", type=float, default=150, help="seconds per run")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model, CPU, world size 1 only")
    opts = parser.parse_args()
    opts.out.mkdir(parents=True, exist_ok=True)
    import torch

    gpus = 0 if opts.cpu_smoke else torch.cuda.device_count()
    if not gpus and not opts.cpu_smoke:
        print(json.dumps({"error": "no CUDA device"}))
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="nanotrain-gpu-check-") as tmp:
        logs = Path(tmp) / "logs"
        config = make_config(Path(tmp) / "gpu_trainer.yaml", logs, opts.steps, opts.cpu_smoke)
        env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
        single = dict(env, RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29600 + os.getpid() % 300))
        variants = [("task-world1", "none")] + ([] if opts.cpu_smoke else [("task-world1-recompute-full", "full")])
        for name, recompute in variants:
            cfg = Path(tmp) / f"{name}.yaml"
            raw = yaml.safe_load(config.read_text())
            raw["logging"]["run_name"] = name
            raw["training"]["recompute"] = recompute
            cfg.write_text(yaml.safe_dump(raw))
            task = [sys.executable, "-m", "nanotrain.launch.task", str(cfg)]
            single["MASTER_PORT"] = str(int(single["MASTER_PORT"]) + 1)
            result = run(name, task, single, logs, opts.out, opts.timeout)
            result["dry_run_estimate_gb"] = dry_run_memory_gb(cfg, [])
            results.append(result)
        layouts = {"cli-tp2": ["parallelism.tp=2", "parallelism.tp_mode=REDUCE_SCATTER"],
                   "cli-pp2-1f1b": ["parallelism.pp=2", "parallelism.pp_engine=1f1b"]}
        for name, items in layouts.items() if gpus >= 2 else ():
            items = items + [f"logging.run_name={name}"]
            cmd = [sys.executable, "submit.py", str(config), "--local"] + [a for i in items for a in ("--set", i)]
            result = run(name, cmd, env, logs, opts.out, opts.timeout)
            result["dry_run_estimate_gb"] = dry_run_memory_gb(config, items)
            results.append(result)
    summary = {"gpus": gpus, "device": torch.cuda.get_device_name(0) if gpus else "cpu", "torch": torch.__version__,
               "runs": results}
    for r in results:  # peak: torch.cuda.max_memory_allocated of the rank (peak RSS on CPU)
        if r.get("peak_mem_gb"):
            r["estimate_over_peak"] = round(r["dry_run_estimate_gb"] / r["peak_mem_gb"], 3)
    (opts.out / "gpu_trainer.json").write_text(json.dumps(summary, indent=1) + "\n")
    for r in results:
        mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "n/a"
        print(f"{r['name']}: rc {r['rc']}, step {r.get('step')}, loss {r.get('loss')}, "
              f"tokens/s {r.get('tokens_per_sec') or 0:,.0f}, MFU {mfu}, peak {r.get('peak_mem_gb')} GB "
              f"(dry-run estimate {r['dry_run_estimate_gb']} GB, estimate/peak {r.get('estimate_over_peak')}), "
              f"{r['wall_s']} s")
    return 0 if all(r["rc"] == 0 and r.get("step") == opts.steps for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
