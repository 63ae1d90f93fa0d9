"""A P2P transport with NCCL's semantics, on threads, for running the real pipeline engine.

gloo buffers a send and matches it to a receive by (peer, tag) whenever both are posted, so a
schedule that would hang on GPUs passes on gloo. This transport behaves as NCCL does under
``batch_isend_irecv``, as strictly as NCCL may:

* one handle per batch: every op of a batch completes when the whole batch has completed;
* messages between two ranks match in posting order (tags are ignored by NCCL; here a matched
  pair whose tags, shapes or dtypes differ is an error, because on a GPU it would be silent
  corruption);
* rendezvous: a send completes only when its receive has been posted AND that receive's batch
  runs (``eager_sends=True`` buffers sends instead: the control experiment);
* execution order (``serialize``): by default one stream per communicator, as if every
  communicator's kernels could run beside each other's: the batches of one communicator run
  one after the other in posting order on each rank, so a receive posted ahead, or a send whose
  receiver is busy, blocks every later batch of that communicator (and only of that one).
  ``serialize=True`` makes no such assumption, CUDA does not promise it (NVIDIA/nccl#783): one
  execution queue per rank across ALL its communicators, so a rank's batches run strictly one
  after another in posting order whatever their communicator, as on a GPU that runs its NCCL
  kernels serially (``CUDA_DEVICE_MAX_CONNECTIONS=1``, implicit launch order, a busy GPU);
* communicators: one per ``post`` for the whole pp group, as ``TorchP2PTransport`` posts
  (``per_flow=False``, the default). ``per_flow=True`` is the former layout, the control:
  every flow (kind, sender) its own communicator and its ops of a post their own batch;
* only NCCL dtypes (no bool, no complex) and contiguous tensors.

A ``wait()`` raises ``Deadlock``, naming what every rank is waiting for, as soon as every rank
waits for a batch that is not done (nothing can progress then), or when it has not completed
within ``timeout`` seconds (a rank that finished leaves the others waiting); every other waiting
rank then fails too.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

import torch

from nanotrain.parallel.pipeline_parallel.p2p import WIRE_DTYPES


class Deadlock(RuntimeError):
    pass


@dataclass(eq=False)
class _Op:
    is_send: bool
    tensor: torch.Tensor
    rank: int
    peer: int
    tag: int
    batch: "_Batch"
    done: bool = False
    data: torch.Tensor | None = None  # eager sends: the buffered copy


@dataclass(eq=False)
class _Batch:
    rank: int
    stream: tuple  # (rank, communicator), or (rank, None) under ``serialize``: one queue per rank
    comm: object  # None: the pp group's communicator; else a flow (per_flow)
    index: int  # in its stream
    ops: list = field(default_factory=list)
    done: bool = False

    def describe(self) -> str:
        parts = [f"{'send to' if o.is_send else 'recv from'} {o.peer} tag {o.tag}" for o in self.ops if not o.done]
        comm = "pp group" if self.comm is None else f"flow {self.comm}"
        return f"rank {self.rank} batch #{self.index} ({comm}): " + ", ".join(parts)


class _Handle:
    def __init__(self, world: "NcclSemanticsWorld", batch: _Batch):
        self.world, self.batch = world, batch

    def wait(self) -> bool:
        self.world._wait(self.batch)
        return True

    def is_completed(self) -> bool:
        with self.world.cond:
            return self.batch.done


class NcclSemanticsWorld:
    """Shared state of ``size`` simulated ranks; ``transport(r)`` is rank r's end."""

    def __init__(
        self,
        size: int,
        timeout: float = 10.0,
        eager_sends: bool = False,
        per_flow: bool = False,
        serialize: bool = False,
    ):
        self.size, self.timeout, self.eager_sends, self.per_flow = size, timeout, eager_sends, per_flow
        self.serialize = serialize
        self.cond = threading.Condition()
        self.queues: dict[tuple, deque] = defaultdict(deque)  # stream (rank, communicator) -> batches not done
        self.posted: dict[tuple, int] = defaultdict(int)
        self.sends: dict[tuple, deque] = defaultdict(deque)  # (communicator, src, dst) -> ops in order
        self.recvs: dict[tuple[int, int], deque] = defaultdict(deque)
        self.error: BaseException | None = None
        self.messages = 0
        self.dtypes: Counter = Counter()  # dtype -> matched messages
        self.waiting: dict[int, _Batch] = {}  # rank -> the batch it waits for

    def transport(self, rank: int) -> "SimTransport":
        return SimTransport(self, rank)

    # ------------------------------------------------------------------ posting and progress
    def _post(self, rank: int, ops) -> list:
        """One batch per communicator the ops use (as the real transport does)."""
        with self.cond:
            self._raise_if_failed()
            by_comm: dict = {}
            for op in ops:  # flow: (kind, sending rank)
                by_comm.setdefault((op.kind, rank if op.is_send else op.peer) if self.per_flow else None, []).append(op)
            handles = {}
            for comm, comm_ops in by_comm.items():
                batch = self._batch(rank, comm, comm_ops)
                handles.update({id(op): _Handle(self, batch) for op in comm_ops})
            self._progress()
            return [handles[id(op)] for op in ops]

    def _batch(self, rank: int, comm, ops) -> _Batch:
        stream = (rank, None if self.serialize else comm)
        batch = _Batch(rank, stream, comm, self.posted[stream])
        self.posted[stream] += 1
        for op in ops:
            t = op.tensor
            if t.dtype not in WIRE_DTYPES or not t.is_contiguous():
                self._fail(TypeError(f"rank {rank}: NCCL cannot send {t.dtype} (contiguous={t.is_contiguous()})"))
            o = _Op(op.is_send, t, rank, op.peer, op.tag, batch)
            if o.is_send and self.eager_sends:
                o.data, o.done = t.clone(), True
            batch.ops.append(o)
            # Order matching is per communicator and per ordered pair of ranks.
            (self.sends[(comm, rank, o.peer)] if o.is_send else self.recvs[(comm, o.peer, rank)]).append(o)
        self.queues[stream].append(batch)
        return batch

    def _running(self, batch: _Batch) -> bool:
        """A batch runs once every earlier batch of its stream (its communicator's on its rank,
        or the rank's whole queue under ``serialize``) is done."""
        queue = self.queues[batch.stream]
        return bool(queue) and queue[0] is batch

    def _progress(self) -> None:
        changed = True
        while changed:
            changed = False
            for key in set(self.sends) | set(self.recvs):
                sends, recvs = self.sends[key], self.recvs[key]
                while sends and recvs:
                    s, r = sends[0], recvs[0]
                    if not self._running(r.batch) or not (s.done or self._running(s.batch)):
                        break
                    if (s.tag, s.tensor.shape, s.tensor.dtype) != (r.tag, r.tensor.shape, r.tensor.dtype):
                        self._fail(
                            AssertionError(
                                f"NCCL order matching paired send {key[1]}->{key[2]} tag {s.tag} "
                                f"{tuple(s.tensor.shape)} {s.tensor.dtype} with receive tag {r.tag} "
                                f"{tuple(r.tensor.shape)} {r.tensor.dtype}: the two sides post in different orders"
                            )
                        )
                    r.tensor.copy_(s.data if s.data is not None else s.tensor)
                    s.done = r.done = True
                    sends.popleft()
                    recvs.popleft()
                    self.messages += 1
                    self.dtypes[r.tensor.dtype] += 1
                    changed = True
            for queue in self.queues.values():
                while queue and all(o.done for o in queue[0].ops):
                    queue.popleft().done = True
                    changed = True
        self.cond.notify_all()

    def _wait(self, batch: _Batch) -> None:
        deadline = time.monotonic() + self.timeout
        with self.cond:
            self.waiting[batch.rank] = batch
            try:
                while not batch.done:
                    self._raise_if_failed()
                    left = deadline - time.monotonic()
                    # Only a post makes progress (``_progress`` runs after each), so once every
                    # rank waits for a batch that is not done, none ever will be: fail now.
                    if len(self.waiting) == self.size and not any(b.done for b in self.waiting.values()):
                        self._fail(Deadlock("every rank waits; running batches: " + self._stuck()))
                    if left <= 0:
                        self._fail(Deadlock(f"no progress for {self.timeout:.0f} s; running batches: " + self._stuck()))
                    self.cond.wait(min(left, 0.5))
            finally:
                del self.waiting[batch.rank]

    def _stuck(self) -> str:
        return "; ".join(q[0].describe() for q in self.queues.values() if q)

    def _fail(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
        self.cond.notify_all()
        raise exc

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise Deadlock(f"another rank failed: {self.error}")


class SimTransport:
    """Rank ``rank``'s end of a ``NcclSemanticsWorld`` (the interface of ``TorchP2PTransport``)."""

    matches_by_tag = False  # NCCL matches in posting order: the engine must not post ahead

    def __init__(self, world: NcclSemanticsWorld, rank: int):
        self.world, self.rank, self.size = world, rank, world.size
        self.device = torch.device("cpu")

    def post(self, ops) -> list:
        return self.world._post(self.rank, ops)


def run_ranks(size: int, fn, timeout: float = 60.0) -> list:
    """``fn(rank)`` on ``size`` threads; their results in rank order. The first exception (a
    Deadlock included) is re-raised; threads still running after ``timeout`` are a failure."""
    results, errors = [None] * size, [None] * size

    def body(rank: int) -> None:
        try:
            results[rank] = fn(rank)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(r,), daemon=True) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    if any(t.is_alive() for t in threads):
        raise Deadlock(f"ranks still running after {timeout} s")
    first = next((e for e in errors if isinstance(e, Deadlock) and "another rank" not in str(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results
