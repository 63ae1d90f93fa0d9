"""Learning-rate schedule: linear warmup, then cosine / linear decay to ``min_lr``, or constant.

Convention: ``s`` is the number of optimizer steps already taken (``LambdaLR.last_epoch``); the
trainer calls ``scheduler.step()`` right after ``optimizer.step()``, so step ``s`` (0-based) runs
with ``lr(s)``:

* warmup (``s < warmup_steps``): ``lr * (s + 1) / warmup_steps``: the first step uses
  ``lr / warmup_steps`` (~0, never exactly 0, so no step is wasted) and step ``warmup_steps - 1``
  reaches ``lr``;
* decay (``s >= warmup_steps``): ``progress = (s - warmup) / (train_steps - warmup)`` clamped to
  [0, 1]; cosine: ``min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2``; linear:
  ``lr - (lr - min_lr) * progress``; ``lr(warmup_steps) = lr`` and ``lr(train_steps) = min_lr`` (the
  value after the last step, which a run extended past ``train_steps`` keeps);
* constant: ``lr`` after warmup;
* wsd (warmup-stable-decay, MiniCPM / DeepSeek-style): ``lr`` after warmup until the last
  ``D = max(1, round(decay_fraction * train_steps))`` steps, which decay to ``min_lr`` with
  ``progress = (s - (train_steps - D)) / D``; ``decay_shape`` linear: ``lr - (lr - min_lr) * progress``,
  ``1-sqrt``: ``min_lr + (lr - min_lr) * (1 - sqrt(progress))`` (drops fast, then flattens).
  Validation refuses ``warmup_steps + D > train_steps``. A run that is stopped before its decay and
  extended (a larger ``train_steps``) keeps training at ``lr``: the stable phase has no horizon.

Every style is a pure function of (step, config), so resuming and resharding give the same lr.

``LambdaLR`` is used because its ``state_dict`` is plain data (last_epoch, base_lrs, ...): a
closure (not a callable object) is not saved, so resuming with the same config restores it exactly.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from nanotrain.config.schema import OptimizerArgs
from nanotrain.config.validate import wsd_decay_steps

STYLES = ("cosine", "linear", "constant", "wsd")


def lr_at(step: int, args: OptimizerArgs, train_steps: int) -> float:
    """The learning rate of 0-based optimizer step ``step`` (pure; for tests, logs, dry-runs).
    Raises ValueError for an unknown ``args.lr_decay_style``."""
    lr, warmup = args.lr, args.warmup_steps
    if step < warmup:
        return lr * (step + 1) / warmup
    if args.lr_decay_style == "constant":
        return lr
    if args.lr_decay_style == "wsd":
        decay = wsd_decay_steps(args.decay_fraction, train_steps)
        progress = min(1.0, max(0.0, (step - (train_steps - decay)) / decay))
        if args.decay_shape == "1-sqrt":
            return args.min_lr + (lr - args.min_lr) * (1.0 - math.sqrt(progress))
        return lr - (lr - args.min_lr) * progress
    progress = min(1.0, max(0.0, (step - warmup) / max(1, train_steps - warmup)))
    if args.lr_decay_style == "cosine":
        return args.min_lr + (lr - args.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if args.lr_decay_style == "linear":
        return lr - (lr - args.min_lr) * progress
    raise ValueError(f"unknown lr_decay_style {args.lr_decay_style!r}")


def _factor_fn(args: OptimizerArgs, train_steps: int) -> Callable[[int], float]:
    if args.lr_decay_style not in STYLES:
        raise ValueError(f"unknown lr_decay_style {args.lr_decay_style!r}")

    def factor(step: int) -> float:  # LambdaLR multiplies each group's initial lr by this
        return lr_at(step, args, train_steps) / args.lr if args.lr > 0 else 0.0

    return factor


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, args: OptimizerArgs, train_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``LambdaLR`` following ``lr_at``; every param group gets the same factor.

    The groups' initial lr must be ``args.lr`` (as ``build_optimizer`` sets it); works for plain
    AdamW and ``ZeroOneOptimizer`` alike (it is an AdamW). Raises ValueError for an unknown
    ``args.lr_decay_style``.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, _factor_fn(args, train_steps))
