"""ZeRO-3: the parameters sharded too, each layer gathered just before it computes and let go after.

At ``optimizer.zero_stage: 3`` a rank keeps, of every parameter, only the piece it owns (the
ZeRO-1 partition: rank r owns piece r of every padded bucket, ``buckets.py``) plus the optimizer
state and the accumulated gradient of that piece (ZeRO-2, ``shard_grads.py``). The buckets are cut
at *unit* boundaries: one unit per decoder layer, one for the embedding, one for the final norm
and LM head (``unit_of_name``), so a unit's full weights are the all-gather of its own buckets.

``ShardedStore`` (one per ZeRO domain: dense parameters, and expert shards under ep) holds a full
buffer per bucket, each with its own storage, and every parameter's ``.data`` is a view into one
of them for good: names, shapes and autograd's references never change. *Releasing* a bucket
resizes its storage to 0 bytes (the views keep their shape; reading one raises); *gathering*
resizes it back and all-gathers every rank's piece into it, in place (FSDP1's storage trick).

``ParamGather`` drives the units through a step (``ModelPart`` calls it around the embedding and
the head, and hooks it on every decoder layer):

  forward of unit i    wait for its gather (posted earlier), post the gather of the next unit of
                       the same pipeline chunk, compute, release it (under grad: hook its outputs);
  backward of unit i   (a hook on its outputs, before its backward runs) gather it again, post the
                       previous unit's gather; once every parameter of the unit has its gradient
                       (their post-accumulate hooks) release it;
  end of each round    (a backward of one micro-batch / pipeline chunk) release whatever a backward
                       gathered and did not release (a unit whose parameters got no gradient).

Two call sites say more (``after_forward``): the embedding's backward reads no weights, so it is
neither gathered nor prefetched for it; the head stays gathered into its backward, which follows
at once (it produces the loss), saving one gather per micro-batch.

So at most two layers' full weights are alive at a time (the one computing and the one being
fetched), and with pipeline parallelism every micro-batch gathers each unit twice, forward and
backward: m micro-batches move 2m times the unit bytes per step instead of keeping the stage's
weights for the whole step (which is what ZeRO-2 holds). Every rank of a group runs the same
schedule, so every rank posts the same gathers in the same order. ``log`` records the posts,
waits and releases (tests, profiling).

Anything that reads or writes the weights outside a forward (checkpoints, Hugging Face import)
goes through ``full_parameters`` (all units gathered; written back to the owned pieces after a
load) or ``ParamGather.host_copies`` (one unit at a time, to host memory).
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Optional

import torch
from torch import nn

from nanotrain.parallel.collectives import all_gather_into, wait
from nanotrain.parallel.observe.hang_record import HANG_RECORD

_GATHER = "_nanotrain_param_gather"  # on each parameter: a weak reference to its ParamGather


def unit_of_name(name: str) -> str:
    """The gather unit of parameter ``name``: ``layers.N`` for a decoder layer's, ``embed`` for
    the embedding's, ``head`` for the rest (final norm, LM head)."""
    parts = name.split(".")
    if parts[0] == "layers" and len(parts) > 2:
        return f"layers.{parts[1]}"
    return "embed" if parts[0] == "embed" else "head"


def _unit_rank(unit: str) -> tuple[int, int]:
    if unit == "embed":
        return (0, 0)
    if unit.startswith("layers."):
        return (1, int(unit.split(".", 1)[1]))
    return (2, 0)


def forward_order(units: Iterable[str]) -> list[str]:
    """Units in the order a forward runs them: embedding, layers by index, head."""
    return sorted(set(units), key=_unit_rank)


def param_gather_of(p: nn.Parameter) -> Optional["ParamGather"]:
    ref = getattr(p, _GATHER, None)
    return ref() if ref is not None else None


class ShardedStore:
    """One domain's parameters at ZeRO-3 (module doc): ``params`` moved into per-bucket full
    buffers (``layout``: positions in ``params`` per bucket, ``lengths`` multiples of ``size``),
    of which only this rank's pieces persist, in ``shard``. Over a group of two ranks or more (a
    group of one keeps its parameters whole: ``ZeroOneOptimizer._domain``)."""

    def __init__(self, params: list[nn.Parameter], layout, lengths, group, size: int, rank: int, gather_dtype=None):
        self.group, self.size, self.rank = group, size, rank
        ref = params[0]
        # The compute dtype (bf16 under autocast) when lower than the parameters': a copy of the
        # owned pieces in it, refreshed after each update, is what training's gathers send
        # (``gather``); checkpoints and loads gather the exact pieces.
        lower = gather_dtype is not None and torch.finfo(gather_dtype).bits < torch.finfo(ref.dtype).bits
        self.gather_dtype = gather_dtype if lower else None
        self.low: Optional[torch.Tensor] = None
        self.landing: dict[int, torch.Tensor] = {}  # bucket -> its gather in the compute dtype
        self.gathered_bytes = 0  # received by gathers (tests, profiling)
        self.lengths = list(lengths)
        self.layout = [list(bucket) for bucket in layout]
        self.full: list[torch.Tensor] = []
        self.piece_start: list[int] = []
        self.where: dict[int, tuple[int, int]] = {}  # position in params -> (bucket, offset)
        self.shard = torch.zeros(sum(n // size for n in lengths), dtype=ref.dtype, device=ref.device)
        start = 0
        with torch.no_grad():
            for k, (bucket, length) in enumerate(zip(layout, lengths)):
                full = torch.zeros(length, dtype=ref.dtype, device=ref.device)
                off = 0
                for j in bucket:
                    p = params[j]
                    view = full[off : off + p.numel()].view_as(p)
                    view.copy_(p)
                    p.data = view
                    self.where[j] = (k, off)
                    off += p.numel()
                chunk = length // size
                self.shard[start : start + chunk].copy_(full[rank * chunk : (rank + 1) * chunk])
                self.piece_start.append(start)
                self.full.append(full)
                start += chunk
        for k in range(len(self.full)):
            self.release(k)
        self.refresh()

    def refresh(self) -> None:
        """The compute-dtype copy of the owned pieces after they changed (an update, a load)."""
        if self.gather_dtype is not None:
            self.low = self.shard.to(self.gather_dtype)

    def _span(self, k: int) -> slice:
        """Where this rank's piece of bucket ``k`` lies in ``shard`` (and ``low``)."""
        return slice(self.piece_start[k], self.piece_start[k] + self.lengths[k] // self.size)

    def piece(self, k: int) -> torch.Tensor:
        """This rank's piece of bucket ``k`` (persistent)."""
        return self.shard[self._span(k)]

    def owned(self, j: int, start: int, stop: int) -> torch.Tensor:
        """The persistent view of elements [start, stop) of parameter ``j`` (this rank owns them)."""
        k, off = self.where[j]
        at = self.piece_start[k] + off + start - self.rank * (self.lengths[k] // self.size)
        return self.shard[at : at + stop - start]

    def alive(self, k: int) -> bool:
        return self.full[k].untyped_storage().nbytes() > 0

    def nbytes(self, k: int) -> int:
        return self.lengths[k] * self.full[k].element_size()

    def gather(self, k: int, what: str, exact: bool = False):
        """Allocate bucket ``k``'s full buffer and post the all-gather of the pieces into it: in
        the compute dtype (into a landing buffer, ``land`` copies it over) unless ``exact``."""
        full = self.full[k]
        full.untyped_storage().resize_(self.nbytes(k))
        HANG_RECORD.entering(f"all_gather parameters of {what}", self.group)
        if self.low is not None and not exact:
            wire = self.landing[k] = torch.empty(self.lengths[k], dtype=self.gather_dtype, device=full.device)
            self.gathered_bytes += wire.numel() * wire.element_size()
            return all_gather_into(wire, self.low[self._span(k)], group=self.group, async_op=True)
        self.gathered_bytes += self.nbytes(k)
        return all_gather_into(full, self.piece(k), group=self.group, async_op=True)

    def land(self, k: int) -> None:
        """After bucket ``k``'s gather completed: a compute-dtype gather into the full buffer."""
        wire = self.landing.pop(k, None)
        if wire is not None:
            with torch.no_grad():
                self.full[k].copy_(wire)

    def release(self, k: int) -> None:
        self.landing.pop(k, None)
        self.full[k].untyped_storage().resize_(0)

    def write_back(self, k: int) -> None:
        """Copy this rank's piece of the (gathered, then changed) full buffer into ``shard``."""
        chunk = self.lengths[k] // self.size
        with torch.no_grad():
            self.piece(k).copy_(self.full[k][self.rank * chunk : (self.rank + 1) * chunk])
            if self.low is not None:
                self.low[self._span(k)].copy_(self.piece(k))


@dataclass
class Unit:
    """One gather unit: its buckets in the domains' stores, its parameters, where it is."""

    name: str
    buckets: list[tuple[ShardedStore, int]]
    params: list[nn.Parameter]
    state: str = "released"  # released | posted | gathered
    handles: list = field(default_factory=list)
    backward: bool = False  # gathered for a backward: released when its gradients are in
    waiting: set[int] = field(default_factory=set)  # id() of params whose gradient has not come


class ParamGather:
    """The units of one rank's model and their gathers through a step (module doc).

    ``units``: unit name -> [(store, bucket index)] (every bucket of the unit, in any domain);
    ``params``: unit name -> its parameters. ``next_of`` / ``previous_of`` (set by the model,
    ``set_chunks``): the unit whose gather to post while a unit computes, forward / backward."""

    def __init__(self, units: dict[str, list[tuple[ShardedStore, int]]], params: dict[str, list[nn.Parameter]]):
        self.units = {n: Unit(n, units[n], params[n]) for n in forward_order(units)}
        self.unit_of: dict[int, Unit] = {id(p): u for u in self.units.values() for p in u.params}
        self.next_of: dict[str, Optional[str]] = {}
        self.previous_of: dict[str, Optional[str]] = {}
        self.set_chunks([list(self.units)])
        self.weightless_backward: set[str] = set()  # units whose backward reads no weights (embedding)
        # (event, unit, phase): "post" | "wait" | "release"; phase "forward" | "backward" | "state"
        self.log: list[tuple[str, str, str]] = []
        ref = weakref.ref(self)
        self._hooks = [
            p.register_post_accumulate_grad_hook(lambda p, ref=ref: ref()._on_grad(p))
            for u in self.units.values()
            for p in u.params
        ]
        for u in self.units.values():
            for p in u.params:
                setattr(p, _GATHER, ref)

    def set_chunks(self, chunks: list[list[str]]) -> None:
        """Each pipeline chunk's units in forward order: prefetches stay within a chunk."""
        self.next_of, self.previous_of = {}, {}
        for names in chunks:
            names = [n for n in forward_order(names) if n in self.units]
            for a, b in zip(names, names[1:]):
                self.next_of[a], self.previous_of[b] = b, a

    def units_of(self, params: Iterable[nn.Parameter]) -> list[str]:
        return forward_order(self.unit_of[id(p)].name for p in params if id(p) in self.unit_of)

    # ------------------------------------------------------------------ one unit
    def _post(self, u: Unit, phase: str) -> None:
        if u.state != "released":
            return
        exact = phase == "state"  # checkpoints and loads: the fp32 pieces, not the compute dtype
        u.handles = [store.gather(k, u.name, exact) for store, k in u.buckets]
        u.state = "posted"
        self.log.append(("post", u.name, phase))

    def _wait(self, u: Unit, phase: str) -> None:
        if u.state == "released":
            self._post(u, phase)
        if u.state == "posted":
            for h in u.handles:
                wait(h)
            for store, k in u.buckets:
                store.land(k)
            u.handles, u.state = [], "gathered"
            self.log.append(("wait", u.name, phase))

    def _release(self, u: Unit, phase: str) -> None:
        if u.state == "released":
            return
        for h in u.handles:  # never free a buffer a collective still writes
            wait(h)
        for store, k in u.buckets:
            store.release(k)
        u.handles, u.state, u.backward, u.waiting = [], "released", False, set()
        self.log.append(("release", u.name, phase))

    # ------------------------------------------------------------------ a step
    def before_forward(self, names: list[str]) -> None:
        for n in names:
            self._wait(self.units[n], "forward")
        following = self.next_of.get(names[-1]) if names else None
        if following is not None:
            self._post(self.units[following], "forward")

    def after_forward(self, names: list[str], output, backward_reads: bool = True, keep: bool = False) -> None:
        """Release the units; under grad, hook the outputs so backward gathers them again.

        ``backward_reads`` False: this call's backward reads none of the weights (an embedding's
        gradient is its output gradient scattered by the ids): no gather for it, and none
        prefetched for it. ``keep``: the units stay gathered for the backward that follows
        right away (the head: its backward is the next thing this rank runs in every engine
        but afab's), one gather per micro-batch instead of two."""
        if torch.is_grad_enabled() and backward_reads:
            ref = weakref.ref(self)
            for t in _tensors(output):
                if t.requires_grad:
                    t.register_hook(lambda grad, ref=ref, names=tuple(names): ref()._before_backward(names, grad))
        elif torch.is_grad_enabled():
            self.weightless_backward.update(names)
        for n in names:
            u = self.units[n]
            if not u.backward and not (keep and torch.is_grad_enabled()):
                self._release(u, "forward")

    def _before_backward(self, names, grad):
        for n in names:
            u = self.units[n]
            if not u.backward:
                u.backward, u.waiting = True, {id(p) for p in u.params}
            self._wait(u, "backward")
        previous = self.previous_of.get(names[0])
        if previous is not None and previous not in self.weightless_backward:
            self._post(self.units[previous], "backward")
        return grad

    def _on_grad(self, p: nn.Parameter) -> None:
        u = self.unit_of[id(p)]
        u.waiting.discard(id(p))
        if u.backward and not u.waiting:
            self._release(u, "backward")

    def end_round(self) -> None:
        """A backward ended: release what it gathered (a unit some of whose parameters got no
        gradient, a prefetch the round did not use)."""
        for u in self.units.values():
            self._release(u, "backward")

    # ------------------------------------------------------------------ outside a step
    @contextlib.contextmanager
    def all_gathered(self, write_back: bool = False) -> Iterator[None]:
        """Every unit gathered inside; ``write_back``: what was written into the parameters is
        copied into the owned pieces on exit (a checkpoint or Hugging Face load)."""
        self.end_round()
        for u in self.units.values():
            self._post(u, "state")
        for u in self.units.values():
            self._wait(u, "state")
        try:
            yield
            if write_back:
                for u in self.units.values():
                    for store, k in u.buckets:
                        store.write_back(k)
        finally:
            for u in self.units.values():
                self._release(u, "state")

    def host_copies(self, wanted: dict[int, str]) -> dict[str, torch.Tensor]:
        """name -> a host copy of each parameter of ``wanted`` (id(p) -> name), gathered one unit
        at a time (every rank of the groups must call it, with its own ``wanted``)."""
        out = {}
        self.end_round()
        for u in self.units.values():
            self._wait(u, "state")
            with torch.no_grad():
                for p in u.params:
                    if id(p) in wanted:
                        out[wanted[id(p)]] = p.detach().to("cpu", copy=True)
            self._release(u, "state")
        return out

    def alive_units(self) -> list[str]:
        return [u.name for u in self.units.values() if u.state != "released"]


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    return []


def gather_of_params(params: Iterable[nn.Parameter]) -> Optional[ParamGather]:
    """The ParamGather of ``params`` (a model's), or None below ZeRO-3."""
    for p in params:
        g = param_gather_of(p)
        if g is not None:
            return g
    return None


@contextlib.contextmanager
def full_parameters(params: Iterable[nn.Parameter], write_back: bool = False) -> Iterator[None]:
    """Every parameter of ``params`` whole inside (ZeRO-3: all units gathered; below: nothing to
    do). ``write_back``: changes made inside are kept (the owned pieces are updated)."""
    gather = gather_of_params(params)
    if gather is None:
        yield
        return
    with gather.all_gathered(write_back):
        yield
