"""The few collectives the checkpoint code needs, carrying JSON (never pickle).

``torch.distributed``'s ``*_object`` collectives unpickle what they receive; a checkpoint loader
that promises "no pickle anywhere" cannot use them. These send UTF-8 JSON as uint8 tensors over
the world group instead (``json_to_tensor`` / ``json_from_tensor``: compact UTF-8; floats
round-trip exactly, JSON writes ``repr``; the RNG states use them too). ``pc=None`` (or a world of
one) means a single process: no communication.
"""

from __future__ import annotations

import json
import traceback

import torch
import torch.distributed as dist

from nanotrain.checkpoint.layout import CheckpointError
from nanotrain.parallel import accelerator, collectives


def json_to_tensor(obj, device=None) -> torch.Tensor:
    """``obj`` as compact UTF-8 JSON in a uint8 tensor on ``device``."""
    data = json.dumps(obj, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device=device, copy=True)


def json_from_tensor(t: torch.Tensor, n: int | None = None):
    """The JSON value in the first ``n`` bytes of ``t`` (all of it by default)."""
    t = t if n is None else t[:n]
    return json.loads(bytes(t.cpu().numpy().tobytes()).decode())


class World:
    """Rank, size and group of the processes taking part in a save/load."""

    def __init__(self, pc=None):
        self.active = pc is not None and dist.is_available() and dist.is_initialized() and pc.world_size > 1
        self.group = pc.world_pg if self.active else None
        self.rank = dist.get_rank() if self.active else 0
        self.size = pc.world_size if self.active else 1
        self.device = accelerator.comm_device(self.group) if self.active else torch.device("cpu")

    def _bytes_tensor(self, obj) -> torch.Tensor:
        return json_to_tensor(obj, self.device)

    @staticmethod
    def _decode(t: torch.Tensor, n: int):
        return json_from_tensor(t, n)

    def _padded(self, obj) -> tuple[list[int], torch.Tensor]:
        """Every rank's encoded size, and this rank's bytes padded to the largest (one all-gather)."""
        mine = self._bytes_tensor(obj)
        sizes = [torch.zeros(1, dtype=torch.int64, device=self.device) for _ in range(self.size)]
        collectives.all_gather(
            sizes,
            torch.tensor([mine.numel()], dtype=torch.int64, device=self.device),
            group=self.group,
            what="checkpoint all_gather sizes",
        )
        sizes = [int(s.item()) for s in sizes]
        padded = torch.zeros(max(sizes), dtype=torch.uint8, device=self.device)
        padded[: mine.numel()] = mine
        return sizes, padded

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.active:
            return [obj]
        sizes, padded = self._padded(obj)
        out = [torch.empty(padded.numel(), dtype=torch.uint8, device=self.device) for _ in range(self.size)]
        collectives.all_gather(out, padded, group=self.group, what="checkpoint all_gather")
        return [self._decode(t, n) for t, n in zip(out, sizes)]

    def error_here(self) -> str:
        """The exception being handled, as this rank's part of an error report."""
        return f"rank {self.rank}: {traceback.format_exc()}"

    def all_gather_checked(self, obj, error: str | None, what: str) -> list:
        """Every rank's ``obj``, in rank order, on every rank; or, if any rank passes an ``error``
        (``error_here()``), one ``CheckpointError`` on every rank: ``what``, then every rank's
        error. All ranks raise together, so none is left waiting in a later collective."""
        got = self.all_gather({"error": error} if error is not None else {"value": obj})
        errors = [g["error"] for g in got if "error" in g]
        if errors:
            raise CheckpointError(f"{what}:\n" + "\n".join(errors))
        return [g["value"] for g in got]

    def gather(self, obj, dst: int = 0) -> list | None:
        """Every rank's ``obj`` on rank ``dst`` (rank order); None elsewhere."""
        if not self.active:
            return [obj]
        sizes, padded = self._padded(obj)
        out = (
            [torch.empty(padded.numel(), dtype=torch.uint8, device=self.device) for _ in range(self.size)]
            if self.rank == dst
            else None
        )
        collectives.gather(
            padded,
            out,
            dst=dist.get_global_rank(self.group, dst) if self.group is not None else dst,
            group=self.group,
            what="checkpoint gather",
        )
        return [self._decode(t, n) for t, n in zip(out, sizes)] if self.rank == dst else None

    def broadcast(self, obj, src: int = 0):
        """``obj`` of rank ``src`` on every rank (others pass anything, e.g. None)."""
        if not self.active:
            return obj
        mine = self._bytes_tensor(obj) if self.rank == src else None
        size = torch.tensor([mine.numel() if mine is not None else 0], dtype=torch.int64, device=self.device)
        collectives.broadcast(size, src=src, group=self.group, what="checkpoint broadcast size")
        buf = mine if mine is not None else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        collectives.broadcast(buf, src=src, group=self.group, what="checkpoint broadcast")
        return self._decode(buf, int(size.item()))

    def any(self, flag: bool) -> bool:
        """True on every rank if ``flag`` is True on any."""
        if not self.active:
            return flag
        t = torch.tensor([1 if flag else 0], dtype=torch.int64, device=self.device)
        collectives.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group, what="checkpoint all_reduce flag")
        return bool(t.item())
