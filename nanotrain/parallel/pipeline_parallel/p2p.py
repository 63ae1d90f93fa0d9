"""Point-to-point transfers between pipeline stages: shapes known ahead, one message per tensor.

Why no metadata on the wire: a receiver that first reads a shape header must wait for it on the
host (``.tolist()``) before it can post the data receive. Under NCCL that is fatal: a batch of
``batch_isend_irecv`` completes as a whole, and a large send completes only once the peer has
posted the matching receive, so two neighbours that each wait for a header inside a batch that
also holds their own data send wait on each other forever (1f1b and interleaved deadlocked for
every m >= 2). It also costs two host syncs per message. As in Megatron (``tensor_shape`` from
the config), every message of a step has a shape and dtype both sides know in advance: the
engine derives it from the model and the micro-batch shape (``MessageSpec``), the sender checks
its tensor against it (host metadata only, no sync) and the receiver allocates from it.

Flows. Every message belongs to a *flow*: (kind, sending pp rank), i.e. the activations rank r
sends to r + 1 or the gradients it sends to r - 1 (the interleaved schedule wraps around). On
NCCL each flow has its own two-rank communicator (``ParallelContext.pipeline_flow_groups``), so
its own stream: a send then waits only for its own receiver and never holds up another flow's
receive queued behind it on a shared stream — the schedule is as free of deadlock as with
buffered sends, whatever the order of actions (with one communicator per pp group, a rank
whose only op is a send, and the neighbour likewise, hang each other: the simulation shows it
for interleaved 1f1b). Sends are never waited for before receives; the engine waits for them at
the end of the step (``wait_sends``).

Transports. ``P2P`` speaks to a transport: ``TorchP2PTransport`` (torch.distributed over the pp
group) in production, a simulated one in tests (``tests/helpers/nccl_sim.py``: NCCL's semantics on
threads, to prove no schedule deadlocks). gloo matches a receive to a send by (peer, tag), in
any posting order, so on gloo the engine posts every receive of a step ahead (``expect``) and
data moves while ranks compute. NCCL ignores tags and matches in posting order per pair, and a
receive posted ahead would block the communicator's stream for the sends queued behind it, so
there receives are posted exactly when needed, in the same order on both sides (the schedules
guarantee it; the simulation checks that the tags of matched messages agree).

The hang record (``progress.py``). ``communicate`` records, once per communication point and
right before it waits, which messages it waits on (peers and tags, sends of the same batch
included) and the communicator of the receive; the transport's post records only the generic
"pipeline send/recv" (through ``collectives.batch_isend_irecv``), which stands while the post
itself runs (a communicator created lazily on its first use) and for ``expect``'s posts.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from nanotrain.parallel.collectives import batch_isend_irecv
from nanotrain.parallel.progress import PROGRESS

# What NCCL can carry (it has no complex or bool types); gloo carries these too.
WIRE_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
               torch.int8, torch.uint8)


class MessageSpec(NamedTuple):
    """Shape and dtype of one tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: torch.dtype


ACTIVATION, GRADIENT = 0, 1  # message kinds: forward to the next stage, backward to the previous


class Recv(NamedTuple):
    src: int  # pp group rank of the sender
    tag: int
    spec: MessageSpec
    requires_grad: bool = False  # an activation whose gradient will be sent back
    kind: int = ACTIVATION


class Send(NamedTuple):
    tensor: torch.Tensor
    dst: int  # pp group rank of the receiver
    tag: int
    kind: int = ACTIVATION


class Op(NamedTuple):
    """One transport operation: a send (``is_send``) or a receive into ``tensor``; ``flow`` is
    (kind, sending pp rank)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    flow: tuple[int, int]


class TorchP2PTransport:
    """``torch.distributed`` point-to-point over the pp group (group ranks as peers), or over one
    communicator per flow (``flow_groups``: flow -> two-rank process group) where given."""

    def __init__(self, pg: dist.ProcessGroup, device: Optional[torch.device] = None,
                 flow_groups: Optional[dict] = None):
        self.pg, self.flow_groups = pg, flow_groups
        self.device = device or torch.device("cpu")
        self.size, self.rank = pg.size(), pg.rank()
        self.matches_by_tag = dist.get_backend(pg) == "gloo"
        self._pp_ranks = dist.get_process_group_ranks(pg)

    def group_of(self, flow: tuple[int, int]) -> dist.ProcessGroup:
        """The process group that carries ``flow`` (kind, sending pp rank)."""
        return self.pg if self.flow_groups is None else self.flow_groups[flow]

    def post(self, ops: Sequence[Op]) -> list:
        """Post ``ops``, one batch per process group; one waitable handle per op (the same one
        for every op of a batch on a coalescing backend such as NCCL)."""
        batches: dict[int, list[int]] = {}  # id(group) -> indices into ops
        groups = {}
        for i, op in enumerate(ops):
            group = self.group_of(op.flow)
            groups[id(group)] = group
            batches.setdefault(id(group), []).append(i)
        works: list = [None] * len(ops)
        for key, indices in batches.items():
            group = groups[key]
            p2p_ops = [dist.P2POp(dist.isend if ops[i].is_send else dist.irecv, ops[i].tensor, group=group,
                                  group_peer=self._group_peer(group, ops[i].peer), tag=ops[i].tag)
                       for i in indices]
            handles = batch_isend_irecv(p2p_ops, "pipeline send/recv", group)
            for n, i in enumerate(indices):
                works[i] = handles[n] if len(handles) == len(indices) else handles[0]
        return works

    def _group_peer(self, group, pp_peer: int) -> int:
        if group is self.pg:
            return pp_peer
        return dist.get_group_rank(group, self._pp_ranks[pp_peer])


class P2P:
    """Batched sends and receives of tensors whose shapes both sides know (see module doc)."""

    def __init__(self, transport):
        self.transport = transport
        self.device = transport.device
        self._inflight: list[tuple[object, torch.Tensor]] = []  # sends and the buffers they read
        self._expected: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # (src, tag) -> posted recv
        self._group_of = getattr(transport, "group_of", None)  # for the hang record (none: the world)

    @classmethod
    def over(cls, pg: dist.ProcessGroup, device: Optional[torch.device] = None,
             flow_groups: Optional[dict] = None) -> "P2P":
        return cls(TorchP2PTransport(pg, device, flow_groups))

    @property
    def posts_ahead(self) -> bool:
        """True when receives may be posted long before they are needed (tag matching)."""
        return self.transport.matches_by_tag

    def expect(self, recvs: Sequence[Recv]) -> None:
        """Post now the receives that ``communicate`` will hand out later (tag-matching
        transports only; a no-op elsewhere)."""
        if not self.posts_ahead or not recvs:
            return
        ops = []
        for recv in recvs:
            key = (recv.src, recv.tag)
            if key in self._expected or any(op.peer == recv.src and op.tag == recv.tag for op in ops):
                raise ValueError(f"P2P.expect: a receive from {recv.src} with tag {recv.tag} is already expected")
            ops.append(self._recv_op(recv, self._buffer(recv)))
        for op, work in zip(ops, self.transport.post(ops)):
            self._expected[(op.peer, op.tag)] = (work, op.tensor)

    @property
    def num_expected(self) -> int:
        """Receives posted by ``expect`` and not handed out by ``communicate`` yet."""
        return len(self._expected)

    def communicate(self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()) -> list[torch.Tensor]:
        """Post every send and receive of one communication point in one batch; return the
        received tensors (in ``recvs`` order) once they have arrived. Sends complete in the
        background (``wait_sends``)."""
        ops, waiting = [], []  # waiting: (work or None = posted now, buffer, requires_grad)
        for send in sends:
            data = send.tensor.detach()
            if not data.is_contiguous():
                data = data.contiguous()
            ops.append(Op(True, data, send.dst, self._check_tag(send.tag), (send.kind, self.transport.rank)))
        posted_now = []
        for recv in recvs:
            expected = self._expected.pop((recv.src, recv.tag), None)
            if expected is not None:
                waiting.append((expected[0], expected[1], recv.requires_grad))
                continue
            buf = self._buffer(recv)
            posted_now.append(len(waiting))
            waiting.append((None, buf, recv.requires_grad))
            ops.append(self._recv_op(recv, buf))
        works = self.transport.post(ops) if ops else []
        recv_works = iter(works[len(sends):])
        for index in posted_now:
            work, buf, grad = waiting[index]
            waiting[index] = (next(recv_works), buf, grad)
        self._inflight += [(work, op.tensor) for work, op in zip(works[:len(sends)], ops)]
        if waiting:
            self._record(sends, recvs)
        out = []
        for work, buf, requires_grad in waiting:
            work.wait()
            out.append(buf.requires_grad_(requires_grad) if buf.is_floating_point() else buf)
        return out

    def wait_sends(self) -> None:
        """Wait until every posted send has left (its buffer may be reused or freed)."""
        for work, _ in self._inflight:
            work.wait()
        self._inflight.clear()

    # ------------------------------------------------------------------ internals
    def _record(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> None:
        """The hang record for the waits of one communication point (see the module doc): its
        messages, and the group of the first receive (the one waited on first)."""
        what = ", ".join([*(f"send to pp rank {s.dst} tag {s.tag}" for s in sends),
                          *(f"recv from pp rank {r.src} tag {r.tag}" for r in recvs)])
        group = self._group_of((recvs[0].kind, recvs[0].src)) if self._group_of is not None else None
        PROGRESS.entering(f"pipeline send/recv: {what}", group)

    def _recv_op(self, recv: Recv, buf: torch.Tensor) -> Op:
        return Op(False, buf, recv.src, self._check_tag(recv.tag), (recv.kind, recv.src))

    def _buffer(self, recv: Recv) -> torch.Tensor:
        return torch.empty(recv.spec.shape, dtype=recv.spec.dtype, device=self.device)

    @staticmethod
    def _check_tag(tag: int) -> int:
        if not 0 <= tag < 2 ** 30:
            raise ValueError(f"P2P tag must be in [0, 2**30), got {tag}")
        return tag


def check_message(tensor: torch.Tensor, spec: MessageSpec, what: str) -> None:
    """A stage's output must be exactly what its neighbour allocated for (host metadata only)."""
    if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
        raise RuntimeError(f"pipeline: {what} is {tuple(tensor.shape)} {tensor.dtype}, but the receiving "
                           f"stage expects {tuple(spec.shape)} {spec.dtype} (model.pipeline_message)")
    if spec.dtype not in WIRE_DTYPES:
        raise TypeError(f"pipeline: {what} has dtype {spec.dtype}, which NCCL cannot send; "
                        f"supported: {[str(d) for d in WIRE_DTYPES]}")
