"""The device contract of every tensor handed to torch.distributed, checked in test ranks.

What NCCL needs and gloo forgives (its device part can only fire where the rank's device is
not the CPU: ``--rehearse`` checks the same on its stand-in device, ``rehearse/traffic.py``):
every tensor of a collective or a P2P op on the rank's own device (a CPU tensor into an NCCL
collective is an error on a GPU), contiguous, of a dtype NCCL has (no bool, no complex), and no
``*_object`` collective (they pickle, and on NCCL they move
their bytes through the GPU and sync the host). ``install(device)`` wraps torch.distributed's
functions in this process: a violation raises at the call, and every call is recorded with its
caller's module and the dtypes it moved, so a test can also check *what precision* crossed the
wire (bf16 activations under autocast).
"""

from __future__ import annotations

import sys
from collections import defaultdict

import torch
import torch.distributed as dist

NCCL_DTYPES = {
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
}
TENSOR_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "broadcast",
    "reduce",
    "all_to_all_single",
    "all_to_all",
    "send",
    "recv",
    "gather",
    "scatter",
)
# isend/irecv stay unwrapped: P2POp accepts only the original functions; batch_isend_irecv, which
# every P2P of ours goes through, is checked instead.
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


class ContractViolation(AssertionError):
    pass


class Contract:
    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.calls: dict[str, set] = defaultdict(set)  # caller module -> {(function, dtype)}
        self.count = 0

    def check(self, name: str, tensors) -> None:
        caller = _caller(3)
        for t in tensors:
            if t.device != self.device:
                raise ContractViolation(
                    f"{caller}: {name} got a tensor on {t.device}, the rank's device is {self.device}"
                )
            if not t.is_contiguous():
                raise ContractViolation(f"{caller}: {name} got a non-contiguous tensor {tuple(t.shape)}")
            if t.dtype not in NCCL_DTYPES:
                raise ContractViolation(f"{caller}: {name} got dtype {t.dtype}, which NCCL does not have")
            self.calls[caller].add((name, t.dtype))
        self.count += 1

    def dtypes_from(self, module: str) -> set:
        return {dtype for name, dtype in self.calls.get(module, ())}


# Shared helpers that only pass tensors through: the module that called them is the one recorded.
PASS_THROUGH = ("nanotrain.parallel.collectives",)


def _caller(depth: int) -> str:
    """The module of the first frame ``depth`` up the stack that is not a pass-through helper."""
    frame = sys._getframe(depth)
    while frame is not None and frame.f_globals.get("__name__") in PASS_THROUGH:
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


def _tensors(args, kwargs) -> list[torch.Tensor]:
    out = []
    for value in list(args) + list(kwargs.values()):
        if isinstance(value, torch.Tensor):
            out.append(value)
        elif isinstance(value, (list, tuple)):
            out += [v for v in value if isinstance(v, torch.Tensor)]
    return out


def install(device) -> Contract:
    """Wrap torch.distributed's collectives in this process; returns the recorder."""
    contract = Contract(device)

    def wrap(name, fn):
        def checked(*args, **kwargs):
            contract.check(name, _tensors(args, kwargs))
            return fn(*args, **kwargs)

        return checked

    def refuse(name):
        def refused(*args, **kwargs):
            caller = _caller(2)
            raise ContractViolation(f"{caller}: {name} is an object collective (pickles; host syncs on NCCL)")

        return refused

    for name in TENSOR_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, wrap(name, getattr(dist, name)))
    for name in OBJECT_COLLECTIVES:
        if hasattr(dist, name):
            setattr(dist, name, refuse(name))
    batch = dist.batch_isend_irecv

    def checked_batch(ops):
        contract.check("batch_isend_irecv", [op.tensor for op in ops])
        return batch(ops)

    dist.batch_isend_irecv = checked_batch
    return contract
