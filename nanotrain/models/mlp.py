"""The SwiGLU feed-forward shared by the dense decoder layer (``llama.py``) and the shared
experts of an MoE layer (``moe.py``), and the SwiGLU activation the routed experts use too."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SwiGLU(nn.Module):
    """``silu(gate) * up``: a module, so that a wrapper can run it again in backward instead of
    keeping ``silu(gate)``."""

    def forward(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate) * up


class MLP(nn.Module):
    """SwiGLU of ``width`` features with gate and up fused into one linear (rows ``[gate | up]``;
    one collective instead of two under tensor parallelism). The split of the fused output is
    read from its width, so a tensor-parallel ``gate_up`` producing this rank's features needs
    no other change."""

    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden_size, 2 * width, bias=False)
        self.act = SwiGLU()
        self.down = nn.Linear(width, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(self.act(gate, up))
