"""A wrapper module that keeps the names of the module it wraps.

Parallelism is applied to a plain model by swapping and wrapping its modules, and parameter
names must not change on the way (checkpoints, seeded initialisation and tests compare by name:
``layers.7.attn.qkv.weight`` with or without a recompute wrapper around layer 7). An ``Adopting``
wrapper registers the wrapped module's children as its own and keeps the module itself
unregistered, so ``named_parameters`` sees through it.
"""

from __future__ import annotations

from torch import nn


class Adopting(nn.Module):
    """Presents ``inner``'s children under its own names and calls ``inner`` on ``forward``.
    ``inner`` must hold its parameters and buffers in children (none directly): the children are
    shared objects, so ``.to()`` and friends reach them through either parent."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        direct = [n for n, _ in (*inner.named_parameters(recurse=False), *inner.named_buffers(recurse=False))]
        if direct:
            raise ValueError(f"{type(inner).__name__} holds tensors {direct} directly; only children can be adopted")
        object.__setattr__(self, "inner", inner)
        for name, child in inner.named_children():
            self.add_module(name, child)

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def train(self, mode: bool = True):
        self.inner.training = mode  # its children are ours and follow super().train
        return super().train(mode)
