"""What a rehearsed rank does with its device, seen at the dispatcher: every op, every tensor.

``DeviceTracker`` is a ``TorchDispatchMode`` on the rank's thread. For each op it checks and
records:

* placement: an op that mixes device tensors with host tensors (a host tensor of more than one
  element, or any host tensor in a fused/foreach kernel, which reads every tensor through device
  pointers: the way a CPU ``step`` crashes fused AdamW on CUDA) is a defect, named with the
  line of nanotrain that called it;
* host syncs: a read of a device value on the host (``item``, ``bool``, ``int``, ``tolist``, a
  copy to the host that is not ``non_blocking``) and a blocking copy from host memory to the
  device (``torch.tensor(data, device=...)`` included, which the dispatcher never shows: see
  ``watch_tensor_factories``), counted per call site and per step window;
* memory: every storage an op allocates on the device is counted, live, under the category the
  rehearsal names for what is running (``phase``), until it is freed. The categories are
  relabelled by identity where identity is known (parameters are weights, ``.grad`` views are
  gradients), and the peak keeps the breakdown at its moment; a storage resized in place (ZeRO-3's
  gathers and releases, ``watch_storage_resizes``) is counted at its new size. Nothing of the
  memory estimate's arithmetic is used: these are the bytes the code really allocates.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections import Counter, defaultdict

import torch
from torch.utils._python_dispatch import TorchDispatchMode

CATEGORIES = ("weights", "grads", "optimizer", "activations", "comm", "other")
aten = torch.ops.aten
_COPIES = {aten._to_copy.default, aten.copy_.default}
_READS = {aten._local_scalar_dense.default}
# Their output shape depends on values: on a GPU the host waits to learn it.
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten.unique_dim.default,
    aten._unique2.default,
    aten.repeat_interleave.Tensor,
    aten.bincount.default,
}
_SKIP_FRAMES = ("nanotrain/rehearse/", "nanotrain/parallel/collectives.py", "torch/", "contextlib.py", "threading.py")


def call_site(extra_skip: tuple[str, ...] = ()) -> str:
    """``module.py:line (function)`` of the innermost nanotrain frame outside the rehearsal."""
    frame = sys._getframe(1)
    fallback = None
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        if "nanotrain/" in path and not any(s in path for s in _SKIP_FRAMES + extra_skip):
            short = path[path.rindex("nanotrain/") :]
            return f"{short}:{frame.f_lineno} ({frame.f_code.co_name})"
        if fallback is None and "nanotrain/rehearse/" not in path and "/torch/" not in path:
            fallback = f"{path}:{frame.f_lineno} ({frame.f_code.co_name})"
        frame = frame.f_back
    return fallback or "?"


class DeviceTracker(TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device
        self.label = "other"
        self.window = "build"  # which part of the rehearsal ops belong to ("step 2", "save", ...)
        self.placement: dict[str, str] = {}  # call site -> first description
        self.syncs: dict[str, Counter] = defaultdict(Counter)  # window -> {(kind, site): count}
        self.async_copies: list[str] = []  # "src -> dst" of each non-blocking host/device copy
        self.live = dict.fromkeys(CATEGORIES, 0)
        self.peak_total, self.peak = 0, dict(self.live)
        self.max_by_category = dict(self.live)
        self._storages: dict[int, list] = {}  # storage key -> [bytes, category]
        self._paused = False

    # ------------------------------------------------------------------ labels
    @contextlib.contextmanager
    def phase(self, label: str):
        """Allocations inside are counted as ``label`` (one of CATEGORIES)."""
        before, self.label = self.label, label
        try:
            yield
        finally:
            self.label = before

    @contextlib.contextmanager
    def uncounted(self):
        """Allocations inside are not memory: a model's meta skeleton, which a run builds on the
        meta device too (no storage there), while the rehearsal's device is meta itself."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def relabel(self, tensors, category: str) -> None:
        """The storages of ``tensors`` hold ``category`` (parameters, gradients, states)."""
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device == self.device:
                entry = self._storages.get(self._key(t))
                if entry is not None and entry[1] != category:
                    self.live[entry[1]] -= entry[0]
                    entry[1] = category
                    self.live[category] += entry[0]

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _tensors(args) + _tensors(kwargs.values())
        if func in _READS:
            self._sync("device value read on the host (item/bool/int)")
        elif func in _COPIES:
            self._check_copy(func, args, kwargs)
        elif func in _DATA_DEPENDENT and any(t.device == self.device for t in flat):
            self._sync(f"data-dependent shape ({func.__name__})")
        else:
            self._check_placement(func, flat)
        out = func(*args, **kwargs)
        self._count(out)
        return out

    def _check_copy(self, func, args, kwargs) -> None:
        if func is aten._to_copy.default:
            src, dst = args[0].device, torch.device(kwargs.get("device") or args[0].device)
        else:
            src, dst = args[1].device, args[0].device
        blocking = not kwargs.get("non_blocking", False) and not (len(args) > 2 and args[2])
        if (src == self.device and dst.type == "cpu") or (src.type == "cpu" and dst == self.device):
            if not blocking:
                self.async_copies.append(f"{src.type} -> {dst.type}")
            elif src == self.device:
                self._sync("device-to-host copy (tolist/.cpu()/.to('cpu'))")
            else:
                self._sync("blocking host-to-device copy")

    def _check_placement(self, func, flat: list[torch.Tensor]) -> None:
        on_device = any(t.device == self.device for t in flat)
        if not on_device:
            return
        strict = func.__name__.startswith(("_fused_", "_foreach_"))
        host = [t for t in flat if t.device.type == "cpu" and (strict or t.numel() > 1)]
        if host:
            site = call_site()
            self.placement.setdefault(
                site,
                f"{func.__name__} got a host tensor {tuple(host[0].shape)} "
                f"{host[0].dtype} beside tensors on the device",
            )

    def _sync(self, kind: str) -> None:
        self.syncs[self.window][(kind, call_site())] += 1

    # ------------------------------------------------------------------ memory
    @staticmethod
    def _key(t: torch.Tensor) -> int:
        return t.untyped_storage()._cdata

    def _count(self, out) -> None:
        if self._paused:
            return
        for t in _tensors([out]):
            if t.device != self.device:
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self._storages:
                continue
            entry = [storage.nbytes(), self.label]
            self._storages[key] = entry
            weakref.finalize(storage, self._free, key)
            self.live[entry[1]] += entry[0]
            self._note_peak(entry[1])

    def _note_peak(self, category: str) -> None:
        total = sum(self.live.values())
        if total > self.peak_total:
            self.peak_total, self.peak = total, dict(self.live)
        if self.live[category] > self.max_by_category[category]:
            self.max_by_category[category] = self.live[category]

    def resized(self, storage) -> None:
        """A counted storage changed size in place (ZeRO-3 frees a gathered bucket's storage and
        allocates it again, ``shard_params.py``: ``UntypedStorage.resize_``, below the dispatcher)."""
        entry = self._storages.get(storage._cdata)
        if entry is not None and not self._paused:
            self.live[entry[1]] += storage.nbytes() - entry[0]
            entry[0] = storage.nbytes()
            self._note_peak(entry[1])

    def _free(self, key: int) -> None:
        entry = self._storages.pop(key, None)
        if entry is not None:
            self.live[entry[1]] -= entry[0]

    def track(self, tensors, category: str) -> None:
        """Count tensors made outside the mode (before it was entered) under ``category``."""
        with self.phase(category):
            self._count(list(tensors))


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [x for x in v if isinstance(x, torch.Tensor)]
    return out


@contextlib.contextmanager
def watch_tensor_factories(tracker: DeviceTracker):
    """``torch.tensor(data, device=...)`` and ``torch.as_tensor`` copy host data to the device
    inside the factory (pageable memory, blocking on CUDA), below the dispatcher: record them."""
    originals = torch.tensor, torch.as_tensor

    def wrap(fn):
        def factory(data, *args, **kwargs):
            device = kwargs.get("device")
            if device is not None and torch.device(device) == tracker.device and not isinstance(data, torch.Tensor):
                tracker._sync(f"blocking host-to-device copy ({fn.__name__}(data, device=...))")
            return fn(data, *args, **kwargs)

        return factory

    torch.tensor, torch.as_tensor = wrap(originals[0]), wrap(originals[1])
    try:
        yield
    finally:
        torch.tensor, torch.as_tensor = originals


@contextlib.contextmanager
def watch_storage_resizes(tracker: DeviceTracker):
    """``UntypedStorage.resize_`` frees or allocates a storage's bytes without an op the
    dispatcher sees: tell ``tracker`` (ZeRO-3's gathers and releases are such resizes)."""
    original = torch.UntypedStorage.resize_

    def resize_(storage, size):
        out = original(storage, size)
        if storage.device == tracker.device:
            tracker.resized(storage)
        return out

    torch.UntypedStorage.resize_ = resize_
    try:
        yield
    finally:
        torch.UntypedStorage.resize_ = original
