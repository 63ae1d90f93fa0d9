"""ZeRO-2: every micro-batch's gradients reduce-scattered into the shard this rank owns.

A ``BucketedGradSync`` cut for ZeRO (``shard(stage=2)``) keeps the partition of ZeRO-1
(``buckets.py``: rank r owns piece r of every padded bucket) but holds no full-size bucket
buffers between micro-batches. What persists is one flat accumulator of this rank's pieces, in
fp32 at least (``torch.promote_types(param dtype, fp32)``: fp32 for fp32 and bf16 master weights,
fp64 for fp64): 1/n of the gradient bytes of ZeRO-0/1.

Per backward of one micro-batch (a *round*, ``ShardAccumulator.round(params)``):
  * a bucket's full buffer is allocated when its first gradient of the round arrives (its other
    parameters' ``.grad`` become views of it, so autograd accumulates into it in place);
  * once every parameter of the bucket that this backward computes has its gradient, the bucket
    is divided by the divisor and reduce-scattered (async, in place) into this rank's piece, and
    the parameters' ``.grad`` are let go;
  * before the next bucket is launched the previous reduce-scatter is waited for, its piece added
    to the accumulator and its full buffer freed: at most one bucket is in flight and one filling
    (plus a bucket waiting for a lower-index one), never the whole gradient;
  * at the round's end every bucket holding a parameter of ``params`` that is not launched yet is
    launched, in index order, with zeros where no gradient came: every rank of the group posts the
    same reduce-scatters in the same order, whatever its data did.
The rounds are static (one per backward of a pipeline chunk, its parameters), so ranks agree;
a bucket shared by two chunks of an interleaved pipeline is reduce-scattered once per round of
each.

The trade-off: ZeRO-0/1 accumulate the m micro-batches locally (``no_sync``) and reduce once per
step; ZeRO-2 reduce-scatters every micro-batch, m reduce-scatters of the gradient bytes per step
((n-1)/n of them each) instead of one all-reduce (2(n-1)/n), for 1/n of the gradient memory.
With m = 1 it moves the bytes of ZeRO-1; with m micro-batches (m+1)/2 times as many.

Gradients are reduced in the parameters' dtype (fp32 master weights here; the compute dtype of
autocast does not reach ``.grad``). After ``finish()`` no parameter has a ``.grad``: the reduced
gradient is the accumulator, which ``grad_shards()`` (norm, clipping, the tp and tied-embedding
sums) and ``owned_grad()`` (the optimizer) hand out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.parallel import accelerator
from nanotrain.parallel.collectives import reduce_scatter_into, wait
from nanotrain.parallel.observe.hang_record import HANG_RECORD


@dataclass
class GradShards:
    """After a sharded sync: of ``params`` (all of one sync's), only ``pieces`` (param, start,
    stop of its flattened gradient) hold the average on this rank; the pieces of the ranks of
    ``group`` together cover every parameter exactly once."""

    group: Optional[dist.ProcessGroup]
    params: list[nn.Parameter]
    pieces: list[tuple[nn.Parameter, int, int]]
    # ZeRO-2: the tensor holding each piece's reduced gradient (the accumulator's views; the
    # parameters have no ``.grad``). None: ``p.grad.reshape(-1)[start:stop]`` (ZeRO-1).
    tensors: Optional[list[torch.Tensor]] = None

    def piece_grads(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(param, its owned reduced gradient, 1-D) for each piece that has one."""
        if self.tensors is not None:
            return list(zip([p for p, _, _ in self.pieces], self.tensors))
        return [(p, p.grad.detach().reshape(-1)[a:b]) for p, a, b in self.pieces if p.grad is not None]


def on_the_wire(buffer: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """What a gradient collective reduces: ``buffer`` itself, or its copy in ``dtype``
    (``optimizer.grad_reduce_dtype: bfloat16``: half the bytes, summed in bf16; the result goes
    back into the fp32 buffer or accumulator)."""
    return buffer if dtype is None or dtype == buffer.dtype else buffer.to(dtype)


def piece_of(flat: torch.Tensor, shards: int, rank: int) -> torch.Tensor:
    """Piece ``rank`` of ``shards`` equal pieces of ``flat`` (its length is a multiple)."""
    chunk = flat.numel() // shards
    return flat[rank * chunk : (rank + 1) * chunk]


def reduced_grad_of(shards: Optional[list[GradShards]]):
    """``p -> the tensor to treat as p's reduced gradient on this rank``: ``p.grad``, or under
    ZeRO-2 the accumulator's view of the range of ``p`` this rank owns (None where it owns none),
    for the sums that follow the dp sync (sequence-parallel norms over tp, tied embeddings)."""
    owned = {id(p): t for sh in shards or () if sh.tensors is not None for p, t in sh.piece_grads()}
    covered = {id(p) for sh in shards or () if sh.tensors is not None for p in sh.params}

    def grad_of(p: nn.Parameter) -> Optional[torch.Tensor]:
        return owned.get(id(p)) if id(p) in covered else p.grad

    return grad_of


def _same_storage(grad: Optional[torch.Tensor], view: torch.Tensor) -> bool:
    return grad is not None and (grad is view or accelerator.same_memory(grad, view))


class ShardAccumulator:
    """The ZeRO-2 state of one sync: its ``buckets`` (``grad_sync.Bucket``, ``buffer`` None while
    released), the accumulator and the rounds (module doc). ``pieces``: (param, start, stop)
    owned here, from ``buckets.shard_pieces``. ``log(bucket index, from_hook)`` records launches."""

    def __init__(
        self,
        buckets: list,
        pieces: list[tuple[nn.Parameter, int, int]],
        group: Optional[dist.ProcessGroup],
        shards: int,
        rank: int,
        divisor: int,
        log: Callable[[int, bool], None],
        reduce_dtype: Optional[torch.dtype] = None,
    ):
        self.buckets, self.group, self.shards, self.rank, self.divisor = buckets, group, shards, rank, divisor
        self.reduce_dtype = reduce_dtype
        self._log = log
        ref = buckets[0].params[0]
        dtype = torch.promote_types(ref.dtype, torch.float32)
        self._bucket_of: dict[int, object] = {}
        self._offset: dict[int, int] = {}  # param -> its start in its bucket
        self._acc_start: list[int] = []  # bucket -> its piece's start in ``flat``
        total = 0
        for b in buckets:
            for p, off in zip(b.params, b.offsets):
                self._bucket_of[id(p)] = b
                self._offset[id(p)] = off
            self._acc_start.append(total)
            total += b.size // shards
        self.flat = torch.zeros(total, dtype=dtype, device=ref.device)
        self._owned: dict[int, torch.Tensor] = {}
        for p, start, stop in pieces:
            b = self._bucket_of[id(p)]
            at = self._acc_start[b.index] + self._offset[id(p)] + start - rank * (b.size // shards)
            self._owned[id(p)] = self.flat[at : at + stop - start]
        self.pieces = pieces
        self.in_flight: list = []
        self._round: Optional[tuple[list, dict[int, set[int]]]] = None
        self._cursor = 0
        self._rounds = 0  # rounds since the last finish
        self._round_cache: dict[tuple[int, ...], tuple[list, dict[int, set[int]]]] = {}
        # ("alloc" | "free", bucket index, bytes) of the full buffers in the current (or last
        # finished) step, cleared by its first gradient like the sync's launch log: the evidence
        # that only a few of them are alive at once (tests, profiling).
        self.buffer_log: list[tuple[str, int, int]] = []
        self.after_round: list[Callable[[], None]] = []  # ZeRO-3: release what a backward gathered

    # ------------------------------------------------------------------ views
    def _view(self, b, p: nn.Parameter) -> torch.Tensor:
        off = self._offset[id(p)]
        return b.buffer[off : off + p.numel()].view_as(p)

    def _acc(self, b) -> torch.Tensor:
        start = self._acc_start[b.index]
        return self.flat[start : start + b.size // self.shards]

    def owned_grad(self, p: nn.Parameter) -> Optional[torch.Tensor]:
        """The reduced gradient of the range of ``p`` this rank owns (1-D), None if it owns none."""
        return self._owned.get(id(p))

    def live_buffer_bytes(self) -> int:
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets if b.buffer is not None)

    # ------------------------------------------------------------------ gradients arriving
    def allocate(self, b) -> None:
        """A zeroed full buffer for bucket ``b``; its parameters' ``.grad`` (moved in) become views."""
        ref = b.params[0]
        b.buffer = torch.zeros(b.size, dtype=ref.dtype, device=ref.device)
        self.buffer_log.append(("alloc", b.index, b.buffer.numel() * b.buffer.element_size()))
        for q in b.params:  # autograd accumulates into the views from now on
            view = self._view(b, q)
            if q.grad is not None:
                view.copy_(q.grad)
            q.grad = view

    def on_grad(self, p: nn.Parameter) -> None:
        """``p``'s gradient of this backward is in ``p.grad`` (its post-accumulate hook)."""
        b = self._bucket_of[id(p)]
        if b.launched:  # a new gradient while the last one's reduce-scatter runs (another round)
            self._complete(b)
        if b.buffer is None:
            self.allocate(b)
        else:
            view = self._view(b, p)
            if not _same_storage(p.grad, view):  # .grad was replaced: add the new gradient
                view.add_(p.grad)
                p.grad = view
        b.ready.add(id(p))
        if self._round is not None:
            self._advance(from_hook=True)

    # ------------------------------------------------------------------ launching
    def _launch(self, b, from_hook: bool) -> None:
        for other in list(self.in_flight):  # at most one reduce-scatter in flight
            self._complete(other)
        if b.buffer is None:  # no gradient this round: zeros keep the ranks' collectives in step
            self.allocate(b)
        for q in b.params:  # later gradients must not land in a buffer being reduced
            q.grad = None
        if self.divisor > 1:
            b.buffer.div_(self.divisor)
        b.wire = on_the_wire(b.buffer, self.reduce_dtype)
        b.handle = reduce_scatter_into(
            piece_of(b.wire, self.shards, self.rank), b.wire, group=self.group, async_op=True
        )
        b.launched = True
        b.ready.clear()
        self.in_flight.append(b)
        self._log(b.index, from_hook)

    def _complete(self, b) -> None:
        """Wait for ``b``'s reduce-scatter, add its piece into the accumulator, free its buffer."""
        HANG_RECORD.entering(f"wait reduce_scatter gradient bucket {b.index}", self.group)
        wait(b.handle)
        self._acc(b).add_(piece_of(b.wire, self.shards, self.rank))
        self.buffer_log.append(("free", b.index, b.buffer.numel() * b.buffer.element_size()))
        b.buffer, b.wire, b.handle, b.launched = None, None, None, False
        self.in_flight.remove(b)

    def _advance(self, from_hook: bool, force: bool = False) -> None:
        """Launch the round's buckets in their order, each once all its round gradients are in."""
        order, wanted = self._round
        while self._cursor < len(order):
            b = order[self._cursor]
            if not (force or wanted[b.index] <= b.ready):
                break
            self._launch(b, from_hook)
            self._cursor += 1

    def _round_of(self, params: Optional[Iterable[nn.Parameter]]) -> tuple[list, dict[int, set[int]]]:
        ps = [p for p in params if id(p) in self._bucket_of] if params is not None else None
        key = tuple(id(p) for p in ps) if ps is not None else ()
        if key not in self._round_cache:
            wanted: dict[int, set[int]] = {}
            for p in ps if ps is not None else [q for b in self.buckets for q in b.params]:
                wanted.setdefault(self._bucket_of[id(p)].index, set()).add(id(p))
            self._round_cache[key] = ([self.buckets[i] for i in sorted(wanted)], wanted)
        return self._round_cache[key]

    @contextlib.contextmanager
    def round(self, params: Optional[Iterable[nn.Parameter]] = None) -> Iterator[None]:
        """One backward that computes the gradients of ``params`` (None: all): their buckets are
        reduce-scattered during it and, the rest, at its end (module doc)."""
        if self._round is not None:
            raise RuntimeError("ZeRO-2 gradient sync: backward rounds do not nest")
        self._round, self._cursor = self._round_of(params), 0
        for b in self._round[0]:
            b.ready.clear()
        try:
            yield
            self._advance(from_hook=False, force=True)
            for b in self._round[0]:  # gradients that came after their bucket was launched
                if b.buffer is not None and not b.launched:
                    self._launch(b, from_hook=False)
            self._rounds += 1
        finally:
            self._round = None
            self._ended()

    def _ended(self) -> None:
        for fn in self.after_round:
            fn()

    # ------------------------------------------------------------------ the step
    def finish(self) -> None:
        """Reduce what backward left (everything when no round ran: the plain-backward path
        launches every bucket, like the all-reduce) and wait: the accumulator is the average."""
        for b in self.buckets:
            if not b.launched and (self._rounds == 0 or b.buffer is not None):
                self._launch(b, from_hook=False)
        for b in list(self.in_flight):
            self._complete(b)
        self._rounds = 0
        self._ended()

    def zero_grad(self) -> None:
        for b in list(self.in_flight):
            self._complete(b)
        for b in self.buckets:
            if b.buffer is not None:
                self.buffer_log.append(("free", b.index, b.buffer.numel() * b.buffer.element_size()))
            b.buffer = None
            b.ready.clear()
            for q in b.params:
                q.grad = None
        self.flat.zero_()
        self._rounds = 0

    def piece_grads(self) -> list[torch.Tensor]:
        """The accumulator's view of each of ``pieces``, in their order."""
        return [self._owned[id(p)] for p, _, _ in self.pieces]
