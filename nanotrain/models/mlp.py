"""The SwiGLU feed-forward shared by the dense decoder layer (``llama.py``) and the shared
experts of an MoE layer (``moe.py``), and the SwiGLU activation the routed experts use too."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.config import ModelArgs
from nanotrain.models.recompute import recomputed
from nanotrain.parallel.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelLinearMode,
    TensorParallelRowLinear,
)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation: what ``recompute: selective`` recomputes (silu(gate) is not kept)."""
    return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU with gate and up fused into one column linear (one collective instead of two), of
    ``width`` features (``args.intermediate_size`` unless given; split over tp)."""

    def __init__(self, args: ModelArgs, tp_pg, mode: TensorParallelLinearMode, async_comm: bool,
                 selective: bool = False, width: int | None = None):
        super().__init__()
        self.selective = selective
        ffn = args.intermediate_size if width is None else width
        self.gate_up = TensorParallelColumnLinear(args.hidden_size, 2 * ffn, tp_pg, mode,
                                                  async_communication=async_comm, contiguous_chunks=(ffn, ffn))
        self.down = TensorParallelRowLinear(ffn, args.hidden_size, tp_pg, mode, async_communication=async_comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(recomputed(swiglu, gate, up, enabled=self.selective))
