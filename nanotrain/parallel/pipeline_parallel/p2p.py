"""Point-to-point transfers between pipeline stages: shapes known ahead, one message per tensor.

No metadata on the wire: a receiver that first reads a shape header must wait for it on the host
before posting the data receive, and under NCCL two neighbours doing that inside batches that
also hold their own sends wait on each other forever (and pay two host syncs per message). As in
Megatron, every message of a step has a shape and dtype both sides know in advance
(``MessageSpec``, derived from the model and the micro-batch shape): the sender checks its tensor
against it (host metadata only), the receiver allocates from it.

One batch on one communicator per communication point: NCCL only promises that the sends and
receives of one group call progress together, not that two kernels of a GPU run at once
(NVIDIA/nccl#783). So each point is ONE ``batch_isend_irecv`` on the pp group holding the sends
the previous step produced and the receives the next step needs (Megatron's
``send_forward_recv_backward``; see ``schedules.schedule_steps``), and the schedules place the
points so that neighbours' batches pair up. ``tests/test_pipeline_nccl_semantics.py`` checks it
for every engine on a simulation that runs each rank's batches one at a time. Sends are never
waited for before receives; the engine waits for them at the end of the step (``wait_sends``).

Transports: ``TorchP2PTransport`` (torch.distributed over the pp group), or a simulated one in
tests (``tests/helpers/nccl_sim.py``). gloo matches by (peer, tag) in any order, so on gloo every
receive of a step is posted ahead (``expect``) and data moves while ranks compute; NCCL ignores
tags and matches in posting order, so there receives are posted exactly when needed, in the same
order on both sides. ``communicate`` writes the hang record (``hang_record.py``) once per point,
before it waits: the messages it waits on and the communicator.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch
import torch.distributed as dist

from nanotrain.parallel.collectives import batch_isend_irecv, wait
from nanotrain.parallel.observe.hang_record import HANG_RECORD

# What NCCL can carry (it has no complex or bool types); gloo carries these too.
WIRE_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
)


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
        p2p_ops = [
            dist.P2POp(
                dist.isend if op.is_send else dist.irecv,
                op.tensor,
                peer=self._global[op.peer],
                group=self.pg,
                tag=op.tag,
            )
            for op in ops
        ]
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
        recv_works = iter(works[len(sends) :])
        for index in posted_now:
            work, buf, grad = waiting[index]
            waiting[index] = (next(recv_works), buf, grad)
        self._inflight += [(work, op.tensor) for work, op in zip(works[: len(sends)], ops)]
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
        what = ", ".join(
            [
                *(f"send to pp rank {s.dst} tag {s.tag}" for s in sends),
                *(f"recv from pp rank {r.src} tag {r.tag}" for r in recvs),
            ]
        )
        HANG_RECORD.entering(f"pipeline send/recv: {what}", self._group)

    def _recv_op(self, recv: Recv, buf: torch.Tensor) -> Op:
        return Op(False, buf, recv.src, self._check_tag(recv.tag), recv.kind)

    def _buffer(self, recv: Recv) -> torch.Tensor:
        return torch.empty(recv.spec.shape, dtype=recv.spec.dtype, device=self.device)

    @staticmethod
    def _check_tag(tag: int) -> int:
        if not 0 <= tag < 2**30:
            raise ValueError(f"P2P tag must be in [0, 2**30), got {tag}")
        return tag


def check_message(tensor: torch.Tensor, spec: MessageSpec, what: str) -> None:
    """A stage's output must be exactly what its neighbour allocated for (host metadata only)."""
    if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
        raise RuntimeError(
            f"pipeline: {what} is {tuple(tensor.shape)} {tensor.dtype}, but the receiving "
            f"stage expects {tuple(spec.shape)} {spec.dtype} (model.pipeline_message)"
        )
    if spec.dtype not in WIRE_DTYPES:
        raise TypeError(
            f"pipeline: {what} has dtype {spec.dtype}, which NCCL cannot send; "
            f"supported: {[str(d) for d in WIRE_DTYPES]}"
        )
