"""Activation recomputation (``training.recompute``) and compiled layers (``training.compile``),
applied to a built model from outside as wrappers (names and weights unchanged).

``none``       every op saves what its backward needs (the default).
``selective``  the model's parameterless kernels are recomputed in backward from tensors that are
               saved anyway (``recompute_modules_``; for the Llama: the attention kernel, whose
               output and log-sum-exp are not kept, and the SwiGLU activation, whose
               ``silu(gate)`` is not kept). The projections, norms and RoPE are not recomputed:
               their saved tensors are the linears' inputs, which stay.
``full``       each decoder layer keeps only its input (and the shared RoPE tables) and runs its
               forward again in backward (one extra forward of the layers: HFU > MFU).

Both use ``torch.utils.checkpoint`` non-reentrant, which (a) works with the pipeline engines'
``torch.autograd.backward(outputs, grads)`` on stage inputs, (b) replays the forward's autocast
state (bf16) and (c) restores the CPU/CUDA RNG state before recomputing (``preserve_rng_state``),
so a recomputed region draws the same numbers (the model draws none today; dropout would).
The recomputed forward runs the same ops on the same inputs, so losses and gradients are
bit-identical to ``none`` on CPU; its tp/cp collectives run again in backward, in the same order
on every rank of a group (the schedule decides the order, and it is the same on all of them).

MoE layers: ``full`` reruns the router and both expert all-to-alls in backward (every ep rank
recomputes the same layer of the same micro-batch at the same point of the schedule, so the
exchanges pair up), the same routing on the same inputs; the layer's routing statistics are not
recorded again (``MoEState.replaying``) and its auxiliary-loss gradient is injected once, by the
original graph. ``selective`` also recomputes the routed and shared experts' SwiGLU activation.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from nanotrain.parallel import accelerator
from nanotrain.parallel.part.adopt import Adopting
from nanotrain.parallel.part.compile_check import compile_backend_problem


def recomputed(
    fn: Callable, *args: torch.Tensor, enabled: bool = True, replay: Callable[[], ContextManager] | None = None
):
    """``fn(*args)``, whose saved tensors are dropped and recomputed in backward when ``enabled``
    and autograd is recording (evaluation under no_grad runs it plainly). ``replay``: a context
    manager factory entered around the recomputation only (``torch.utils.checkpoint``'s
    ``context_fn``), e.g. so an MoE layer does not record its routing statistics twice."""
    if not enabled or not torch.is_grad_enabled():
        return fn(*args)
    contexts = [replay] if replay is not None else []
    device_type = args[0].device.type if args and isinstance(args[0], torch.Tensor) else "cpu"
    if accelerator.emulates_autocast(device_type):  # torch's checkpoint replays torch's autocast only
        dtype = accelerator.autocast_dtype(device_type)
        contexts.append(lambda: accelerator.autocast(device_type, dtype=dtype, enabled=dtype is not None))
    if not contexts:
        return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    return checkpoint(
        fn,
        *args,
        use_reentrant=False,
        preserve_rng_state=True,
        context_fn=lambda: (contextlib.nullcontext(), _entered(contexts)),
    )


@contextlib.contextmanager
def _entered(factories):
    with contextlib.ExitStack() as stack:
        for make in factories:
            stack.enter_context(make())
        yield


class Recomputed(Adopting):
    """``inner`` whose forward is ``recomputed``: only its inputs are kept for backward. Names
    are unchanged (``Adopting``). ``replay``: as for ``recomputed``."""

    def __init__(self, inner: nn.Module, replay: Callable[[], ContextManager] | None = None):
        super().__init__(inner)
        self.replay = replay

    def forward(self, *args):
        return recomputed(self.inner, *args, replay=self.replay)


def recompute_modules_(
    root: nn.Module, kinds: tuple[type, ...], replay: Callable[[], ContextManager] | None = None
) -> int:
    """Wrap, in place, every submodule of ``root`` that is an instance of ``kinds`` in
    ``Recomputed``; returns how many were wrapped."""
    targets = [
        (parent, name, child)
        for parent in root.modules()
        for name, child in parent.named_children()
        if isinstance(child, kinds)
    ]
    for parent, name, child in targets:
        setattr(parent, name, Recomputed(child, replay))
    return len(targets)


# ----------------------------------------------------------------------------- compile
def compile_layers_(layers, device_type: str) -> None:
    """``torch.compile`` each built decoder layer in place (``nn.Module.compile``: parameter names
    and state dicts are unchanged). Raises RuntimeError naming the field when it cannot."""
    problem = compile_backend_problem(device_type)
    if problem is not None:
        raise RuntimeError(f"training.compile: {problem}; install one or set training.compile: false")
    for layer in layers:
        layer.compile()
