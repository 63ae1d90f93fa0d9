"""Bucketed gradient all-reduce (or ZeRO-1 reduce-scatter) overlapped with backward
(picotron's ``bucket.py`` design).

Gradients are grouped into ~25 MB flat buffers, filled in REVERSE parameter order (the output
layers' gradients come first in backward; ``buckets.bucket_layout``), and each buffer's
all-reduce is launched as soon as its last gradient is accumulated: few large messages, sent while
backward keeps computing. Every ``.grad`` is a view into its bucket, so autograd accumulates in
place (micro-batch accumulation is free). A completed bucket is launched only after every bucket
of a smaller index, so the launch order is 0, 1, 2, ... on every rank whatever order the hooks
fire in (no deadlock when ranks' graphs differ); buckets that never complete (a parameter got no
gradient: zeros) are launched, in index order, by ``finish_grad_sync()``.

Averaging divides each bucket by the group size BEFORE the SUM all-reduce (as DDP; gloo has no
AVG): exact for powers of two, within about one ulp otherwise. Gradients stay in the parameters'
dtype; fp32 main grads for bf16 models are the mixed-precision layer's job.

ZeRO-1: ``ZeroOneOptimizer`` calls ``shard()``; the buckets are rebuilt padded to a multiple of
the group size, and each all-reduce becomes a reduce-scatter into the piece this rank's optimizer
updates. Only the owned pieces then hold the average (``grad_shards()`` names them, for the grad
norm). Until the optimizer's first ``step()`` (``stop_gathering_grads()``) ``finish_grad_sync``
also all-gathers the pieces, so gradients taken before any update are whole; the pieces, the
update and the norm are bitwise the same either way.

ZeRO-2 (``shard(stage=2)``, ``shard_grads.py``): the same partition, but every micro-batch's
backward is a round that reduce-scatters its buckets into a persistent fp32 accumulator of the
owned pieces and frees each full bucket buffer; ``no_sync`` is then not used by the step (the
engines call ``backward_scope``, which is ``no_sync`` for all but the last micro-batch at
stages 0/1 and a round at stage 2).

Use::

    sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    for micro_batch in batches[:-1]:
        with sync.no_sync():            # accumulate only
            loss_fn(model(micro_batch)).backward()
    loss_fn(model(batches[-1])).backward()   # all-reduces (reduce-scatters) from hooks, overlapped
    sync.finish_grad_sync()             # wait: grads are averaged now (ZeRO-1: the owned pieces)
    optimizer.step(); sync.zero_grad()  # zero the buffers, keep the views (NOT set_to_none)
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from nanotrain.parallel import accelerator
from nanotrain.parallel.collectives import all_gather_into, all_reduce, reduce_scatter_into, wait
from nanotrain.parallel.data_parallel import buckets as layout
from nanotrain.parallel.data_parallel.shard_grads import ShardAccumulator, on_the_wire, piece_of
from nanotrain.parallel.data_parallel.sync_sharding import ZeroSharding
from nanotrain.parallel.observe.hang_record import HANG_RECORD

_SYNC = "_nanotrain_grad_sync"  # on each parameter: a weak reference to the sync of its gradient


def grad_sync_of(p: nn.Parameter) -> Optional["BucketedGradSync"]:
    """The live ``BucketedGradSync`` whose bucket holds ``p``'s gradient, if any."""
    ref = getattr(p, _SYNC, None)
    return ref() if ref is not None else None


@dataclass
class Bucket:
    """One flat gradient buffer and the parameters whose ``.grad`` are views into it."""

    index: int
    params: list[nn.Parameter]
    offsets: list[int]  # start of each param's gradient in ``buffer``
    buffer: Optional[torch.Tensor]  # ZeRO-2: None while released (``shard_grads.py``)
    size: int  # the buffer's length (padded to a multiple of the shards when sharded)
    ready: set[int] = field(default_factory=set)  # id() of params whose grad is final this step
    launched: bool = False
    handle: Optional[dist.Work] = None
    wire: Optional[torch.Tensor] = None  # what the collective reduces: ``buffer``, or its copy in the reduce dtype

    @property
    def complete(self) -> bool:
        return len(self.ready) == len(self.params)


def _same_storage(grad: Optional[torch.Tensor], view: torch.Tensor) -> bool:
    return grad is view or (grad is not None and accelerator.same_memory(grad, view))


class BucketedGradSync(ZeroSharding):
    """Average ``.grad`` of ``params`` over ``group`` with bucketed async all-reduces (or, once a
    ``ZeroOneOptimizer`` took it over, reduce-scatters into the pieces its rank owns).

    ``group``: the data-parallel group (``pc.dp_cp_pg`` in practice: cp ranks are replicas too);
    ``None`` means the default group when torch.distributed is initialised, else no communication.
    A group of size 1 does no communication and gives the same results.
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        group: Optional[dist.ProcessGroup] = None,
        bucket_cap_mb: float = layout.DEFAULT_BUCKET_CAP_MB,
        divisor: Optional[int] = None,
        replicate_group: Optional[dist.ProcessGroup] = None,
        reduce_dtype: Optional[torch.dtype] = None,
    ):
        seen: set[int] = set()
        self.params: list[nn.Parameter] = []
        for p in params:
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                self.params.append(p)
        self.group = group
        initialised = dist.is_available() and dist.is_initialized()
        self.world_size = dist.get_world_size(group) if initialised else 1
        self.rank = dist.get_rank(group) if initialised else 0
        self.shards = 1  # the group size once ``shard()`` cut the buckets: reduce-scatter
        self.gather_grads = False  # after a reduce-scatter, all-gather the pieces (module doc)
        self._pieces: list[tuple[nn.Parameter, int, int]] = []
        self.accumulator: Optional[ShardAccumulator] = None  # ZeRO-2 (``shard(stage=2)``)
        # The sum is divided by ``divisor`` (default the group size): expert parameters sum over
        # dp x cp but average over dp x cp x ep, the ranks whose tokens reached them.
        self.divisor = divisor or self.world_size
        self.replicate_group = replicate_group  # hybrid sharding: sum across the blocks (hybrid.py)
        # ``optimizer.grad_reduce_dtype``: None reduces in the gradients' dtype (fp32 master grads)
        self.reduce_dtype = reduce_dtype
        self.bucket_cap_bytes = layout.cap_bytes(bucket_cap_mb)
        self.buckets: list[Bucket] = self._build_buckets()
        self._index_views()
        self._attach_views(copy_existing=True)
        # The hooks reach this object through a weak reference. A hook lives in the parameter's
        # C++ autograd metadata, which Python's cycle collector cannot see, so a bound method there
        # (param -> hook -> self -> param) is a cycle no collector frees: this object, its buckets
        # and its process group (with the group's C++ threads) would live until interpreter
        # shutdown and be torn down inside it, where a gloo thread that needs the GIL aborts the
        # process ("terminate called without an active exception").
        ref = weakref.ref(self)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, ref=ref: ref()._on_grad_ready(p)) for p in self.params
        ]
        for p in self.params:  # how ZeroOneOptimizer finds the sync of its parameters
            setattr(p, _SYNC, ref)
        self._sync_enabled = True
        self._next_launch = 0
        self._hooks_fired = 0
        self._new_round = True
        # (bucket index, hooks fired so far this round, launched from a backward hook?) for each
        # launch of the current (or last finished) sync round: evidence of overlap for tests
        # and profiling. Cleared by the first gradient of the next round.
        self.launch_log: list[tuple[int, int, bool]] = []

    # ------------------------------------------------------------------ construction
    def _build_buckets(self, shards: int = 1, allocate: bool = True, units: Optional[dict] = None) -> list[Bucket]:
        if shards > 1:
            unit_list = None if units is None else [units[id(p)] for p in self.params]
            cuts = layout.sharded_layout(self.params, self.bucket_cap_bytes, unit_list)
        else:
            cuts = layout.bucket_layout(self.params, self.bucket_cap_bytes)
        buckets = []
        for i, indices in enumerate(cuts):
            ps = [self.params[j] for j in indices]
            offsets, n = [], 0
            for p in ps:
                offsets.append(n)
                n += p.numel()
            size = n if shards == 1 else layout.padded(n, shards)
            buf = torch.zeros(size, dtype=ps[0].dtype, device=ps[0].device) if allocate else None
            buckets.append(Bucket(i, ps, offsets, buf, size))
        return buckets

    def _index_views(self) -> None:
        self._bucket_of: dict[int, Bucket] = {}
        self._view_of: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            for p, off in zip(b.params, b.offsets):
                self._bucket_of[id(p)] = b
                if b.buffer is not None:
                    self._view_of[id(p)] = b.buffer[off : off + p.numel()].view_as(p)

    def _attach_views(self, copy_existing: bool) -> None:
        for p in self.params:
            view = self._view_of[id(p)]
            if not _same_storage(p.grad, view):
                if copy_existing and p.grad is not None:
                    view.copy_(p.grad)
                p.grad = view

    # ------------------------------------------------------------------ backward hooks
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        if self.accumulator is not None:
            if self._new_round:
                self._new_round = False
                self.launch_log, self.accumulator.buffer_log = [], []
            self._hooks_fired += 1
            self.accumulator.on_grad(p)
            return
        view = self._view_of[id(p)]
        if not _same_storage(p.grad, view):
            # Someone replaced .grad (e.g. optimizer.zero_grad(set_to_none=True)); autograd then
            # created a fresh tensor holding the whole gradient: move it back into the bucket.
            view.copy_(p.grad)
            p.grad = view
        if self._new_round:  # first gradient since the last finish/zero_grad
            self._new_round = False
            self.launch_log = []
        self._hooks_fired += 1
        if not self._sync_enabled:
            return
        bucket = self._bucket_of[id(p)]
        if bucket.launched:
            raise RuntimeError(
                "BucketedGradSync: a gradient was accumulated into a bucket that is already being "
                "reduced. Run every micro-batch but the last inside `no_sync()`, and call "
                "`finish_grad_sync()` before the next step's backward."
            )
        bucket.ready.add(id(p))
        if bucket.complete:
            self._launch_in_order(from_hook=True)

    def _launch_in_order(self, from_hook: bool, force: bool = False) -> None:
        """Launch completed buckets strictly in index order (same order on every rank)."""
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if not (b.complete or force):
                break
            self._launch(b, from_hook)
            self._next_launch += 1

    def _launch(self, b: Bucket, from_hook: bool) -> None:
        if self.divisor > 1:
            b.buffer.div_(self.divisor)
        b.wire = on_the_wire(b.buffer, self.reduce_dtype) if self.world_size > 1 else b.buffer
        if self.shards > 1:  # in place: the output is this rank's piece of the input
            b.handle = reduce_scatter_into(
                piece_of(b.wire, self.shards, self.rank), b.wire, group=self.group, async_op=True
            )
        elif self.world_size > 1:
            b.handle = all_reduce(
                b.wire,
                op=dist.ReduceOp.SUM,
                group=self.group,
                async_op=True,
                what=f"all_reduce gradient bucket {b.index}",
            )
        b.launched = True
        self.launch_log.append((b.index, self._hooks_fired, from_hook))

    def _log_launch(self, index: int, from_hook: bool) -> None:
        self.launch_log.append((index, self._hooks_fired, from_hook))

    # ------------------------------------------------------------------ public API
    def backward_scope(self, last: bool, params: Optional[Iterable[nn.Parameter]] = None):
        """The context one micro-batch's backward runs in (the engines' one call): ``no_sync()``
        but for the step's ``last`` backward of these ``params`` (stages 0/1: reduce once per
        step), or under ZeRO-2 a round that reduce-scatters the buckets of ``params`` (None: all
        of this sync's) during and right after it (``shard_grads.py``)."""
        if self.accumulator is not None:
            return self.accumulator.round(params)
        return contextlib.nullcontext() if last else self.no_sync()

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside only accumulate into the buckets (gradient accumulation)."""
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def finish_grad_sync(self) -> None:
        """Launch whatever backward did not (in index order), wait for every bucket, reset.

        After it returns every ``.grad`` is the group average (after ``shard()``: on the owned
        pieces, ``grad_shards()``) and is a view into its bucket (a
        parameter that got no gradient this step has zeros, identically on every rank, so dp
        replicas stay in lockstep). Calling it when backward ran entirely inside ``no_sync``
        also works: it then syncs everything here, without overlap.
        """
        if not self._sync_enabled:
            raise RuntimeError("BucketedGradSync.finish_grad_sync() called inside no_sync()")
        if self.accumulator is not None:
            self.accumulator.finish()
            self._hooks_fired, self._new_round = 0, True
            self._across_blocks()
            return
        for b in self.buckets[self._next_launch :]:
            for p in b.params:
                view = self._view_of[id(p)]
                if not _same_storage(p.grad, view):
                    if p.grad is None:  # set to None and no gradient since: it is zero
                        view.zero_()
                    else:
                        view.copy_(p.grad)
                    p.grad = view
        self._launch_in_order(from_hook=False, force=True)
        self._wait_and_reset()
        self._across_blocks()
        if self.gather_grads:  # before the first update: the whole average (module doc)
            handles = [all_gather_into(b.buffer, self._owned(b), group=self.group, async_op=True) for b in self.buckets]
            for h in handles:
                wait(h)

    wait = finish_grad_sync

    def _wait_and_reset(self) -> None:
        for b in self.buckets:
            if b.handle is not None:
                op = "reduce_scatter" if self.shards > 1 else "all_reduce"
                HANG_RECORD.entering(f"wait {op} gradient bucket {b.index}", self.group)
                wait(b.handle)
            if b.wire is not None and b.wire is not b.buffer:  # back from the reduce dtype
                if self.shards > 1:
                    self._owned(b).copy_(piece_of(b.wire, self.shards, self.rank))
                else:
                    b.buffer.copy_(b.wire)
            b.handle, b.launched, b.wire = None, False, None
            b.ready.clear()
        self._next_launch = 0
        self._hooks_fired = 0
        self._new_round = True

    def zero_grad(self) -> None:
        """Zero the buckets in place and make sure every ``.grad`` is its bucket view again.

        Waits for any in-flight reduction first (a skipped ``finish_grad_sync``), so the buffers
        are never zeroed under a running collective.
        """
        if self.accumulator is not None:
            self.accumulator.zero_grad()
            self._hooks_fired, self._new_round, self.launch_log = 0, True, []
            return
        self._wait_and_reset()
        self.launch_log = []
        for b in self.buckets:
            b.buffer.zero_()
        self._attach_views(copy_existing=False)

    # ------------------------------------------------------------------ introspection
    def grad_view(self, p: nn.Parameter) -> torch.Tensor:
        return self._view_of[id(p)]

    def __repr__(self) -> str:
        sizes = [b.size for b in self.buckets]
        return (
            f"BucketedGradSync(params={len(self.params)}, buckets={len(self.buckets)}, "
            f"elements per bucket={sizes}, group size={self.world_size}, shards={self.shards}, "
            f"zero2={self.accumulator is not None})"
        )
