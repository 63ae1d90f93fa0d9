"""Placement: a model built on the meta device (shapes, names and shard records, no storage)
gets storage on its device and its values from a seeded initializer.

``nn.Module.to_empty`` would do the first half but makes new Parameter objects: the shard
records and tied-weight marks set on the meta parameters would be lost and a tied weight would
be untied. ``materialize_`` keeps each parameter's attributes and its sharing.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from nanotrain.parallel.tensor_parallel import init_from_full_


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """Where a model is built and cut before it is placed: the meta device (shapes, no storage).
    One context for every such build, so the rehearsal, whose device is meta too, can tell a
    skeleton from memory the run really allocates."""
    with torch.device("meta"):
        yield


def materialize_(root: nn.Module, device) -> None:
    """Give every parameter and buffer of ``root`` uninitialised storage on ``device``, in place;
    a tensor shared by several modules stays shared, its attributes are kept."""
    new: dict[int, torch.Tensor] = {}
    for module in root.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None:
                    continue
                if id(tensor) not in new:
                    empty = torch.empty_like(tensor, device=device)
                    made = nn.Parameter(empty, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
                    made.__dict__.update(tensor.__dict__)
                    new[id(tensor)] = made
                table[name] = new[id(tensor)]


def initialize_(root: nn.Module, initializer: Callable[[str], Callable[[torch.Tensor], object]]) -> None:
    """Fill every parameter from its full tensor: ``initializer(name)`` fills the unsharded fp32
    tensor in place and this rank keeps its pieces (``init_from_full_``), so every topology
    starts from the same weights."""
    for name, param in root.named_parameters():
        init_from_full_(param, initializer(name))
