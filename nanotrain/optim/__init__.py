"""Optimizer (AdamW, ZeRO-0/1/2), LR schedule, global gradient clipping."""

from nanotrain.optim.clip import clip_grad_norm_, global_grad_norm
from nanotrain.optim.optimizer import (
    build_optimizer,
    load_optimizer_state_by_name,
    optimizer_groups,
    optimizer_state_by_name,
    weight_decay_groups,
)
from nanotrain.optim.schedule import build_lr_scheduler, lr_at

__all__ = [
    "build_lr_scheduler",
    "build_optimizer",
    "clip_grad_norm_",
    "global_grad_norm",
    "load_optimizer_state_by_name",
    "lr_at",
    "optimizer_groups",
    "optimizer_state_by_name",
    "weight_decay_groups",
]
