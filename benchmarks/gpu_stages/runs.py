"""Reading a trainer run back and judging it: TensorBoard losses, the resume step, the loss
comparison and its verdict (identical, or within two fresh runs' nondeterminism), and the
memory peaks that ``task_with_memory`` records in the run's own process. Shared by the
single-rank trainer stage and the multi-GPU stage."""

from __future__ import annotations

import json
import math
import os
import re
import sys
from pathlib import Path

from .limits import NOISE_FACTOR


def tb_losses(run_dir: Path) -> dict[int, float]:
    """train/loss of every step the run directory's TensorBoard events hold (float32, as logged)."""
    if not (run_dir / "tb").is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    if "train/loss" not in events.Tags().get("scalars", []):
        return {}
    return {e.step: e.value for e in events.Scalars("train/loss")}


def read_run(run_dir: Path, log: str, memory: Path | None = None) -> dict:
    out: dict = {}
    progress = run_dir / "progress.json"
    if progress.is_file():
        p = json.loads(progress.read_text())
        out.update({k: p.get(k) for k in ("step", "loss", "tokens_per_sec", "mfu", "peak_mem_gb")})
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    out["resumed_from_step"] = int(resumed.group(1)) if resumed else None
    if memory is not None and memory.is_file():
        out["memory"] = json.loads(memory.read_text())
    out["all_losses"] = tb_losses(run_dir)
    return out


def compare(reference: dict[int, float], got: dict[int, float], steps: range) -> dict:
    missing = [s for s in steps if s not in got or s not in reference]
    diffs = [abs(got[s] - reference[s]) for s in steps if s in got and s in reference]
    worst = None if not diffs else (math.inf if any(math.isnan(d) for d in diffs) else max(diffs))
    return {
        "steps": [steps.start, steps.stop - 1],
        "max_abs_diff": worst,
        "missing_steps": missing,
        "identical": not missing and worst == 0.0,
    }


def resume_verdict(cmp: dict, noise: float | None, resumed_from: int | None, expected_from: int) -> tuple[bool, str]:
    if resumed_from != expected_from:
        return False, f"did not resume from step {expected_from} (resumed from {resumed_from})"
    if cmp["missing_steps"]:
        return False, f"losses missing at steps {cmp['missing_steps']}"
    if cmp["identical"]:
        return True, "identical"
    d = cmp["max_abs_diff"]
    if noise and d <= NOISE_FACTOR * noise:
        return True, (
            f"NOT bit-identical: max |diff| {d:.3g}, within nondeterminism (two fresh runs differ by {noise:.3g})"
        )
    return False, f"max |diff| {d:.3g} (two fresh runs differ by {noise or 0:.3g})"


def leg_summary(r: dict, steps: range | None = None) -> dict:
    """A run's record for the summary: its own steps' losses, not the run directory's all."""
    losses = r.pop("all_losses", {})
    if steps is not None:
        r["losses"] = [[s, losses[s]] for s in steps if s in losses]
    return r


def memory_report(run: dict, config_path: Path) -> dict:
    from nanotrain.config import load_config
    from nanotrain.estimate.memory import GB, estimate_memory

    m = run.get("memory", {})

    def gib(key: str) -> float | None:
        return round(m[key] / 2**30, 2) if m.get(key) is not None else None

    report = {
        "dry_run_estimate_gib": round(estimate_memory(load_config(str(config_path))).total / GB, 2),
        "max_memory_allocated_gib": gib("max_memory_allocated"),
        "max_memory_reserved_gib": gib("max_memory_reserved"),
        "device_used_peak_gib": gib("device_used_peak_bytes"),
        "device_total_gib": gib("device_total_bytes"),
        "peak_rss_gib": gib("peak_rss_bytes"),
    }
    if report["max_memory_allocated_gib"]:
        report["estimate_over_allocated"] = round(
            report["dry_run_estimate_gib"] / report["max_memory_allocated_gib"], 3
        )
    return report


def task_with_memory(config: str, memory_out: Path) -> None:
    """``python -m nanotrain.runtime.task CONFIG``, run as ``__main__`` as ``-m`` does, in a
    process that then writes the CUDA allocator's peaks (allocated, reserved) and the highest
    device-wide use ``mem_get_info`` saw (sampled: context, NCCL buffers, the allocator's
    reserve) to ``memory_out`` — numbers the trainer's own metrics do not hold."""
    import resource
    import runpy
    import threading
    import warnings

    import torch

    device = int(os.environ.get("LOCAL_RANK", "0"))
    seen: dict = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            if torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info(device)
                seen["device_used_peak_bytes"] = max(seen.get("device_used_peak_bytes", 0), total - free)
                seen["device_total_bytes"] = total

    if torch.cuda.is_available():
        threading.Thread(target=sample, name="gpu-check-memory", daemon=True).start()
    sys.argv = ["nanotrain.runtime.task", config]
    # forked (--cpu-smoke) from a process that imported the task module already: runpy says so
    warnings.filterwarnings("ignore", "'nanotrain.runtime.task' found in sys.modules", RuntimeWarning)
    try:
        runpy.run_module("nanotrain.runtime.task", run_name="__main__", alter_sys=True)
    finally:
        done.set()
        stats = {"device": "cpu", "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info(device)
            stats.update(
                device=torch.cuda.get_device_name(device),
                max_memory_allocated=torch.cuda.max_memory_allocated(device),
                max_memory_reserved=torch.cuda.max_memory_reserved(device),
                device_used_at_exit_bytes=total - free,
                **seen,
            )
            stats["device_used_peak_bytes"] = max(stats.get("device_used_peak_bytes", 0), total - free)
        memory_out.write_text(json.dumps(stats) + "\n")
