"""The pipeline engine: runs one step's micro-batches through this rank's model chunks.

One executor serves every schedule (``schedules.py``): it walks the rank's actions step by step
(``schedule_steps``: one action, or an interleaved steady-state forward-backward pair) and, for
each step, receives what its actions need, computes them, and queues what they produced for the
neighbouring stages. The queued sends go out in the same batch as the next step's receives
(Megatron's ``send_forward_recv_backward`` pairing), one batch per communication point on the
pp group: what keeps NCCL from deadlocking even where a GPU runs its NCCL kernels one after
another (``p2p.py``). Sends are never waited for before receives, so a rank only blocks on data
it needs.

For the forward of micro-batch i through chunk c (virtual stage s):
  input = token ids (s = 0) or a receive from stage s - 1 (a TensorPointer to its rank);
  output = hidden state (sent to stage s + 1) or, on the last stage, loss_i / m.
For its backward: the output gradient is a receive from stage s + 1 (or the loss itself on the
last stage); after backward, the input gradient goes to stage s - 1.

Data-parallel sync: every backward runs inside ``grad_sync.backward_scope(last, chunk params)``:
``no_sync()`` except a chunk's last micro-batch (i = m - 1), whose backward launches the bucketed
all-reduces (one chunk's parameters get their final gradients in exactly that backward); under
ZeRO-2 a round that reduce-scatters the chunk's buckets every micro-batch.

Instrumentation (``last_stats``, per step and rank): time computing (forward + backward) vs the
wall time of the step, so the measured bubble is ``1 - compute / total``; the peak number of
micro-batches whose activations are alive (forward done, backward not yet) and the peak bytes of
activations saved for backward (tensors autograd saved, parameters excluded). Times are CUDA
events on a GPU (host clocks around asynchronous kernels measure only their launch), read lazily.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.observe.timing import IntervalTimer
from nanotrain.parallel.pipeline_parallel.p2p import ACTIVATION, GRADIENT, P2P, MessageSpec, Recv, Send, check_message
from nanotrain.parallel.pipeline_parallel.schedules import Action, get_schedule, schedule_steps
from nanotrain.parallel.pipeline_parallel.tensor_pointer import TensorPointer

MicroBatch = tuple[torch.Tensor, ...]  # (input ids [B, S], targets [B, S]), + document ids [B, S]
# Middle stages read no data: they may pass None for each micro-batch (the count is m). Under
# document masking every stage's attention needs the document ids: every stage passes the
# micro-batches (ids, targets, documents), and each chunk is given the documents (and, under cp's
# balanced order, the micro-batch's token order: (ids, targets, documents, cp_order)).

# The phase of each pp action in the hang record (``HANG_RECORD.mark(template, micro-batch, chunk)``),
# without / with virtual chunks; ``str.format`` ignores the chunk where the template has no slot.
_PHASES = (
    {"F": "forward (pp F micro-batch {})", "B": "backward (pp B micro-batch {})"},
    {"F": "forward (pp F micro-batch {}, chunk {})", "B": "backward (pp B micro-batch {}, chunk {})"},
)


@dataclass
class EngineStats:
    total_s: float = 0.0  # wall time of forward_backward
    compute_s: float = 0.0  # inside forward and backward
    wait_s: float = 0.0  # inside communication calls (waiting for a neighbour, mostly)
    peak_live_microbatches: int = 0  # max over the step of (forwards done - backwards done)
    peak_activation_bytes: int = 0  # max bytes saved for backward, parameters excluded

    @property
    def bubble(self) -> float:
        return 1.0 - self.compute_s / self.total_s if self.total_s > 0 else 0.0


class _ActivationMeter:
    """Bytes autograd saves for backward during a forward, per micro-batch (parameters and
    tensors already counted for this micro-batch are skipped: storages are counted once).

    A Python hook on every saved tensor costs a few microseconds each (hundreds per forward), so
    only the first forward of each kind is hooked: the same chunk on inputs of the same shapes
    and dtypes saves the same tensors (``record(key)`` returns a no-op context for a known key and
    ``add()`` books the bytes measured the first time)."""

    def __init__(self, params):
        self.param_storages = {p.untyped_storage()._cdata for p in params}  # the storage object: data_ptr
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._bytes = 0
        self._known: dict = {}  # key -> bytes of a forward already measured
        self._key = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage._cdata  # is 0 on a device without memory (meta)
        if ptr not in self.param_storages and ptr not in self._seen:
            self._seen.add(ptr)
            self._bytes += storage.nbytes()
        return t

    def record(self, key=None):
        """Context manager around one forward; ``add()`` afterwards books its bytes. A forward
        with the ``key`` of one measured before is not hooked again (None: always measure)."""
        self._key = key
        if key is not None and key in self._known:
            return nullcontext()
        self._seen, self._bytes = set(), 0
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def add(self) -> int:
        if self._key is not None:
            self._bytes = self._known.setdefault(self._key, self._bytes)
        self.live += self._bytes
        self.peak = max(self.peak, self.live)
        return self._bytes

    def release(self, nbytes: int) -> None:
        self.live -= nbytes


class _NoTimer:
    """Measures nothing: ``forward_only`` leaves the training step's ``last_stats`` as they are."""

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


_NO_TIMER = _NoTimer()


class _Step:
    """One step's actions on one rank: what ``forward_backward`` and ``forward_only`` share —
    the message tags, what each action receives, and running one action. ``training``: the
    forwards keep what their backward needs (the output, the input whose gradient goes back,
    the activation bytes, see ``_ActivationMeter``); without it (evaluation, under ``no_grad``)
    a forward's output is dropped once it is sent on and receives need no gradient."""

    def __init__(
        self, pp: int, model, microbatches: Sequence[Optional[MicroBatch]], message: MessageSpec, training: bool
    ):
        self.chunks, self.model, self.microbatches, self.message = model.chunks, model, microbatches, message
        self.m, self.v, self.pp = len(microbatches), len(self.chunks), pp
        self.num_stages = self.chunks[0].num_virtual_stages
        if self.num_stages != pp * self.v:
            raise ValueError(f"model has {self.num_stages} virtual stages, engine expects pp*chunks = {pp}*{self.v}")
        self.training = training
        self.meter = _ActivationMeter(model.parameters()) if training else None
        self.stored: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor, int]] = {}
        self.loss_total: Optional[torch.Tensor] = None
        self.live = self.peak_live = 0

    def tag(self, kind: int, stage: int, mb: int) -> int:  # unique per message of the step
        return (kind * self.num_stages + stage) * self.m + mb

    def needs(self, action: Action) -> list[Recv]:  # what the action receives before it runs
        chunk = self.chunks[action.chunk]
        stage, mb, pp = chunk.virtual_stage, action.microbatch, self.pp
        if action.op == "F" and not chunk.is_first:
            return [
                Recv((stage - 1) % pp, self.tag(ACTIVATION, stage - 1, mb), self.message, self.training, ACTIVATION)
            ]
        if action.op == "B" and not chunk.is_last:
            return [Recv((stage + 1) % pp, self.tag(GRADIENT, stage + 1, mb), self.message, False, GRADIENT)]
        return []

    def run(self, action: Action, received: list[torch.Tensor], grad_sync) -> list[Send]:
        """Compute ``action`` on what it ``received``; returns the sends it produced."""
        return self._forward(action, received) if action.op == "F" else self._backward(action, received, grad_sync)

    def _forward(self, action: Action, received: list[torch.Tensor]) -> list[Send]:
        chunk, mb = self.chunks[action.chunk], action.microbatch
        stage = chunk.virtual_stage
        data = self.microbatches[mb]
        if data is None and (chunk.is_first or chunk.is_last):
            raise ValueError(f"micro-batch {mb} is None on the pp rank holding the first/last stage")
        hidden = received[0] if received else None
        input_ids = data[0] if chunk.is_first else None
        targets = data[1] if chunk.is_last else None
        extra = dict(zip(("documents", "cp_order"), data[2:])) if data is not None else {}
        if self.training:  # measured once per chunk and input shapes/dtypes (see _ActivationMeter)
            inputs = (input_ids if chunk.is_first else hidden, targets)
            record = self.meter.record((action.chunk, *((t.shape, t.dtype) for t in inputs if t is not None)))
        else:
            record = nullcontext()
        with record:
            out = self.model(input_ids=input_ids, targets=targets, hidden=hidden, chunk=action.chunk, **extra)
        sends = []
        if chunk.is_last:
            out = out / self.m
            self.loss_total = out.detach() if self.loss_total is None else self.loss_total + out.detach()
        else:
            check_message(out, self.message, f"the output of virtual stage {stage}")
            sends.append(Send(out, (stage + 1) % self.pp, self.tag(ACTIVATION, stage, mb), ACTIVATION))
        if self.training:
            self.stored[(action.chunk, mb)] = (hidden, out, self.meter.add())
            self.live += 1
            self.peak_live = max(self.peak_live, self.live)
        return sends

    def _backward(self, action: Action, received: list[torch.Tensor], grad_sync) -> list[Send]:
        chunk, mb = self.chunks[action.chunk], action.microbatch
        stage = chunk.virtual_stage
        hidden, out, nbytes = self.stored.pop((action.chunk, mb))
        params = getattr(self.model, "chunk_parameters", None)  # None: every parameter of the rank
        params = params(action.chunk) if params is not None else None
        scope = nullcontext() if grad_sync is None else grad_sync.backward_scope(mb == self.m - 1, params)
        with scope:
            if chunk.is_last:
                out.backward()
            else:
                torch.autograd.backward(out, received[0])
        sends = (
            []
            if chunk.is_first
            else [Send(hidden.grad, (stage - 1) % self.pp, self.tag(GRADIENT, stage, mb), GRADIENT)]
        )
        self.meter.release(nbytes)
        self.live -= 1
        return sends


class PipelineEngine:
    """``PipelineEngine("1f1b", pc.pp_pg)``; ``forward_backward(model, microbatches, grad_sync, message)``.

    The model is this rank's part of a pipeline-built model: ``model.chunks`` (``ModelChunk``s,
    see ``stages.py``; a ``ModelPart``) and ``model(input_ids=, targets=, hidden=, chunk=)`` running one chunk.
    ``message`` is the ``MessageSpec`` of what crosses every stage boundary (the model's
    ``pipeline_message(micro_batch_size, sequence_length)``): receivers allocate from it, so no
    shape travels on the wire and no host sync happens per message (see ``p2p.py``).
    ``p2p``: another transport (tests simulate NCCL's semantics on threads); default: ``pp_pg``.
    """

    def __init__(self, schedule: str, pp_pg=None, device: Optional[torch.device] = None, p2p: Optional[P2P] = None):
        self.name = schedule
        self.schedule = get_schedule(schedule)
        self.p2p = p2p if p2p is not None else P2P.over(pp_pg, device)
        self.pp_size, self.pp_rank = self.p2p.transport.size, self.p2p.transport.rank
        self.device = self.p2p.device
        self._group = getattr(self.p2p.transport, "pg", None)  # for hang reports
        self._timers: Optional[tuple[IntervalTimer, IntervalTimer, IntervalTimer]] = None
        self._peaks = (0, 0)

    @property
    def last_stats(self) -> EngineStats:
        """The last step's timings and memory peaks. Reading it on CUDA waits for that step's
        kernels (the timers are CUDA events): read it on logging steps only."""
        if self._timers is None:
            return EngineStats()
        total, compute, wait = (t.seconds() for t in self._timers)
        return EngineStats(total, compute, wait, *self._peaks)

    def forward_backward(
        self, model, microbatches: Sequence[Optional[MicroBatch]], grad_sync, message: Optional[MessageSpec] = None
    ) -> torch.Tensor | TensorPointer:
        """Forward and backward of every micro-batch; gradients accumulate in ``.grad`` (loss of
        each micro-batch divided by m). ``grad_sync``: a ``BucketedGradSync`` (or None without
        data parallelism). ``message``: see the class doc; when None it is asked of the model for
        the shape of the micro-batches (which a middle stage, reading no data, does not have).
        Returns the summed loss (= mean over micro-batches) on the rank holding the last stage,
        a TensorPointer to that rank elsewhere."""
        if message is None:
            shapes = [mb[0].shape for mb in microbatches if mb is not None]
            if not shapes:
                raise ValueError(
                    "forward_backward: a rank without micro-batches needs "
                    "message=model.pipeline_message(micro_batch_size, sequence_length)"
                )
            message = model.pipeline_message(*shapes[0])
        step = _Step(self.pp_size, model, microbatches, message, training=True)
        total, compute, waiting = (IntervalTimer(self.device) for _ in range(3))
        self._timers = (total, compute, waiting)
        total.start()
        steps = schedule_steps(self.name, self.pp_size, self.pp_rank, step.m, step.v)
        self._run(step, steps, grad_sync, compute, waiting, _PHASES[step.v > 1], "pipeline schedule")
        total.stop()
        self._peaks = (step.peak_live, step.meter.peak)
        return step.loss_total if step.loss_total is not None else TensorPointer(self.pp_size - 1)

    @torch.no_grad()
    def forward_only(
        self, model, microbatches: Sequence[Optional[MicroBatch]], message: MessageSpec
    ) -> torch.Tensor | TensorPointer:
        """Evaluation: the forwards of the schedule, in its order, without a backward: under
        ``no_grad`` nothing builds an autograd graph and each micro-batch's activations are
        dropped as soon as they are sent on, so memory stays at one micro-batch per chunk
        (the order of the forwards is that of the training schedule, which already pairs every
        send with a receive; only the gradient messages are gone). The same machinery as
        ``forward_backward``, restricted to the forward actions; it leaves ``last_stats`` (the
        training step's) and the hang record's phase ("eval") as they are. Returns the mean loss
        over the micro-batches on the rank holding the last stage, a TensorPointer elsewhere."""
        step = _Step(self.pp_size, model, microbatches, message, training=False)
        steps = [(a,) for a in self.schedule(self.pp_size, self.pp_rank, step.m, step.v) if a.op == "F"]
        self._run(step, steps, None, _NO_TIMER, _NO_TIMER, None, "forward-only")
        return step.loss_total if step.loss_total is not None else TensorPointer(self.pp_size - 1)

    def _run(
        self,
        step: "_Step",
        steps: list[tuple[Action, ...]],
        grad_sync,
        compute,
        waiting,
        phases: Optional[dict],
        what: str,
    ) -> None:
        """Walk the schedule's ``steps``: one communication point before each (the previous
        step's sends and this step's receives, one batch), then its actions; finally send the
        last outputs and wait for every send. ``phases``: the hang record's phase templates for
        each action (None: no marks)."""
        self.p2p.expect([r for actions in steps for action in actions for r in step.needs(action)])  # gloo
        pending: list[Send] = []  # sends produced by the previous step
        for actions in steps:
            needs = [step.needs(action) for action in actions]
            if phases is not None:  # the hang record (progress.py), formatted only if read
                HANG_RECORD.mark(phases[actions[0].op], actions[0].microbatch, actions[0].chunk)
            received = iter(self._communicate(pending, [r for n in needs for r in n], waiting))
            pending = []
            for n, action in zip(needs, actions):
                if phases is not None and action is not actions[0]:
                    HANG_RECORD.mark(phases[action.op], action.microbatch, action.chunk)
                compute.start()
                pending += step.run(action, [next(received) for _ in n], grad_sync)
                compute.stop()
        self._communicate(pending, [], waiting)
        HANG_RECORD.entering("wait for pipeline sends", self._group)
        waiting.start()
        self.p2p.wait_sends()
        waiting.stop()
        if step.stored:
            raise RuntimeError(f"pipeline schedule {self.name!r} left {len(step.stored)} backward(s) undone")
        if self.p2p.num_expected:
            raise RuntimeError(f"{what} {self.name!r} left {self.p2p.num_expected} receive(s) unused")

    def _communicate(self, sends: list[Send], recvs: list[Recv], timer: "IntervalTimer") -> list[torch.Tensor]:
        """One communication point, timed (``P2P.communicate`` writes the hang record)."""
        if not sends and not recvs:
            return []
        timer.start()
        received = self.p2p.communicate(sends, recvs)
        timer.stop()
        return received


def schedule_actions(name: str, pp: int, rank: int, m: int, v: int = 1) -> list[Action]:
    """The action list a rank runs (for printing and tests)."""
    return get_schedule(name)(pp, rank, m, v)
