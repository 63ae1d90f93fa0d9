"""One-process checkpoint fixtures: the tiny model (with its optimizer and scheduler), one training
step of it, and damage done to a checkpoint file on disk."""

from __future__ import annotations

from pathlib import Path

from helpers.models import MODEL, OPTIM, global_batch


def tiny(seed: int = 0):
    """(model, optimizer, scheduler) of the tiny MODEL, one process, no parallelism."""
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    model = build_llama(MODEL, None, seed=seed)
    opt = build_optimizer(model.named_parameters(), OPTIM, zero_stage=0)
    return model, opt, build_lr_scheduler(opt, OPTIM, 100)


def tiny_step(objs, step: int) -> None:
    """One optimizer step of ``tiny()``'s objects on ``global_batch(step)``."""
    model, opt, sched = objs
    batch = global_batch(step)
    model(batch[:, :-1], batch[:, 1:]).backward()
    opt.step()
    sched.step()
    opt.zero_grad()


def damage(path: Path, how: str) -> None:
    """Damage a saved file: ``truncate`` it to half, change a digit of its ``header`` (same size),
    or (anything else) flip a byte of the tensor data (the file still parses)."""
    data = bytearray(path.read_bytes())
    if how == "truncate":
        path.write_bytes(bytes(data[: len(data) // 2]))
    elif how == "header":  # a digit of the header's JSON (a shape or an offset): same size
        at = data.index(b'"shape":[') + len(b'"shape":[')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")
        path.write_bytes(bytes(data))
    else:  # flip a byte in the tensor data (past the header): the file still parses
        data[-5] ^= 0xFF
        path.write_bytes(bytes(data))


def saved_tiny(root: Path, step: int = 1) -> Path:
    """``tiny()`` (one process, ZeRO-0, with AdamW states) saved as ``root/step_<step>`` with its
    config, as a run saves it: the source the offline tools (reshard, export) read. Returns the
    checkpoint directory."""
    from nanotrain.checkpoint import save_checkpoint
    from nanotrain.config import Config, ParallelismArgs

    model, opt, sched = tiny()
    config = Config(parallelism=ParallelismArgs(dp=1, tp=1, pp=1), model=MODEL, optimizer=OPTIM)
    return save_checkpoint(root, step, model, opt, sched, config=config)
