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

Send = tuple[torch.Tensor, int, int]  # (tensor, destination pp rank, tag)
Recv = tuple[TensorPointer, int]  # (where the tensor is, tag)


def encode_header(tensor: torch.Tensor, device) -> torch.Tensor:
    if tensor.dtype not in _DTYPE_INDEX:
        raise TypeError(f"P2P: cannot send dtype {tensor.dtype}; supported: {list(DTYPES)}")
    if tensor.dim() > MAX_NDIM:
        raise ValueError(f"P2P: cannot send a {tensor.dim()}-d tensor (at most {MAX_NDIM} dims)")
    header = [_DTYPE_INDEX[tensor.dtype], int(tensor.requires_grad), tensor.dim(), *tensor.shape]
    header += [0] * (_HEADER - len(header))
    return torch.tensor(header, dtype=torch.int64, device=device)


def decode_header(header: torch.Tensor) -> tuple[torch.dtype, bool, tuple[int, ...]]:
    values = header.tolist()
    ndim = values[2]
    return DTYPES[values[0]], bool(values[1]), tuple(values[3:3 + ndim])


class P2P:
    """Batched, metadata-first sends and receives between ranks of ``pg`` (pp ranks as peers)."""

    def __init__(self, pg: dist.ProcessGroup, device: Optional[torch.device] = None):
        self.pg = pg
        self.device = device or torch.device("cpu")
        self._inflight: list[tuple[dist.Work, torch.Tensor]] = []  # sends and the buffers they read

    def communicate(self, sends: Sequence[Send] = (), recvs: Sequence[Recv] = ()) -> list[torch.Tensor]:
        """Post every send and receive of one communication point; return the received tensors
        (in ``recvs`` order) once they have arrived. Sends complete in the background."""
        ops, headers_in = [], []
        for tensor, dst, tag in sends:
            self._check_tag(tag)
            data = tensor.detach().contiguous()
            header = encode_header(tensor, self.device)  # requires_grad of the original tensor
            ops.append(dist.P2POp(dist.isend, header, group=self.pg, group_peer=dst, tag=2 * tag))
            if data.numel():
                ops.append(dist.P2POp(dist.isend, data, group=self.pg, group_peer=dst, tag=2 * tag + 1))
        for src, tag in recvs:
            self._check_tag(tag)
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            ops.append(dist.P2POp(dist.irecv, header, group=self.pg, group_peer=src.group_rank, tag=2 * tag))
            headers_in.append(header)
        works = self._post(ops)
        for work, op in zip(works, ops):
            if op.op is dist.isend:
                self._inflight.append((work, op.tensor))  # the buffer must outlive the send
            else:
                work.wait()

        # Phase 2: the data, into buffers allocated from the headers.
        out, ops = [], []
        for (src, tag), header in zip(recvs, headers_in):
            dtype, requires_grad, shape = decode_header(header)
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            if buf.numel():
                ops.append(dist.P2POp(dist.irecv, buf, group=self.pg, group_peer=src.group_rank, tag=2 * tag + 1))
            out.append((buf, requires_grad))
        for work in self._post(ops):
            work.wait()
        return [buf.requires_grad_(rg) if buf.is_floating_point() or buf.is_complex() else buf
                for buf, rg in out]

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
