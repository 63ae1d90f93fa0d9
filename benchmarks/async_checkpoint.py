"""Checkpoint stall and throughput (issue 16, item 2): synchronous vs asynchronous saves, against a
raw write of the same bytes, one process, a model of ~SIZE MB of weights + AdamW states.

    python benchmarks/async_checkpoint.py [--mb 400] [--repeats 3] [--dir /tmp]

Rows (medians): raw write (one file, the same bytes, one fsync); raw write + sha256 (what a
verified save must at least do); nanotrain's sync save (`save_checkpoint`); the training stall of
an async save (`begin_save(background=True)`: the host snapshot, returns while a thread writes)
and the time until that save is durable and committed (`finish()`). Ratios: sync save / raw
write throughput (target >= 0.8) and async stall / sync save (target <= 0.1). The PyTorch-native
equivalent (`torch.distributed.checkpoint.async_save`) needs a process group; vs_native.py's
checkpoint rows compare the sync paths with DCP.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from nanotrain.checkpoint.save import begin_save, save_checkpoint
from nanotrain.config.schema import OptimizerArgs
from nanotrain.optim import build_optimizer


def build(mb: int):
    """Linear layers holding ~mb/3 MB of fp32 weights (AdamW doubles it again: ~mb in all)."""
    per_layer = 1024 * 1024  # 4 MB each
    layers = max(1, mb // 12)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(layers)])
    opt = build_optimizer(model.named_parameters(), OptimizerArgs(lr=1e-3))
    x = torch.randn(8, 1024)
    model(x).sum().backward()
    opt.step()
    return model, opt, layers * per_layer * 4 * 3


def raw_write(path: Path, tensors: list[torch.Tensor], sha: bool) -> float:
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        for t in tensors:
            raw = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
            if sha:
                hashlib.sha256(raw).hexdigest()
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    torch.manual_seed(0)
    model, opt, nbytes = build(a.mb)
    states = [s for st in opt.state.values() for s in (st["exp_avg"], st["exp_avg_sq"])]
    tensors = list(model.parameters()) + states
    work = Path(tempfile.mkdtemp(prefix="nanotrain-async-ckpt-", dir=a.dir))
    rows: dict[str, list[float]] = {k: [] for k in ("raw", "raw_sha", "sync", "async_stall", "async_total")}
    try:
        for i in range(a.repeats):
            rows["raw"].append(raw_write(work / f"raw-{i}", tensors, sha=False))
            rows["raw_sha"].append(raw_write(work / f"rawsha-{i}", tensors, sha=True))
            t0 = time.perf_counter()
            save_checkpoint(work / "sync", 2 * i + 1, model, opt, keep_last=1)
            rows["sync"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            pending = begin_save(work / "async", 2 * i + 2, model, opt, keep_last=1, background=True)
            rows["async_stall"].append(time.perf_counter() - t0)
            pending.finish()
            rows["async_total"].append(time.perf_counter() - t0)
            for p in work.glob("raw*"):
                p.unlink()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    mb = nbytes / 1e6
    print(f"state: {mb:.0f} MB (weights + AdamW), {a.repeats} repeats, medians; dir {work.parent}")
    print(f"{'row':34s} {'seconds':>8s} {'MB/s':>8s}")
    for key, label in (("raw", "raw write (1 file, fsync)"), ("raw_sha", "raw write + sha256"),
                       ("sync", "nanotrain sync save"), ("async_stall", "async save: training stall"),
                       ("async_total", "async save: until committed")):
        print(f"{label:34s} {med[key]:8.3f} {mb / med[key]:8.0f}")
    print(f"sync save throughput / raw write: {med['raw'] / med['sync']:.2f}x (target >= 0.8)")
    print(f"sync save throughput / raw write + sha256: {med['raw_sha'] / med['sync']:.2f}x")
    print(f"async stall / sync save: {med['async_stall'] / med['sync']:.3f} (target <= 0.10)")


if __name__ == "__main__":
    main()
