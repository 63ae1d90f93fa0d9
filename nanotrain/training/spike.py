"""`training.spike.policy: skip` (and `rewind`, which then also goes back: ``trainer.rewind``):
a step whose loss or gradient norm is not finite, or exceeds `factor` times the median of the
last `window` applied steps, applies no update — decided on the device, without a host sync.

Why on the device: reading the loss on the host every step would make the host wait for every
step's kernels (the trainer keeps silent steps free of host syncs; ``--rehearse`` checks it). So the
decision is a 0-d float tensor handed to the fused AdamW kernel as ``found_inf`` (what
``torch.amp.GradScaler`` uses): the kernel leaves the parameters and both moments untouched
when it is 1, and torch takes the step count back (``_fused_adamw``), so a skipped step is
exactly a step that did not happen for the optimizer. ZeRO-1 is an AdamW subclass: its shards
skip the same way and the all-gather then gathers unchanged parameters. The LR schedule and the
data position still advance (the step is spent; its samples are not read again). Under `skip`
and `rewind` the optimizer is fused on the CPU too, the only CPU AdamW that takes ``found_inf``.

Agreement: the loss and the grad norm are already global after the step's reductions, but one
1-element all-reduce (MAX over every rank, asynchronous to the host) makes the decision identical
on every rank even if a reduction rounded differently somewhere: a rank that updated while its
replicas skipped would silently fork the model.

The median window (losses and grad norms of the last applied steps, NaN where not yet filled) is
a device tensor updated with ``torch.where`` (no data-dependent shapes; the median of an even
window is its lower middle value, ``torch.nanmedian``'s); it is saved in the checkpoint with the
record of skips and rewinds, so a resumed run judges the same steps the same way. The
trainer learns which steps were skipped a step late, from the stop vote it reads anyway
(``stop_vote.py``), and records them in ``<run>/spikes.jsonl`` and the console.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from nanotrain.config.schema import SpikeArgs
from nanotrain.parallel import collectives

SPIKES_FILE = "spikes.jsonl"


class SpikeGuard:
    """The skip decision and its record for one rank (every rank holds one; module doc)."""

    def __init__(self, args: SpikeArgs, device, run_dir: Optional[Path], writes: bool, state: Optional[dict] = None):
        """``writes``: this rank writes ``<run_dir>/spikes.jsonl`` (one rank per run). ``state``:
        ``state_dict()`` of a checkpoint (resume), else a fresh window."""
        self.factor, self.window = float(args.factor), int(args.window)
        self.device = torch.device(device)
        self.path = Path(run_dir) / SPIKES_FILE if run_dir is not None and writes else None
        history = torch.full((2, self.window), math.nan, dtype=torch.float64)
        self.log: list[dict] = []  # skipped steps and rewinds, in the order they happened
        if state is not None:
            history = self._fitted(state["history"])
            self.log = [dict(r) for r in state["log"]]
        self.history = history.to(self.device)
        self.medians = torch.full((2,), math.nan, dtype=torch.float64, device=self.device)
        self._rewrite()  # the record from the checkpoint on: a step past it is redone

    def _fitted(self, saved: list) -> torch.Tensor:
        """A saved median window at this `window`: its newest steps, NaN-padded in front when it
        is shorter (a resume may change `training.spike.window`; the same window resumes exactly)."""
        saved = torch.tensor(saved, dtype=torch.float64)[:, -self.window :]
        pad = torch.full((2, self.window - saved.shape[1]), math.nan, dtype=torch.float64)
        return torch.cat([pad, saved], dim=1)

    @property
    def skipped(self) -> list[dict]:
        return [r for r in self.log if "step" in r]

    @property
    def rewinds(self) -> list[dict]:
        return [r for r in self.log if "rewind" in r]

    def _rewrite(self) -> None:
        if self.path is not None:
            self.path.write_text("".join(json.dumps(r) + "\n" for r in self.log))

    def judge(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """The step's decision, a 0-d float32 device tensor (1.0: skip), the same on every rank;
        an applied step joins the median window. No host sync."""
        now = torch.stack([loss.detach().reshape(()).double(), grad_norm.detach().reshape(()).double()])
        self.medians = self.history.nanmedian(dim=1).values  # NaN while the window is empty
        full = ~torch.isnan(self.history).any()
        spikes = (now > self.factor * self.medians).any() & full
        skip = (spikes | ~torch.isfinite(now).all()).to(torch.float32).reshape(1)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            collectives.all_reduce(skip, op=dist.ReduceOp.MAX, what="all_reduce spike skip")
        shifted = torch.cat([self.history[:, 1:], now.reshape(2, 1)], dim=1)
        self.history = torch.where(skip > 0, self.history, shifted)
        return skip.reshape(())

    def values(self, loss: torch.Tensor, grad_norm: torch.Tensor) -> torch.Tensor:
        """What a record of this step holds (loss, grad norm, their medians), still on the device."""
        return torch.cat([torch.stack([loss.detach().double(), grad_norm.detach().double()]), self.medians])

    def record(self, step: int, values: list[float]) -> dict:
        """Note the skipped ``step`` (a step late, from the stop vote): the list, the file."""
        loss, grad_norm, median_loss, median_grad_norm = values
        entry = {
            "step": step,
            "loss": loss,
            "grad_norm": grad_norm,
            "median_loss": median_loss,
            "median_grad_norm": median_grad_norm,
        }
        self.log.append(entry)
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps(entry) + "\n")
        return entry

    def in_a_row(self, step: int) -> int:
        """How many steps up to ``step``, the step just recorded, were skipped one after the other,
        read from the record (so a resumed run counts alike); a rewind starts the count again (its
        steps run once more)."""
        count = 0
        for entry in reversed(self.log):
            if "rewind" in entry or entry["step"] != step - count:
                break
            count += 1
        return count

    def rewound(self, state: Optional[dict], spike: dict, to_step: int, samples: list[int]) -> dict:
        """Back to the checkpoint of ``to_step`` (its ``state_dict``; None: saved without one),
        after ``spike`` (the record of the skipped step that set it off): its window and record,
        plus every rewind made since it was saved (they count towards `max_rewinds`) and this one,
        whose left-out sample positions are [``samples[0]``, ``samples[1]``)."""
        kept = len(state["log"]) if state is not None else 0
        later = [r for r in self.log[kept:] if "rewind" in r]
        entry = {"rewind": len(self.rewinds) + 1, "at_step": spike["step"], "to_step": to_step}
        entry.update(skipped_samples=samples, loss=spike["loss"], grad_norm=spike["grad_norm"])
        history = torch.full((2, self.window), math.nan, dtype=torch.float64)
        if state is not None:
            history = self._fitted(state["history"])
        self.history = history.to(self.device)
        self.log = self.log[:kept] + later + [entry]
        self._rewrite()
        return entry

    def state_dict(self) -> dict:
        """JSON-able state for the checkpoint (a host copy of the window: at saves only)."""
        return {"history": self.history.cpu().tolist(), "log": [dict(r) for r in self.log]}


def describe(entry: dict, factor: float) -> str:
    """The console line of a skipped step."""
    medians = f"loss {entry['median_loss']:.4g}, grad norm {entry['median_grad_norm']:.4g}"
    finite = math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"])
    why = f"above {factor:g} x the median ({medians})" if finite else "not finite"
    return (
        f"step {entry['step']}: skipped (training.spike): loss {entry['loss']:.4g}, "
        f"grad norm {entry['grad_norm']:.4g} {why}; no update applied"
    )
