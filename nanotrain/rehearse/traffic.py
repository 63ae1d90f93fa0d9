"""Every collective a rehearsed rank calls: its contract with NCCL, and the bytes it moves.

``Traffic.install()`` wraps torch.distributed's collectives in this process (the rehearsal's
own: the fake backend answers them) and checks what NCCL needs and the fake backend forgives:
every tensor on the rank's device (the fake backend, like gloo, takes host tensors silently),
contiguous, of a dtype NCCL has, and no ``*_object`` collective (they pickle, and on NCCL move
their bytes through the device with host syncs). A violation is a defect named with its call
site. Each call is counted by process group (named after the ParallelContext's attributes:
``tp``, ``pp``, ``dp_cp``, ...), collective and dtype, in the bytes one rank sends under ring
algorithms — the convention of ``--plan``'s cost model:

  all_reduce 2(n-1)/n x the tensor; reduce_scatter (n-1)/n x the input; all_gather (n-1)/n x the
  output; broadcast and gather the tensor (non-root ranks of a gather; the root sends nothing);
  all_to_all what goes to other ranks; send/recv the bytes sent.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict

import torch
import torch.distributed as dist

from nanotrain.rehearse.tracker import call_site

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
OBJECT_COLLECTIVES = (
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


# collective -> (the tensors it reads or writes on the device, bytes this rank sends)
_SPECS = {
    "all_reduce": (lambda a, k: [a[0]], lambda a, k, n: 2 * (n - 1) / n * _nbytes(a[0])),
    "all_gather_into_tensor": (lambda a, k: [a[0], a[1]], lambda a, k, n: (n - 1) / n * _nbytes(a[0])),
    "all_gather_single": (lambda a, k: [a[0], a[1]], lambda a, k, n: (n - 1) / n * _nbytes(a[0])),
    "reduce_scatter_tensor": (lambda a, k: [a[0], a[1]], lambda a, k, n: (n - 1) / n * _nbytes(a[1])),
    "reduce_scatter_single": (lambda a, k: [a[0], a[1]], lambda a, k, n: (n - 1) / n * _nbytes(a[1])),
    "all_gather": (lambda a, k: [*a[0], a[1]], lambda a, k, n: (n - 1) * _nbytes(a[1])),
    "broadcast": (lambda a, k: [a[0]], lambda a, k, n: _nbytes(a[0])),
    "gather": (lambda a, k: [a[0], *(a[1] or [])], lambda a, k, n: 0 if a[1] else _nbytes(a[0])),
    "reduce": (lambda a, k: [a[0]], lambda a, k, n: _nbytes(a[0])),
    "all_to_all_single": (lambda a, k: [a[0], a[1]], lambda a, k, n: _all_to_all_bytes(a, k, n)),
}


def _all_to_all_bytes(args, kwargs, n: int) -> float:
    inp = args[1]
    splits = args[3] if len(args) > 3 else kwargs.get("input_split_sizes")
    row = _nbytes(inp) / max(1, inp.shape[0]) if inp.dim() else 0
    if not splits:
        return (n - 1) / n * _nbytes(inp)
    me = dist.get_rank(kwargs.get("group"))
    return row * sum(s for r, s in enumerate(splits) if r != me)


class Traffic:
    def __init__(self, device: torch.device, on_call=None):
        self.device = device
        self.on_call = on_call  # () -> a context manager around each collective (the tracker's phase)
        self.window = "build"
        self.names: dict[int, str] = {}
        self.bytes: dict[str, dict[tuple, float]] = defaultdict(lambda: defaultdict(float))
        self.calls: dict[str, dict[tuple, int]] = defaultdict(lambda: defaultdict(int))
        self.defects: dict[str, str] = {}
        self._originals: dict[str, object] = {}

    def name_groups(self, pc) -> None:
        """Name each process group after the ParallelContext attributes that hold it."""
        names: dict[int, list[str]] = defaultdict(list)
        for attr, value in vars(pc).items():
            if attr.endswith("_pg") and isinstance(value, dist.ProcessGroup):
                names[id(value)].append(attr[:-3])
        order = ("tp", "cp", "pp", "ep", "dp", "dp_cp", "dp_cp_ep", "mp", "embedding", "world")
        rank = {name: i for i, name in enumerate(order)}
        self.names = {key: "|".join(sorted(v, key=lambda n: (rank.get(n, len(order)), n))) for key, v in names.items()}

    def _group_name(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return self.names.get(id(dist.GroupMember.WORLD), "default")
        return self.names.get(id(group), f"group of {_size(group)}")

    def _check(self, name: str, tensors) -> None:
        for t in tensors:
            problem = None
            if t.device != self.device:
                problem = f"{name} got a tensor on {t.device}, the rank's device is {self.device}"
            elif not t.is_contiguous():
                problem = f"{name} got a non-contiguous tensor {tuple(t.shape)}"
            elif t.dtype not in NCCL_DTYPES:
                problem = f"{name} got dtype {t.dtype}, which NCCL does not have"
            if problem:
                self.defects.setdefault(call_site(), problem)

    def _record(self, name: str, group, sent: float, dtype) -> None:
        key = (self._group_name(group), name, str(dtype).replace("torch.", ""))
        self.bytes[self.window][key] += sent
        self.calls[self.window][key] += 1

    def install(self) -> "Traffic":
        for name, (tensors_of, sent) in _SPECS.items():
            if hasattr(dist, name):
                self._wrap(name, tensors_of, sent)
        for name in OBJECT_COLLECTIVES:
            if hasattr(dist, name):
                self._refuse(name)
        batch = dist.batch_isend_irecv
        self._originals["batch_isend_irecv"] = batch

        def checked_batch(ops):
            self._check("batch_isend_irecv", [op.tensor for op in ops])
            for op in ops:
                if op.op in (dist.isend, dist.send):
                    self._record("send", op.group, _nbytes(op.tensor), op.tensor.dtype)
            return batch(ops)

        dist.batch_isend_irecv = checked_batch
        return self

    def _wrap(self, name, tensors_of, sent) -> None:
        fn = getattr(dist, name)
        self._originals[name] = fn

        def wrapped(*args, **kwargs):
            tensors = [t for t in tensors_of(args, kwargs) if isinstance(t, torch.Tensor)]
            self._check(name, tensors)
            group = kwargs.get("group")  # nanotrain.parallel.collectives passes it by keyword
            n = _size(group)
            if n > 1 and tensors:
                self._record(_canonical(name), group, sent(args, kwargs, n), tensors[0].dtype)
            with self.on_call() if self.on_call else contextlib.nullcontext():
                return fn(*args, **kwargs)

        setattr(dist, name, wrapped)

    def _refuse(self, name) -> None:
        fn = getattr(dist, name)
        self._originals[name] = fn

        def refused(*args, **kwargs):
            self.defects.setdefault(call_site(), f"{name} is an object collective (pickles; host syncs on NCCL)")
            return fn(*args, **kwargs)

        setattr(dist, name, refused)

    def uninstall(self) -> None:
        for name, fn in self._originals.items():
            setattr(dist, name, fn)
        self._originals.clear()


def _canonical(name: str) -> str:
    return {
        "all_gather_into_tensor": "all_gather",
        "all_gather_single": "all_gather",
        "reduce_scatter_tensor": "reduce_scatter",
        "reduce_scatter_single": "reduce_scatter",
    }.get(name, name)
