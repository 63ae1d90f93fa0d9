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

Why it cannot deadlock on NCCL. NCCL guarantees one thing about progress: the sends and
receives of one group call (``batch_isend_irecv`` on one communicator, one kernel) progress
together. It does not promise that two kernels of one GPU run at the same time: kernels on two
streams, or two communicators, may run one after the other (NVIDIA/nccl#783; more likely with
``CUDA_DEVICE_MAX_CONNECTIONS=1``, NCCL's implicit launch order or a busy GPU). So every
communication point of the engine is ONE batch on ONE communicator, the pp group: the sends the
previous step produced together with the receives the next step needs (Megatron's
``send_forward_recv_backward``; for interleaved 1f1b both directions of a steady-state step,
``send_forward_backward_recv_forward_backward``, see ``schedules.schedule_steps``). A rank's
batches run strictly in posting order, and the schedules place the communication points so that
neighbours' batches pair up: what a rank's running batch waits for, its neighbours post without
first waiting for a later batch of that rank, and no rank ever needs two of its own kernels to
run at once. This is checked, not derived in general: ``tests/test_pipeline_nccl_semantics.py``
runs every engine (pp 2 and 4, every valid m <= 8, v 1 and 2) on a simulation where each rank
executes its batches one at a time and a send completes only while its receive's batch runs,
and shows the former layout (one communicator per flow, one batch each) deadlocking there (1f1b
at pp 2 in its first steady-state exchange). One communicator also carries both kinds of
message between two ranks (at pp = 2 with interleaving rank 0 sends rank 1 activations and
gradients), and NCCL matches them in posting order: the engine posts a step's sends and its
receives in action order, so both sides agree (the simulation checks the tags of every matched
pair). Sends are never waited for before receives; the engine waits for them at the end of the
step (``wait_sends``).

Transports. ``P2P`` speaks to a transport: ``TorchP2PTransport`` (torch.distributed over the pp
group) in production, a simulated one in tests (``tests/helpers/nccl_sim.py``: NCCL's semantics on
threads, to check that no schedule deadlocks). gloo matches a receive to a send by (peer, tag), in
any posting order, so on gloo the engine posts every receive of a step ahead (``expect``) and
data moves while ranks compute. NCCL ignores tags and matches in posting order per pair, and a
receive posted ahead would block the communicator's stream for the sends queued behind it, so
there receives are posted exactly when needed, in the same order on both sides (the schedules
guarantee it; the simulation checks that the tags of matched messages agree).

The hang record (``hang_record.py``). ``communicate`` records, once per communication point and
right before it waits, which messages it waits on (peers and tags, sends of the same batch
included) and the transport's communicator; the transport's post records only the generic
"pipeline send/recv" (through ``collectives.batch_isend_irecv``), which stands while the post
itself runs (a communicator created lazily on its first use) and for ``expect``'s posts.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from nanotrain.parallel.collectives import batch_isend_irecv, wait
from nanotrain.parallel.hang_record import HANG_RECORD

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
    """One transport operation: a send (``is_send``) or a receive into ``tensor``; ``peer`` is a
    pp group rank; ``kind``: ACTIVATION or GRADIENT (for transports that route by it, such as the
    simulation's per-flow control)."""

    is_send: bool
    tensor: torch.Tensor
    peer: int
    tag: int
    kind: int = ACTIVATION


class TorchP2PTransport:
    """``torch.distributed`` point-to-point over the pp group: one ``batch_isend_irecv`` per post."""

    def __init__(self, pg: dist.ProcessGroup, device: Optional[torch.device] = None):
        self.pg = pg
        self.device = device or torch.device("cpu")
        self.size, self.rank = pg.size(), pg.rank()
        self.matches_by_tag = dist.get_backend(pg) == "gloo"
        # P2POp takes global ranks on every torch we support (``group_peer`` exists from 2.6 only).
        self._global = dist.get_process_group_ranks(pg)

    def post(self, ops: Sequence[Op]) -> list:
        """Post ``ops`` as one batch on the pp group (one NCCL kernel: see the module doc); one
        waitable handle per op (the same one for every op on a coalescing backend such as NCCL)."""
        p2p_ops = [dist.P2POp(dist.isend if op.is_send else dist.irecv, op.tensor, peer=self._global[op.peer],
                              group=self.pg, tag=op.tag) for op in ops]
        handles = batch_isend_irecv(p2p_ops, "pipeline send/recv", self.pg)
        return list(handles) if len(handles) == len(ops) else [handles[0]] * len(ops)


class P2P:
    """Batched sends and receives of tensors whose shapes both sides know (see module doc)."""

    def __init__(self, transport):
        self.transport = transport
        self.device = transport.device
        self._inflight: list[tuple[object, torch.Tensor]] = []  # sends and the buffers they read
        self._expected: dict[tuple[int, int], tuple[object, torch.Tensor]] = {}  # (src, tag) -> posted recv
        self._group = getattr(transport, "pg", None)  # for the hang record (none: the world)

    @classmethod
    def over(cls, pg: dist.ProcessGroup, device: Optional[torch.device] = None) -> "P2P":
        return cls(TorchP2PTransport(pg, device))

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
            ops.append(Op(True, data, send.dst, self._check_tag(send.tag), send.kind))
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
            wait(work)
            out.append(buf.requires_grad_(requires_grad) if buf.is_floating_point() else buf)
        return out

    def wait_sends(self) -> None:
        """Wait until every posted send has left (its buffer may be reused or freed)."""
        for work, _ in self._inflight:
            wait(work)
        self._inflight.clear()

    # ------------------------------------------------------------------ internals
    def _record(self, sends: Sequence[Send], recvs: Sequence[Recv]) -> None:
        """The hang record for the waits of one communication point (see the module doc): its
        messages and the communicator."""
        what = ", ".join([*(f"send to pp rank {s.dst} tag {s.tag}" for s in sends),
                          *(f"recv from pp rank {r.src} tag {r.tag}" for r in recvs)])
        HANG_RECORD.entering(f"pipeline send/recv: {what}", self._group)

    def _recv_op(self, recv: Recv, buf: torch.Tensor) -> Op:
        return Op(False, buf, recv.src, self._check_tag(recv.tag), recv.kind)

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
