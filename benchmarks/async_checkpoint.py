"""Checkpoint stall and throughput (issue 16, item 2): synchronous vs asynchronous saves, against a
raw write of the same bytes, one process, a model of ~SIZE MB of weights + AdamW states.

    python benchmarks/async_checkpoint.py [--mb 400] [--repeats 7] [--dir /tmp] [--batch 32]

Rows (medians): raw write (one file, the same bytes, one fsync); raw write + sha256 (what a
verified save must at least do, one after the other); nanotrain's sync save (`save_checkpoint`:
every file written, hashed and fsynced, meta.json, COMPLETE, the rename and `latest`); the
pruning of one older checkpoint that `keep_last` adds to a save; for an async save, the training
step that follows it (`begin_save(background=True)`, one forward and backward of the model,
`wait_snapshot()` where the trainer's update waits for the host copy) next to the same step
without a save. From them: the time training is blocked (`begin_save` + the update's wait: the
issue's stall), the slowdown of the overlapping step by the background copy, hashing and
writing (the rest of the difference: cores, caches and memory bandwidth shared with the step),
and the time until that save is durable and committed (`finish()`). Ratios: sync save / raw
write throughput (target >= 0.8) and async stall / sync save (target <= 0.1), and the stall plus
the slowdown / sync save.

Beside them, PyTorch-native: `torch.distributed.checkpoint.save` (sync, files fsynced) and
`async_save` (its default: staged to host memory on the calling thread, written by a thread),
in a one-rank gloo group, timed the same way (stall = until `async_save` returns).

Fair by construction: the rows of one repeat run in a rotated order, and before each timed row
the previous outputs are deleted and the page cache flushed (`os.sync`), so no row pays for
another row's write-back or deletion.
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

from nanotrain.checkpoint.save import begin_save, prune, save_checkpoint
from nanotrain.config.schema import OptimizerArgs
from nanotrain.optim import build_optimizer

ROWS = {
    "raw": "raw write (1 file, fsync)",
    "raw_sha": "raw write + sha256",
    "sync": "nanotrain sync save",
    "prune": "prune one older checkpoint",
    "step": "training step, no save",
    "async_step": "async save + the next step",
    "async_begin": "async: begin_save returns",
    "async_wait": "async: the update waits",
    "async_stall": "async: training blocked (stall)",
    "async_slow": "async: overlapping step slowed",
    "async_total": "async: until committed",
    "dcp_sync": "DCP save",
    "dcp_stall": "DCP async_save: training blocked",
    "dcp_slow": "DCP async_save: step slowed",
    "dcp_total": "DCP async_save: until done",
}


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


def raw_write(path: Path, tensors: list[torch.Tensor], sha: bool) -> None:
    with open(path, "wb") as f:
        for t in tensors:
            raw = memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())
            if sha:
                hashlib.sha256(raw).hexdigest()
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())


def settle(*paths: Path) -> None:
    """Delete earlier outputs and flush every dirty page, outside the timed region."""
    for p in paths:
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    os.sync()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--batch", type=int, default=32, help="rows of the emulated training step's batch")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, opt, nbytes = build(a.mb)
    states = [s for st in opt.state.values() for s in (st["exp_avg"], st["exp_avg_sq"])]
    tensors = list(model.parameters()) + states
    work = Path(tempfile.mkdtemp(prefix="nanotrain-async-ckpt-", dir=a.dir))
    rows: dict[str, list[float]] = {k: [] for k in ROWS}
    step = 0

    def timed(key, fn):
        t0 = time.perf_counter()
        out = fn()
        rows[key].append(time.perf_counter() - t0)
        return out

    def sync_save():
        nonlocal step
        settle(work / "sync")
        step += 1
        timed("sync", lambda: save_checkpoint(work / "sync", step, model, opt))
        step += 1  # a second, untimed save, then the pruning of the first one
        save_checkpoint(work / "sync", step, model, opt)
        settle()
        timed("prune", lambda: prune(work / "sync", step, keep_last=1))

    x = torch.randn(a.batch, 1024)

    def train_compute():
        model(x).sum().backward()

    def async_save():
        nonlocal step
        settle(work / "async")
        timed("step", train_compute)
        step += 1
        t0 = time.perf_counter()
        pending = begin_save(work / "async", step, model, opt, background=True)
        rows["async_begin"].append(time.perf_counter() - t0)
        train_compute()
        t1 = time.perf_counter()
        pending.wait_snapshot()  # where the trainer's optimizer.step() waits
        rows["async_wait"].append(time.perf_counter() - t1)
        rows["async_step"].append(time.perf_counter() - t0)
        rows["async_stall"].append(rows["async_begin"][-1] + rows["async_wait"][-1])
        rows["async_slow"].append(rows["async_step"][-1] - rows["step"][-1] - rows["async_stall"][-1])
        pending.finish()
        rows["async_total"].append(time.perf_counter() - t0)

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def native_state():
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def dcp_sync():
        settle(work / "dcp")
        timed("dcp_sync", lambda: dcp.save(native_state(), checkpoint_id=str(work / "dcp")))

    def dcp_async():
        settle(work / "dcp-async")
        timed("step", train_compute)
        t0 = time.perf_counter()
        future = dcp.async_save(native_state(), checkpoint_id=str(work / "dcp-async"))
        rows["dcp_stall"].append(time.perf_counter() - t0)
        train_compute()
        rows["dcp_slow"].append(time.perf_counter() - t0 - rows["step"][-1] - rows["dcp_stall"][-1])
        future.result()
        rows["dcp_total"].append(time.perf_counter() - t0)

    order = [
        lambda: (settle(work / "raw"), timed("raw", lambda: raw_write(work / "raw", tensors, False))),
        lambda: (settle(work / "raw"), timed("raw_sha", lambda: raw_write(work / "raw", tensors, True))),
        sync_save,
        async_save,
        dcp_sync,
        dcp_async,
    ]
    try:
        for i in range(a.repeats):
            for k in range(len(order)):
                order[(i + k) % len(order)]()
    finally:
        shutil.rmtree(work, ignore_errors=True)
        dist.destroy_process_group()
    med = {k: statistics.median(v) for k, v in rows.items()}
    mb = nbytes / 1e6
    print(f"state: {mb:.0f} MB (weights + AdamW), {a.repeats} repeats in rotated order, medians; dir {work.parent}")
    print(f"{'row':34s} {'seconds':>8s} {'MB/s':>8s}")
    for key, label in ROWS.items():
        rate = (
            f"{mb / med[key]:8.0f}" if key in ("raw", "raw_sha", "sync", "async_total", "dcp_sync", "dcp_total") else ""
        )
        print(f"{label:34s} {med[key]:8.3f} {rate}")
    print(f"sync save throughput / raw write: {med['raw'] / med['sync']:.2f}x (target >= 0.8)")
    print(f"sync save + prune throughput / raw write: {med['raw'] / (med['sync'] + med['prune']):.2f}x")
    print(f"sync save throughput / raw write + sha256: {med['raw_sha'] / med['sync']:.2f}x")
    print(f"async stall / sync save: {med['async_stall'] / med['sync']:.3f} (target <= 0.10)")
    print(
        f"(async stall + overlapping step slowed) / sync save: "
        f"{(med['async_stall'] + med['async_slow']) / med['sync']:.3f}"
    )
    print(
        f"vs PyTorch-native DCP: sync save {med['dcp_sync'] / med['sync']:.2f}x faster, async stall "
        f"{med['dcp_stall'] / max(med['async_stall'], 1e-9):.1f}x shorter, until committed "
        f"{med['dcp_total'] / med['async_total']:.2f}x faster"
    )


if __name__ == "__main__":
    main()
