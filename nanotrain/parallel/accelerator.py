"""Where the code meets an asynchronous device: streams, events, pinned host memory, the
device's own collective backend.

Work on a GPU is queued, not done: a copy from pageable host memory, an ``item()`` or a
``tolist()`` makes the host wait for everything queued before it, so the code that must not
wait (the batch prefetcher, the stop vote, async checkpoint copies, step timers) takes another
branch there: pinned buffers, side streams, events. Every such branch asks this module whether
a device is asynchronous and reaches its streams through it, never ``torch.cuda`` directly, so
that ``submit.py CONFIG --rehearse`` can register a stand-in device (``nanotrain.rehearse``:
the ``meta`` device, whose tensors have shapes and no data) and every branch a GPU rank takes
is taken there too, with only the device runtime itself stubbed.

``of(device)`` is the accelerator of a device (None on the CPU: its work happens at the call);
``of_backend(name)`` the accelerator whose tensors a process-group backend carries (NCCL: CUDA;
gloo carries CPU tensors: None).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist


class Cuda:
    """CUDA through ``torch.cuda``."""

    type = "cuda"
    backends = ("nccl",)

    @staticmethod
    def current_device() -> torch.device:
        return torch.device("cuda", torch.cuda.current_device())

    @staticmethod
    def Stream(device):  # noqa: N802 (a constructor, as torch.cuda.Stream)
        return torch.cuda.Stream(device)

    @staticmethod
    def current_stream(device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def use_stream(stream):
        return torch.cuda.stream(stream)

    @staticmethod
    def Event(enable_timing: bool = False):  # noqa: N802
        return torch.cuda.Event(enable_timing=enable_timing)

    @staticmethod
    def pinned_empty(shape, dtype) -> torch.Tensor:
        """A host buffer the device copies to and from asynchronously (page-locked)."""
        return torch.empty(shape, dtype=dtype, pin_memory=True)

    @staticmethod
    def pin(t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory()

    @staticmethod
    def record_stream(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)

    @staticmethod
    def max_memory_allocated(device) -> int:
        return torch.cuda.max_memory_allocated(device)

    @staticmethod
    def device_name(device) -> str:
        return torch.cuda.get_device_name(device) if torch.cuda.is_available() else ""


_BY_TYPE: dict[str, object] = {"cuda": Cuda()}
_STAND_IN: list = []  # the rehearsal's stand-in accelerator, while one stands in


def stand_in_device():
    """The device of the accelerator standing in for the GPU (the rehearsal), else None: a
    ParallelContext then places the rank there instead of picking a GPU."""
    return _STAND_IN[-1].current_device() if _STAND_IN else None


def autocast(device_type: str, dtype=None, enabled: bool = True, cache_enabled: bool | None = None):
    """``torch.autocast`` for ``device_type``, or the stand-in's emulation of CUDA's (torch has
    no autocast for the rehearsal's meta device). ``cache_enabled`` False: a leaf parameter is
    cast anew at each use inside (None: as the enclosing region, torch's default)."""
    acc = _BY_TYPE.get(device_type)
    if acc is not None and hasattr(acc, "autocast"):
        return acc.autocast(dtype, enabled) if cache_enabled is None else acc.autocast(dtype, enabled, cache_enabled)
    return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)


def emulates_autocast(device_type: str) -> bool:
    """True where autocast is the stand-in's emulation, which torch's own machinery (checkpoint's
    replay of the forward's autocast) does not know."""
    acc = _BY_TYPE.get(device_type)
    return acc is not None and hasattr(acc, "autocast")


def autocast_dtype(device_type: str):
    """The dtype autocast computes matmuls in on ``device_type`` now, or None outside autocast."""
    acc = _BY_TYPE.get(device_type)
    if acc is not None and hasattr(acc, "autocast_dtype"):
        return acc.autocast_dtype()
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` and ``b`` view the same elements of the same storage. Asked of the storage object,
    not of ``data_ptr()``, which is 0 for every tensor of a device without memory (the
    rehearsal's meta device), where all tensors would look alike."""
    return (
        a.untyped_storage()._cdata == b.untyped_storage()._cdata
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def of(device) -> object | None:
    """The accelerator of ``device`` (a ``torch.device`` or its name), None for the CPU and for
    devices nothing registered (a plain ``meta`` tensor in a unit test)."""
    return _BY_TYPE.get(torch.device(device).type)


def of_backend(backend) -> object | None:
    """The accelerator whose tensors the process-group backend ``backend`` (its name, e.g.
    ``"nccl"`` or ``"cpu:gloo,cuda:nccl"``) carries, or None when it carries CPU tensors."""
    name = str(backend)
    for acc in _BY_TYPE.values():
        if any(b in name for b in acc.backends):
            return acc
    return None


def comm_device(group) -> torch.device:
    """The device whose tensors a collective over ``group`` (an initialised process group) takes:
    the current accelerator device when its backend has no CPU path (NCCL), else the CPU."""
    acc = of_backend(dist.get_backend(group))
    return acc.current_device() if acc is not None else torch.device("cpu")


@contextlib.contextmanager
def standing_in(acc):
    """Register ``acc`` (an object with ``Cuda``'s methods, ``type`` and ``backends``) for the
    duration: the rehearsal's stand-in device. Not for production code."""
    before = _BY_TYPE.get(acc.type)
    _BY_TYPE[acc.type] = acc
    _STAND_IN.append(acc)
    try:
        yield acc
    finally:
        _STAND_IN.pop()
        if before is None:
            _BY_TYPE.pop(acc.type, None)
        else:
            _BY_TYPE[acc.type] = before
