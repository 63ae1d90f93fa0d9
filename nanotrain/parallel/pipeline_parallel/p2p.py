"""Point-to-point transfers between pipeline stages over the pipeline group (``pc.pp_pg``).

Why metadata first: a receiver does not know what a stage sends (hidden states are
``[S, B, H]``, ``[S/tp, B, H]`` under sequence parallelism, and another model could send anything),
and allocating from a fixed "expected shape", as picotron does, silently breaks when the shape
changes. Every tensor therefore travels as two messages: a fixed-size int64 header (dtype,
requires_grad, ndim, shape) and then the data, received into a buffer allocated from the header.
The receiver turns on ``requires_grad`` when the sender's tensor had it, which is how a stage
knows that the activation it got needs a gradient sent back.

Why batched: all the sends and receives of one communication point go out in one
``batch_isend_irecv`` (as Megatron's ``send_forward_recv_backward``), so two neighbours that both
send and receive at the same moment never wait on each other's send. Sends are never waited for
before the receives: the engine keeps their handles and waits for them later (``wait_sends``),
so a rank only ever blocks on data it needs, and a schedule without a cyclic dependency cannot
deadlock.

Tags: every message carries the caller's tag (header ``2 * tag``, data ``2 * tag + 1``). The
engine gives each (kind, virtual stage, micro-batch) its own tag, so on gloo a message can only
match its own receive, whatever the order in which the two sides post them. (NCCL ignores tags
and matches in posting order; the schedules post in the same order on both sides.)

Channels (gloo): the engine's messages come in streams whose shape rarely changes (the
activations stage s sends to stage s + 1, the gradients it sends back). A send or receive may
name its stream, a *channel*; from the step after a channel's first message on (``new_step``),
its messages travel as ONE packed message — a 128-byte header followed by the data, sized by the
channel's *reference* header — instead of two. If a tensor does not match the reference, the
packed message carries only its header, flagged, and the data follows as a second message, so
any shape, dtype or requires_grad still arrives intact; the reference moves at the next step
when every message of the step agreed on a new header. Both sides update references at the same
logical point (``new_step``, called by every rank at the start of each engine step) from the same
messages, so they always agree on the size of the next packed message. And since gloo matches by
tag, the engine posts every receive of a step ahead (``expect``): data then moves while ranks
compute, and a receive waits only for a tensor not sent yet. NCCL (order matching) keeps the
two-message protocol with receives posted when needed.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

from nanotrain.parallel.pipeline_parallel.tensor_pointer import TensorPointer

MAX_NDIM = 8
_HEADER = 3 + MAX_NDIM  # dtype index, requires_grad, ndim, shape (padded with zeros)
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32,
          torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)
_DTYPE_INDEX = {dt: i for i, dt in enumerate(DTYPES)}

Send = tuple  # (tensor, destination pp rank, tag) or (tensor, destination pp rank, tag, channel)
Recv = tuple  # (where the tensor is, tag) or (where the tensor is, tag, channel)
_PACK = 128  # bytes before the data of a packed message: flag + header, padded (16-byte aligned data)
_COMPLETE, _FOLLOWS = 1, 2  # packed flag: the data is here / the data follows as a second message


def encode_header(tensor: torch.Tensor, device) -> torch.Tensor:
    return torch.tensor(_header_values(tensor), dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor | list[int]) -> tuple[torch.dtype, bool, tuple[int, ...]]:
    values = header.tolist() if isinstance(header, torch.Tensor) else list(header)
    ndim = values[2]
    return DTYPES[values[0]], bool(values[1]), tuple(values[3:3 + ndim])


def _header_values(tensor: torch.Tensor) -> tuple[int, ...]:
    if tensor.dtype not in _DTYPE_INDEX:
        raise TypeError(f"P2P: cannot send dtype {tensor.dtype}; supported: {list(DTYPES)}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"P2P: cannot send a {tensor.dim()}-d tensor (at most {MAX_NDIM} dims)")
    values = [_DTYPE_INDEX[tensor.dtype], int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    return tuple(values + [0] * (_HEADER - len(values)))


def _payload_nbytes(header: tuple[int, ...]) -> int:
    dtype, _, shape = decode_header(header)
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def _as_tensor(buf: torch.Tensor, dtype: torch.dtype, requires_grad: bool, shape) -> torch.Tensor:
    out = buf.view(dtype).view(shape)
    return out.requires_grad_(requires_grad) if out.is_floating_point() or out.is_complex() else out


class P2P:
    """Batched, metadata-first sends and receives between ranks of ``pg`` (pp ranks as peers)."""

    def __init__(self, pg: dist.ProcessGroup, device: Optional[torch.device] = None):
        self.pg = pg
        self.device = device or torch.device("cpu")
        self._inflight: list[tuple[dist.Work, torch.Tensor]] = []  # sends and the buffers they read
        # Receives posted ahead of time by ``expect``: (src group rank, tag) -> (work, buffer,
        # packed?): a packed message, or the header of a two-message transfer.
        self._expected: dict[tuple[int, int], tuple[dist.Work, torch.Tensor, bool]] = {}
        # gloo matches a receive to a send by (peer, tag), whatever the posting order, so receives
        # may be posted long before they are needed and channels may pack; NCCL matches in
        # posting order and keeps the plain two-message protocol.
        self.channels = dist.get_backend(pg) == "gloo"
        # (direction, peer, channel) -> reference header, fixed between two ``new_step`` calls;
        # and the headers seen on each channel since the last ``new_step``.
        self._reference: dict[tuple, tuple[int, ...]] = {}
        self._seen: dict[tuple, set[tuple[int, ...]]] = {}

    def new_step(self) -> None:
        """Move the channel references: a channel whose messages since the last call all had one
        header takes it as its reference. Every rank calls it at the same logical point (the
        start of an engine step), after all messages of the previous step were posted and
        received, so senders and receivers agree on every packed message's size."""
        for key, headers in self._seen.items():
            if len(headers) == 1:
                self._reference[key] = next(iter(headers))
        self._seen.clear()

    def _packed_ref(self, direction: str, peer: int, channel) -> Optional[tuple[int, ...]]:
        if channel is None or not self.channels:
            return None
        return self._reference.get((direction, peer, channel))

    def _saw(self, direction: str, peer: int, channel, header: tuple[int, ...]) -> None:
        if channel is not None and self.channels:
            self._seen.setdefault((direction, peer, channel), set()).add(header)

    def expect(self, recvs: Sequence[Recv]) -> None:
        """Post now the receives of messages that ``communicate`` will receive later (gloo only;
        elsewhere a no-op): the packed message of a channel with a reference, else the header.
        The message then travels as soon as its sender posts it, while this rank computes."""
        if not self.channels:
            return
        ops, keys = [], []
        for recv in recvs:
            src, tag, channel = self._recv_parts(recv)
            key = (src.group_rank, tag)
            if key in self._expected or any(key == k for k, _ in keys):
                raise ValueError(f"P2P.expect: a receive from {key[0]} with tag {tag} is already expected")
            ref = self._packed_ref("recv", src.group_rank, channel)
            if ref is not None:
                buf = torch.empty(_PACK + _payload_nbytes(ref), dtype=torch.uint8, device=self.device)
            else:
                buf = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, group=self.pg, group_peer=src.group_rank, tag=2 * tag))
            keys.append((key, ref is not None))
        for (key, packed), work, op in zip(keys, self._post(ops), ops):
            self._expected[key] = (work, op.tensor, packed)

    @property
    def num_expected(self) -> int:
        """Receives posted by ``expect`` and not consumed by ``communicate`` yet."""
        return len(self._expected)

    def _recv_parts(self, recv) -> tuple[TensorPointer, int, object]:
        src, tag, *rest = recv
        self._check_tag(tag)
        return src, tag, (rest[0] if rest else None)

    def communicate(self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()) -> list[torch.Tensor]:
        """Post every send and receive of one communication point; return the received tensors
        (in ``recvs`` order) once they have arrived. Sends complete in the background."""
        ops = []
        for send in sends:
            tensor, dst, tag, *rest = send
            channel = rest[0] if rest else None
            self._check_tag(tag)
            header = _header_values(tensor)
            data = tensor.detach().contiguous()
            ref = self._packed_ref("send", dst, channel)
            self._saw("send", dst, channel, header)
            if ref is not None:  # one packed message (+ the data when it does not fit the reference)
                fits = header == ref
                buf = torch.empty(_PACK + _payload_nbytes(ref), dtype=torch.uint8, device=self.device)
                meta = torch.tensor([_COMPLETE if fits else _FOLLOWS, *header], dtype=torch.int64)
                buf[:meta.numel() * 8].copy_(meta.view(torch.uint8).to(self.device))
                if fits and data.numel():
                    buf[_PACK:].view(data.dtype).view(data.shape).copy_(data)
                ops.append(dist.P2POp(dist.isend, buf, group=self.pg, group_peer=dst, tag=2 * tag))
                if not fits and data.numel():
                    ops.append(dist.P2POp(dist.isend, data, group=self.pg, group_peer=dst, tag=2 * tag + 1))
                continue
            ops.append(dist.P2POp(dist.isend, torch.tensor(header, dtype=torch.int64, device=self.device),
                                  group=self.pg, group_peer=dst, tag=2 * tag))
            if data.numel():
                ops.append(dist.P2POp(dist.isend, data, group=self.pg, group_peer=dst, tag=2 * tag + 1))
        # Phase 1: every receive's first message (a packed message or a header), posted now
        # unless ``expect`` posted it already.
        firsts = []  # [src, tag, channel, work, buffer, packed?]
        posted = {}  # index in ops -> index in firsts
        for recv in recvs:
            src, tag, channel = self._recv_parts(recv)
            expected = self._expected.pop((src.group_rank, tag), None)
            if expected is not None:
                firsts.append([src, tag, channel, *expected])
                continue
            ref = self._packed_ref("recv", src.group_rank, channel)
            if ref is not None:
                buf = torch.empty(_PACK + _payload_nbytes(ref), dtype=torch.uint8, device=self.device)
            else:
                buf = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            posted[len(ops)] = len(firsts)
            ops.append(dist.P2POp(dist.irecv, buf, group=self.pg, group_peer=src.group_rank, tag=2 * tag))
            firsts.append([src, tag, channel, None, buf, ref is not None])
        for i, (work, op) in enumerate(zip(self._post(ops), ops)):
            if i in posted:
                firsts[posted[i]][3] = work
            else:
                self._inflight.append((work, op.tensor))  # the buffer must outlive the send
        for first in firsts:
            first[3].wait()

        # Phase 2: the data that is not in hand yet, into buffers allocated from the headers.
        out: list = []
        ops = []
        for src, tag, channel, _, buf, packed in firsts:
            if packed:
                values = buf[:(1 + _HEADER) * 8].view(torch.int64).tolist()
                flag, header = values[0], tuple(values[1:])
            else:
                flag, header = _FOLLOWS, tuple(buf.tolist())
            self._saw("recv", src.group_rank, channel, header)
            dtype, requires_grad, shape = decode_header(header)
            if flag == _COMPLETE:
                out.append(_as_tensor(buf[_PACK:], dtype, requires_grad, shape))
                continue
            data = torch.empty(shape, dtype=dtype, device=self.device)
            if data.numel():
                ops.append(dist.P2POp(dist.irecv, data, group=self.pg, group_peer=src.group_rank, tag=2 * tag + 1))
            out.append((data, requires_grad))
        for work in self._post(ops):
            work.wait()
        return [t if isinstance(t, torch.Tensor) else
                (t[0].requires_grad_(t[1]) if t[0].is_floating_point() or t[0].is_complex() else t[0])
                for t in out]

    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        self.communicate(sends=[(tensor, dst, tag)])

    def recv(self, src: int | TensorPointer, tag: int = 0) -> torch.Tensor:
        src = src if isinstance(src, TensorPointer) else TensorPointer(src)
        return self.communicate(recvs=[(src, tag)])[0]

    def wait_sends(self) -> None:
        """Wait until every posted send has left (its buffer may be reused or freed)."""
        for work, _ in self._inflight:
            work.wait()
        self._inflight.clear()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _post(ops: list) -> list:
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalescing backend (NCCL) returns one work for the batch
            works = [works[0]] * len(ops)
        return works

    @staticmethod
    def _check_tag(tag: int) -> None:
        if not 0 <= tag < 2 ** 30:
            raise ValueError(f"P2P tag must be in [0, 2**30), got {tag}")
