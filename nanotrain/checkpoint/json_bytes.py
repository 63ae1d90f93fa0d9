"""JSON as a uint8 tensor and back: how the checkpoint code carries structured values where only
tensors go (safetensors files, collectives) without pickle. Compact UTF-8; floats round-trip
exactly (JSON writes ``repr``)."""
from __future__ import annotations

import json

import torch


def to_tensor(obj, device=None) -> torch.Tensor:
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, copy=True)


def from_tensor(t: torch.Tensor, n: int | None = None):
    """The JSON value in the first ``n`` bytes of ``t`` (all of it by default)."""
    t = t if n is None else t[:n]
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())
