"""The stand-in for a GPU and its NCCL world: the ``meta`` device and torch's ``fake`` backend.

A rehearsed rank must take every branch a GPU rank takes, in one CPU process, at the config's
real model shape and world size. Tensors therefore live on ``meta`` (shapes, dtypes and
storages, no data: a 70B model's shard costs no memory) and every collective goes through the
``fake`` process-group backend (``FakeStore``: any world size in one process; the backend string
``"cpu:fake,meta:fake"`` is what lets ``batch_isend_irecv`` take meta tensors). The meta device
is registered with ``nanotrain.parallel.accelerator`` as an asynchronous device whose group
backend is ``fake``, so the code takes its CUDA branches there: fused AdamW and its state
placement, pinned buffers and side streams in the batch prefetcher and the async checkpoint
copies, device events in the step timers, the stop vote's device tensors, collectives on the
device. What cannot run is stubbed, and ``STUBS`` says what (the report lists it):
"""

from __future__ import annotations

import contextlib
import warnings

import torch
import torch.distributed as dist

from nanotrain.parallel import accelerator

DEVICE = torch.device("meta")

STUBS = (
    "kernels: every op computes shapes only (the meta device); values are never computed",
    "the model is built on the device directly (a GPU rank builds it on the host and moves it; "
    "the parameters and what they record are the same), and its initialisation draws nothing",
    "device-to-host copies give zeros, item()/bool() of a device tensor 0/False: the run goes on "
    "(each such read is still counted as a host sync)",
    "the other ranks: a world of copies of this one (the checkpoint protocol's answers and the "
    "data build's meeting are this rank's own; it plays rank 0's part of the commit; the load does "
    "not check that some rank takes every saved parameter, which needs the other ranks' answers)",
    "MoE routing: the meta device holds no logits to route by, so every expert gets an equal share "
    "of the tokens (tokens x top_k / experts; bincount's length is its minlength), and each ep rank "
    "sends its experts the same counts",
    "NCCL: torch's fake process-group backend (every collective and P2P returns at once; received "
    "buffers hold no data)",
    "CUDA streams and events: no-ops (ordering is not checked; every wait returns at once)",
    "pinned host memory: pageable buffers (the copies still go the non-blocking way)",
    "fused AdamW's device check accepts the meta device (the fused kernel's meta version runs)",
    "attention: flash (bf16/fp16, no mask) or memory-efficient attention's meta kernels, as SDPA "
    "picks on a GPU; context parallelism's causal_lower_right mask becomes a marker that runs the "
    "memory-efficient kernel's lower-right causal variant, as CausalBias does on a GPU",
    "autocast: CUDA's op lists emulated above autograd (torch has no autocast for meta); recomputed "
    "regions (training.recompute) replay it (nanotrain.parallel.part.recompute)",
)


class _Stream:
    """A CUDA stream's interface, doing nothing (the meta device runs nothing)."""

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return event or _Event()


class _Event:
    def __init__(self, enable_timing: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream=None) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


# CUDA autocast's op lists (torch's "Autocast Op Reference"): run in the lower precision, or in
# fp32, whatever the inputs. Ops not listed run in their inputs' (promoted) type, as on CUDA.
F = torch.nn.functional
aten = torch.ops.aten
_LOWER = {
    F.linear,
    torch.matmul,
    torch.Tensor.matmul,
    torch.Tensor.__matmul__,
    torch.mm,
    torch.Tensor.mm,
    torch.bmm,
    torch.Tensor.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.addbmm,
    torch.mv,
    F.scaled_dot_product_attention,
}
_FP32 = {
    F.softmax,
    F.log_softmax,
    torch.softmax,
    torch.log_softmax,
    torch.Tensor.softmax,
    torch.Tensor.log_softmax,
    F.cross_entropy,
    F.nll_loss,
    torch.rsqrt,
    torch.Tensor.rsqrt,
    torch.pow,
    torch.Tensor.pow,
    torch.Tensor.__pow__,
    torch.exp,
    torch.Tensor.exp,
    torch.log,
    torch.Tensor.log,
    torch.sum,
    torch.Tensor.sum,
    torch.cumsum,
    torch.Tensor.cumsum,
    F.layer_norm,
    F.normalize,
    F.mse_loss,
    torch.norm,
    torch.Tensor.norm,
    F.softplus,
    torch.reciprocal,
    torch.Tensor.reciprocal,
}


class Autocast(torch.overrides.TorchFunctionMode):
    """CUDA's autocast, emulated above autograd for the meta device (torch has none for it): the
    listed ops cast their floating inputs (a leaf parameter once per region, as autocast's
    cache does) and autograd records the casts, so activations, saved tensors and messages
    have the dtypes and bytes they have on a GPU. Installed for the whole rehearsal; regions
    are opened and closed by ``MetaAccelerator.autocast``."""

    def __init__(self):
        super().__init__()
        self.regions: list = []  # dtype (None: disabled) of each open region
        self.caching: list[bool] = []  # whether each open region caches its parameters' casts
        self.cache: dict[int, torch.Tensor] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        dtype = self.regions[-1] if self.regions else None
        if dtype is not None and (func in _LOWER or func in _FP32):
            to = dtype if func in _LOWER else torch.float32
            args = tuple(self._cast(a, to) for a in args)
            kwargs = {k: self._cast(v, to) for k, v in kwargs.items()}
        if func is F.scaled_dot_product_attention and args and args[0].device == DEVICE:
            return fused_attention(*args, **kwargs)
        return func(*args, **kwargs)

    def _cast(self, value, dtype):
        if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dtype != dtype):
            return value
        if value.is_leaf and value.requires_grad and torch.is_grad_enabled() and self.caching[-1]:
            cast = self.cache.get(id(value))
            if cast is None:
                cast = self.cache[id(value)] = value.to(dtype)
            return cast
        return value.to(dtype)

    @contextlib.contextmanager
    def region(self, dtype, enabled: bool, cache_enabled: bool = True):
        """An autocast region; it also enters this mode where it is not active (a region replayed
        by a recomputation in backward, where torch's checkpoint runs without the forward's
        function modes). ``cache_enabled`` False: parameters are cast anew at each use inside."""
        with contextlib.ExitStack() as stack:
            if self not in torch.overrides._get_current_function_mode_stack():
                stack.enter_context(self)
            self.regions.append(dtype if enabled else None)
            self.caching.append(cache_enabled)
            try:
                yield
            finally:
                self.regions.pop()
                self.caching.pop()
                if not any(r is not None for r in self.regions):
                    self.cache.clear()


class LowerRight:
    """Stands in for ``torch.nn.attention.bias.causal_lower_right(q_len, kv_len)`` (context
    parallelism's mask), which cannot be built under the rehearsal's dispatch mode; SDPA given
    it runs the memory-efficient kernel's lower-right causal variant, as CausalBias does on a GPU."""

    def __init__(self, q_len: int, kv_len: int):
        self.q_len, self.kv_len = q_len, kv_len


def fused_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The attention kernel SDPA picks on a GPU, not its math fallback (which the meta device
    would run, materialising the attention matrix): flash attention for bf16/fp16 without a
    mask (it takes grouped k/v heads as they are), else the memory-efficient kernel. Both save
    only their inputs, output and log-sum-exp for backward, as on a GPU. A mask object such as
    ``CausalBias`` (context parallelism) keeps torch's own dispatch."""
    if attn_mask is None and dropout_p == 0.0 and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256:
        return aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal, False, scale=scale)[0]
    if k.shape[-3] != q.shape[-3]:  # the memory-efficient kernel needs every head's k and v
        k = k.repeat_interleave(q.shape[-3] // k.shape[-3], dim=-3)
        v = v.repeat_interleave(q.shape[-3] // v.shape[-3], dim=-3)
    if isinstance(attn_mask, LowerRight):  # [B, S, H, D] in and out; custom_mask_type 2: lower right
        out = aten._efficient_attention_forward(
            q.transpose(1, 2),
            k.transpose(1, 2),
            v.transpose(1, 2),
            None,
            None,
            None,
            None,
            None,
            dropout_p,
            2,
            True,
            scale=scale,
        )[0]
        return out.transpose(1, 2)
    if attn_mask is not None and not isinstance(attn_mask, torch.Tensor):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale)[0]


class MetaAccelerator:
    """``accelerator.Cuda``'s interface for the meta device, and an emulated CUDA autocast."""

    type = "meta"
    backends = ("fake",)

    def __init__(self):
        self.autocasting = Autocast()

    def autocast(self, dtype=None, enabled: bool = True, cache_enabled: bool = True):
        return self.autocasting.region(dtype or torch.bfloat16, enabled, cache_enabled)

    def autocast_dtype(self):
        return self.autocasting.regions[-1] if self.autocasting.regions else None

    @staticmethod
    def current_device() -> torch.device:
        return DEVICE

    @staticmethod
    def Stream(device=None):  # noqa: N802
        return _Stream()

    @staticmethod
    def current_stream(device=None):
        return _Stream()

    @staticmethod
    def use_stream(stream):
        return contextlib.nullcontext()

    @staticmethod
    def Event(enable_timing: bool = False):  # noqa: N802
        return _Event(enable_timing)

    @staticmethod
    def pinned_empty(shape, dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype)

    @staticmethod
    def pin(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def record_stream(t: torch.Tensor, stream) -> None:
        pass

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return 0  # the rehearsal's own tracker measures (tracker.py)

    @staticmethod
    def device_name(device=None) -> str:
        return "rehearsal (meta)"


def _to_copy(x, *, dtype=None, layout=None, device=None, pin_memory=None, non_blocking=False, memory_format=None):
    to = torch.device(device) if device is not None else x.device
    dtype = dtype or x.dtype
    if to.type == "meta":
        return torch.empty(x.shape, dtype=dtype, device=DEVICE)
    return torch.zeros(x.shape, dtype=dtype, device=to)


def _copy_(self, src, non_blocking=False):
    return self if self.device.type == "meta" else self.zero_()


def _local_scalar_dense(x):
    return False if x.dtype == torch.bool else 0


def _bincount(x, weights=None, minlength=0):
    # The length is data-dependent (max(x) + 1, at least minlength): the rehearsal assumes minlength.
    return torch.zeros(minlength, dtype=torch.int64 if weights is None else weights.dtype, device=DEVICE)


@contextlib.contextmanager
def kernel_stubs():
    """Meta kernels that let values leave the device (as zeros) instead of raising; registered
    for every thread (checkpoint writers copy on threads of their own)."""
    lib = torch.library.Library("aten", "IMPL")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "overriding a previously registered kernel": on purpose
        lib.impl("_to_copy", _to_copy, "Meta")
        lib.impl("copy_", _copy_, "Meta")
        lib.impl("_local_scalar_dense", _local_scalar_dense, "Meta")
        lib.impl("bincount", _bincount, "Meta")
    try:
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def fused_adamw_on_meta():
    """torch's fused optimizers refuse devices outside a list; meta joins it for the duration."""
    import torch.optim.optimizer as optimizer_module

    original = optimizer_module._get_fused_kernels_supported_devices

    def supported():
        return [*original(), "meta"]

    optimizer_module._get_fused_kernels_supported_devices = supported
    try:
        yield
    finally:
        optimizer_module._get_fused_kernels_supported_devices = original


@contextlib.contextmanager
def fake_world(world_size: int, rank: int):
    """This process is rank ``rank`` of ``world_size`` on the fake backend, meta as its device."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    acc = MetaAccelerator()
    with accelerator.standing_in(acc), acc.autocasting, kernel_stubs(), fused_adamw_on_meta():
        dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield DEVICE
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
