"""The ZeRO-3 rows of ``vs_native.py``: nanotrain ZeRO-3 at dp2 against PyTorch's FSDP2
(``fully_shard`` per decoder layer and the root, ``reshard_after_forward=True``), and the per-rank
bytes of parameters + gradients + AdamW states at ZeRO-3 against ZeRO-1, between steps and at the
peak of a step.

Why FSDP2 with ``reshard_after_forward=True`` on every module, the root included: that is ZeRO-3's
schedule. Each layer's parameters are all-gathered before its forward, freed after it, gathered
again before its backward and freed after it; gradients are reduce-scattered per backward into
sharded ones; AdamW states are sharded. nanotrain's ZeRO-3 does the same per gather unit (a decoder
layer, the embedding, the final norm + head), prefetching the next unit while one computes; FSDP2
is given the same prefetching (``NativeFSDP2(prefetch=True)``): on CPU its gathers are otherwise
synchronous, and the row would then measure that default rather than the two implementations
(measured: FSDP2 with the prefetching 1.19x the tokens/s of FSDP2 without, paired 1.10, loaded).

Why a 16-layer model for the memory rows: ZeRO-3's saving between steps is the same fraction at
any depth, but the transient (the gathered units alive at once) is a fixed number of units, so only
a deep model shows it as the small part of the whole that it is in practice.

Kept apart from ``bench_zero.py`` (the ZeRO-2 rows, whose pieces this reuses) so that no file
outgrows one reading.
"""

from __future__ import annotations

from bench_common import MODEL, Bench
from bench_sides import Ours
from bench_zero import (
    ROTATIONS,
    NativeFSDP2,
    max_bytes,
    max_over_ranks,
    peak_full_buffers,
    rotated_throughput,
    state_bytes,
)

# The memory rows' model: deep and narrow, so a step's few gathered layers are a small part.
MEMORY_MODEL = dict(MODEL, num_layers=16, hidden_size=64, intermediate_size=256)


def gathered_peak(gather) -> dict[str, int]:
    """From ``ParamGather.log``: the most bytes of full (gathered) parameter buffers alive at once
    over the steps logged, and the most units and decoder-layer units alive at once."""
    nbytes = {name: sum(store.nbytes(k) for store, k in u.buckets) for name, u in gather.units.items()}
    live: dict[str, int] = {}
    peak = {"bytes": 0, "units": 0, "layer_units": 0}
    for event, unit, _ in gather.log:
        if event == "post":
            live[unit] = nbytes[unit]
        elif event == "release":
            live.pop(unit, None)
        else:
            continue
        peak["bytes"] = max(peak["bytes"], sum(live.values()))
        peak["units"] = max(peak["units"], len(live))
        peak["layer_units"] = max(peak["layer_units"], sum(n.startswith("layers.") for n in live))
    return peak


class TransientPeak:
    """The most bytes of full buffers alive at once in ZeRO-3 steps: gathered parameter units plus
    full gradient buckets, together (each one's own peak, ``gathered_peak`` and
    ``peak_full_buffers``, need not fall at the same moment).

    Why sampled where it is: a unit's buffers are gathered or released only where ``ParamGather``
    logs an event (sampled as the event is logged; at a release, the unit's bytes are added back:
    the moment just before it), and gradient buckets are allocated only in the gradients'
    post-accumulate hooks (sampled by one more hook, registered after the runtime's)."""

    def __init__(self, gather, accumulator, params):
        self.gather, self.accumulator, self.peak = gather, accumulator, 0
        meter = self

        class SampledLog(list):
            def append(self, event):
                super().append(event)
                meter.sample(event)

        gather.log = SampledLog(gather.log)
        self.hooks = [p.register_post_accumulate_grad_hook(lambda p: self.sample(None)) for p in params]

    def sample(self, event) -> None:
        units = self.gather.units
        live = sum(store.nbytes(k) for u in units.values() for store, k in u.buckets if store.alive(k))
        if event is not None and event[0] == "release":
            live += sum(store.nbytes(k) for store, k in units[event[1]].buckets)
        self.peak = max(self.peak, live + self.accumulator.live_buffer_bytes())

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()


def _memory_rows(b: Bench) -> list[dict]:
    """Per-rank bytes after two training steps of ``MEMORY_MODEL`` at ZeRO-1 and ZeRO-3 (max over
    the ranks), and ZeRO-3's peak within a step: those bytes + the most full buffers (gathered
    parameter units and gradient buckets) alive at once (``TransientPeak``)."""
    measured, peaks = {}, {}
    for zero in (1, 3):
        side = Ours(b, dp=2, zero=zero, spec=MEMORY_MODEL)
        if zero == 3:
            meter = TransientPeak(side.optimizer.param_gather, side.grad_sync.accumulator, side.model.parameters())
        for i in range(2):
            side.step(i)
        measured[zero] = max_bytes(state_bytes(side.model, side.optimizer, side.grad_sync))
        if zero == 3:
            peaks = max_bytes(gathered_peak(side.optimizer.param_gather))
            peaks["grad_buckets"] = int(max_over_ranks(peak_full_buffers(side.grad_sync.accumulator)))
            peaks["together"] = int(max_over_ranks(meter.peak))
            meter.remove()
            unit = side.optimizer.param_gather.units["layers.0"]
            layer_bytes = int(max_over_ranks(sum(store.nbytes(k) for store, k in unit.buckets)))
        del side
    z1, z3 = measured[1], measured[3]
    peak3 = z3["total"] + peaks["together"]
    layers = MEMORY_MODEL["num_layers"]
    common = {
        "unit": "bytes",
        "lower_is_better": True,
        "same_loss": None,
        "columns": ["nanotrain ZeRO-3", "nanotrain ZeRO-1"],
        "bytes_by_kind": {"zero1": z1, "zero3": z3},
        "model": f"{layers} layers, hidden {MEMORY_MODEL['hidden_size']}, ffn {MEMORY_MODEL['intermediate_size']}",
    }
    name = f"memory: params + grads + AdamW states per rank, ZeRO-3 vs ZeRO-1 (dp2, {layers} layers"
    between = {
        "name": f"{name}, between steps)",
        "ours": z3["total"],
        "native": z1["total"],
        "ratio": round(z3["total"] / z1["total"], 3),
        "target": round(8 / 12 + 0.005, 3),  # fp32 per element: ZeRO-1 4 + 4 + 8/2, ZeRO-3 (4 + 4 + 8)/2
        **common,
        "note": "storages counted once, max over ranks; analytic 8/12 = 0.667 (ZeRO-1: full params 4 B + full "
        "grads 4 B + half of AdamW's 8 B per element; ZeRO-3: half of all three)",
    }
    during = {
        "name": f"{name}, peak in a step)",
        "ours": peak3,
        "native": z1["total"],
        "ratio": round(peak3 / z1["total"], 3),
        "target": None,
        **common,
        "zero3_peak_gathered_param_bytes": peaks["bytes"],
        "zero3_peak_units_alive": peaks["units"],
        "zero3_peak_layer_units_alive": peaks["layer_units"],
        "zero3_peak_full_grad_bucket_bytes": peaks["grad_buckets"],
        "zero3_peak_transient_bytes": peaks["together"],
        "zero3_layer_unit_bytes": layer_bytes,
        "note": "ZeRO-3: between-step bytes + the most full buffers alive at once, gathered parameter units "
        "(ParamGather.log, ShardedStore.nbytes) and full gradient buckets together (sampled at every gather event "
        "and gradient hook); each alone at its own peak in the zero3_peak_* fields; ZeRO-1 holds the same bytes "
        "throughout the step",
    }
    return [between, during]


def job_zero3(b: Bench) -> list[dict]:
    b.total_steps *= ROTATIONS  # one LR schedule across the rotated runs
    ours, native = Ours(b, dp=2, zero=3), NativeFSDP2(b, dp=2, reshard=True, prefetch=True)
    name = "dp2 ZeRO-3 vs FSDP2 fully_shard (per layer + root, reshard_after_forward=True, async prefetch)"
    row = rotated_throughput(b, ours, native, name)
    # This model's bytes between steps, both sides (FSDP2: sharded parameters and AdamW states,
    # no gradients after zero_grad; ZeRO-3 also keeps its zeroed owned accumulator).
    row["bytes_between_steps"] = {
        "zero3": max_bytes(state_bytes(ours.model, ours.optimizer, ours.grad_sync)),
        "fsdp2": max_bytes(state_bytes(native.model, native.optimizer)),
    }
    del ours, native
    return [row, *_memory_rows(b)]
