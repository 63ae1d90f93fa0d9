"""DistributedTrainer: the loop over what ``training/builder.build_parts`` built for this rank.

The trainer builds nothing: it is handed the parts (model, engine, gradient sync, optimizer,
schedule, data, metrics, the starting step) and a ``stop_requested()`` callable (the task's
signal flag), and ``train`` returns an ``Outcome``, COMPLETED or PREEMPTED; the task
(``runtime/ending.py``) decides what that means for the job — requeue, exit code. One step = the
engine runs this rank's micro-batches (DP sync on the last one), the gradients are clipped by the
global norm, the optimizer and LR step. Metrics go out from one rank; checkpoints are written
every ``checkpoints.interval`` steps and when a stop is requested, after all ranks agreed on the
step.

Precision: `model.dtype: bfloat16` computes forward and backward under autocast in bf16 (on GPU,
and on CPU where tests prove the path) while weights, gradients (and their accumulation) and
optimizer states stay fp32; `float32` computes in fp32.
Host syncs: none on a silent step. Batches are copied to the device a step ahead, the loss and
grad norm stay on the device until a logging step reads them, and the stop vote is read a step
late (`training/stop_vote.py`), so on a GPU the host runs ahead of the kernels it launches.
Reproducibility: every source of randomness derives from `training.seed` (weights from
(seed, parameter name), data order from (seed, epoch)), so a run repeats bit for bit on CPU.
Spikes (`training.spike`, ``training/spike.py``): `stop` ends the run at a non-finite step
(TrainingDiverged); `skip` leaves a spiking step without an update, decided on the device; `rewind`
also goes back to the last checkpoint (``rewind``) and reads on past the data since.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Optional

from nanotrain.checkpoint import begin_save, load_checkpoint, save_checkpoint
from nanotrain.logging.moe_stats import step_scalars
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.observe.wait_clock import WAITS
from nanotrain.training.builder import TrainingParts
from nanotrain.training.evaluate import evaluate, perplexity
from nanotrain.training.outcome import Outcome
from nanotrain.training.spike import describe
from nanotrain.training.step import train_step
from nanotrain.training.stop_vote import SpikesPersist, StopVote


class DistributedTrainer:
    """One rank's training run over the parts ``training.builder.build_parts`` made (model part,
    pipeline engine, gradient sync, optimizer, scheduler, data, metrics; resumed when
    ``checkpoints.resume``): ``train()``, then ``close()``. Every rank runs it at once (collective).

    Raises (from ``train``):
        TrainingDiverged: a non-finite loss or gradient norm (nothing saved after the last finite step).
        SpikesPersist (a TrainingDiverged): `rewind` cannot go back any more, or
            `training.spike.max_consecutive_skips` steps in a row were skipped.
    """

    def __init__(self, parts: TrainingParts, stop_code: Callable[[], int], eval_jobs=None):
        """Train with what ``parts`` holds (the trainer keeps its fields, not ``parts``);
        ``stop_code()`` is this rank's stop request (``runtime.preemption`` codes), polled once a step.
        ``eval_jobs``: told of every committed checkpoint (``committed(step)``) and asked which older
        ones pruning must keep (``protects(step)``): ``checkpoints.eval_job``; None: no hooks."""
        self.config, self.pc, self.run_id, self.device = parts.config, parts.pc, parts.run_id, parts.pc.device
        self.model, self.engine, self.message = parts.model, parts.engine, parts.message
        self.grad_sync, self.optimizer, self.scheduler = parts.grad_sync, parts.optimizer, parts.scheduler
        self.sampler, self.batches, self.val_batches = parts.sampler, parts.batches, parts.val_batches
        self.metrics, self.profiler = parts.metrics, parts.profiler
        self.step, self.consumed_samples = parts.step, parts.consumed_samples
        self.saved_step = parts.saved_step  # the step whose state is on disk, verified
        self.spike = parts.spike  # training.spike skip or rewind (training/spike.py); None: stop
        t, replicas = self.config.training, self.config.parallelism.batch_replicas
        # Samples one step consumes: every data replica (dp x ep) reads its micro-batches.
        self.global_batch = replicas * t.micro_batch_size * t.batch_accumulation_per_replica
        self._source_epochs = None  # data epochs per source at the last step (log_data)
        self.pending_save = None  # an async save being written (checkpoints.async_save), not committed
        self.stop_code = 0  # the stop request all ranks agreed on (runtime.preemption codes)
        self.votes = StopVote(stop_code, self.device)
        self.eval_jobs = eval_jobs

    def train(self) -> Outcome:
        """Run to `training.train_steps` (COMPLETED), or until the ranks agree to stop
        (PREEMPTED, after saving when `checkpoints.save_on_preemption`; `self.stop_code` says
        which request). Raises TrainingDiverged (nothing saved after the last finite step)."""
        HANG_RECORD.arm(self.step)  # the hang watchdog judges from here (runtime/hang.py)
        outcome = self._loop()
        HANG_RECORD.disarm()  # not on an exception: the task tells a failed collective by it
        return outcome

    def _loop(self) -> Outcome:
        t = self.config.training
        m = t.batch_accumulation_per_replica
        WAITS.reset()
        start = time.perf_counter()
        WAITS.begin_step(self.device)  # the step's waits on peers (the straggler metric)
        while self.step < t.train_steps:
            # Middle pipeline stages read no data (but under document masking): m placeholders.
            HANG_RECORD.mark("data")
            if self.profiler is not None:
                self.profiler.before(self.step + 1)
            microbatches = self.batches.get(self.consumed_samples) if self.batches else [None] * m
            stats = train_step(
                self.model,
                microbatches,
                self.grad_sync,
                self.optimizer,
                self.scheduler,
                self.pc,
                self.config.optimizer.clip_grad,
                engine=self.engine,
                message=self.message,
                before_update=self.pending_save.wait_snapshot if self.pending_save else None,
                spike=self.spike,
            )
            self.step += 1
            HANG_RECORD.advance(self.step)
            self.consumed_samples += self.global_batch
            if self.batches and self.step < t.train_steps:
                self.batches.prefetch(self.consumed_samples)  # overlaps this step's GPU work
            WAITS.end_step()
            self.log_step(stats, time.perf_counter() - start)
            if t.eval_interval and (self.step % t.eval_interval == 0 or self.step == t.train_steps):
                self.evaluate()
            if self.profiler is not None:
                self.profiler.after(self.step)

            # Every rank agrees on stopping and on the numbers being finite; a step that saves
            # reads its own vote first, the others the previous step's (stop_vote.py).
            interval = self.config.checkpoints.interval
            saves = bool(interval and self.step % interval == 0) or self.step == t.train_steps
            HANG_RECORD.mark("stop vote")
            writing = self.pending_save is not None and not self.pending_save.done()
            values = self.spike.values(stats.loss_tensor, stats.grad_norm_tensor) if self.spike else None
            self.votes.post(self.step, stats.loss_tensor, stats.grad_norm_tensor, writing, stats.skipped, values)
            self.stop_code = self.votes.settle(latest=saves)
            if self.stop_code and not saves:  # about to save: this step must be finite too
                self.stop_code = max(self.stop_code, self.votes.settle(latest=True))
            spiked = self.record_skips()  # every skip settled so far: a save below holds them all
            if spiked is not None:  # training.spike.policy rewind: instead of saving or stopping here
                self.rewind(spiked)
                start = time.perf_counter()
                WAITS.begin_step(self.device)
                continue
            voted_step, still_writing = self.votes.last_settled
            if self.pending_save is not None and voted_step > self.pending_save.step and not still_writing:
                self.finish_save()  # every rank's files are durable: commit, at the same step everywhere
            if interval and self.step % interval == 0:
                self.save(wait=not self.config.checkpoints.async_save)
            if self.stop_code:
                self.finish_save()  # the in-flight save first (it may be this very step's)
                if self.config.checkpoints.save_on_preemption:
                    self.save()
                return Outcome.PREEMPTED
            start = time.perf_counter()
            WAITS.begin_step(self.device)
        self.save()  # the final state (a no-op when the interval just wrote it)
        return Outcome.COMPLETED

    def record_skips(self) -> Optional[dict]:
        """The skipped steps the stop vote has told of (a step late; all of them before a save):
        into the guard's record (checkpoint, ``<run>/spikes.jsonl``) and the console. Returns the
        record of the first of them when the policy rewinds and there is a checkpoint to go back
        to (the same on every rank: the votes and the saves are collective); before the first
        save a spike under `rewind` is only skipped. Raises SpikesPersist once
        `training.spike.max_consecutive_skips` steps in a row were skipped."""
        skips, self.votes.skips = self.votes.skips, []
        for step, values in skips:
            entry = self.spike.record(step, values)
            if self.pc.world_rank == 0:
                print(describe(entry, self.spike.factor), flush=True)
            rewinds = self.config.training.spike.policy == "rewind"
            if rewinds and (self.saved_step is not None or self.pending_save is not None):
                return entry
            bound = self.config.training.spike.max_consecutive_skips
            if self.spike.in_a_row(step) >= bound:  # skipped, not rewound: the run would never move
                why = f"{bound} steps in a row skipped (training.spike.max_consecutive_skips)"
                raise SpikesPersist(step, why, rewinding=False)
        return None

    def rewind(self, spiked: dict) -> None:
        """Back to the last checkpoint after the spike ``spiked`` (its record), leaving out the
        samples read from that checkpoint to the spike (the data position jumps past them: a later
        checkpoint holds the position, so a resume keeps them left out). In-process, through the
        resume path (``load_checkpoint``: weights, optimizer, schedule, RNG, median window). Raises
        SpikesPersist once `training.spike.max_rewinds` rewinds are spent, or without a checkpoint."""
        spike = self.config.training.spike
        self.votes.close()  # the votes of the steps after the spike: their all-reduces complete
        self.votes.skips.clear()  # ... and those steps are undone
        self.finish_save()
        if len(self.spike.rewinds) >= spike.max_rewinds:
            raise SpikesPersist(spiked["step"], f"{len(self.spike.rewinds)} rewinds (training.spike.max_rewinds) spent")
        HANG_RECORD.mark("rewind (loading the last checkpoint)")
        c = self.config.checkpoints
        loaded = load_checkpoint(
            c.path,
            self.model,
            self.optimizer,
            self.scheduler,
            self.pc,
            config=self.config,
            run_id=self.run_id,
            allow_foreign=c.allow_foreign,
        )
        if loaded is None:
            raise SpikesPersist(spiked["step"], "no checkpoint to rewind to")
        after = self.consumed_samples - (self.step - spiked["step"]) * self.global_batch  # the position after the spike
        samples = [loaded.extra["consumed_samples"], after]
        entry = self.spike.rewound(loaded.extra.get("spike"), spiked, loaded.step, samples)
        if self.pc.world_rank == 0:
            print(
                f"step {spiked['step']}: rewind {entry['rewind']}/{spike.max_rewinds} (training.spike.policy rewind) "
                f"to the checkpoint of step {loaded.step}; samples {samples[0]}..{samples[1] - 1} are left out",
                flush=True,
            )
        self.step, self.consumed_samples, self.saved_step = loaded.step, after, loaded.step
        self._source_epochs = None
        HANG_RECORD.advance(self.step)

    def log_step(self, stats, step_s: float) -> None:
        """The step's metrics. ``step_s``: host time of the step (data included, saves not); the
        stop vote keeps the host within a step of the GPU, so over a logging interval it is the
        device's time. On logging steps (the same on every rank) all ranks join one tiny gather
        for the straggler ratio (in the logger: the step time less the step's waits on peers,
        ``parallel/observe/wait_clock.py``) and, with MoE, every pp rank one for the routing
        statistics."""
        HANG_RECORD.mark("metrics")
        self.metrics.log(self.step, stats.loss_tensor, stats.lr, stats.grad_norm_tensor, step_s)
        logs = self.metrics.should_log(self.step)
        moe = self.config.model.moe
        if moe is not None and logs:
            self.metrics.log_scalars(
                self.step, step_scalars(self.model.moe_state, self.pc.pp_pg, capacity=moe.capacity_factor is not None)
            )
        self.log_data(logs)

    def log_data(self, logs: bool) -> None:
        """`data/tokens/<source>` and `data/epoch/<source>` on log steps (``logs``), and one line
        when a source starts a new epoch (a new shuffle of its windows), from the logging rank."""
        if not (self.metrics.enabled and self.sampler is not None):
            return
        now = self.sampler.source_epochs(self.consumed_samples)
        before = self._source_epochs  # the previous step's, or derived on the first step of this process
        if before is None:
            before = self.sampler.source_epochs(self.consumed_samples - self.global_batch)
        self._source_epochs = now
        for part in self.sampler.parts:
            if int(now[part.name]) > int(before[part.name]):
                print(
                    f"data: source {part.name!r} read all its {part.num_windows} windows; epoch "
                    f"{int(now[part.name]) + 1} reads them in a new shuffled order",
                    flush=True,
                )
        if logs:
            tokens = self.sampler.source_tokens(self.consumed_samples)
            scalars = {f"data/tokens/{name}": float(n) for name, n in tokens.items()}
            scalars.update({f"data/epoch/{name}": e for name, e in now.items()})
            self.metrics.log_scalars(self.step, scalars)

    def evaluate(self) -> None:
        """Forward-only loss on `training.eval_batches` validation batches (training/evaluate.py)."""
        t = self.config.training
        m = t.batch_accumulation_per_replica
        HANG_RECORD.mark("eval")
        started = time.perf_counter()
        loss = float(
            evaluate(
                self.model,
                self.val_batches,
                self.pc,
                t.eval_batches,
                self.global_batch,
                m,
                engine=self.engine,
                message=self.message,
            )
        )
        took = time.perf_counter() - started
        self.metrics.log_scalars(
            self.step,
            {"val/loss": loss, "val/ppl": perplexity(loss)},
            console=f"step {self.step}/{t.train_steps} | val/loss {loss:.4f} | "
            f"val/ppl {perplexity(loss):.2f} | eval {took:.2f}s",
        )

    def save(self, wait: bool = True) -> None:
        """Save this step; ``wait=False`` (async_save) returns at once: a thread copies the state
        to the host while the next step computes (its update waits for the copy:
        ``before_update``), then writes it; a later step boundary commits it (``finish_save``).
        At most one save is in flight: a new one first commits the previous."""
        self.finish_save()
        if self.saved_step == self.step:
            return  # written (or loaded and verified) by this process: not hashed again
        HANG_RECORD.mark("checkpoint")
        t = self.config.training
        extra = {
            "consumed_samples": self.consumed_samples,
            "consumed_tokens": self.consumed_samples * t.sequence_length,
        }
        if self.spike is not None:  # the median window and the skipped steps (bit-exact resume)
            extra["spike"] = self.spike.state_dict()
        args = (self.config.checkpoints.path, self.step, self.model, self.optimizer, self.scheduler, self.pc)
        keep = dict(config=self.config, run_id=self.run_id, protected=self.eval_jobs and self.eval_jobs.protects)
        if wait:
            save_checkpoint(*args, extra=extra, **keep)
            self.saved_step = self.step
            self.committed(self.step)
            return
        pending = begin_save(*args, extra=extra, background=True, **keep)
        if isinstance(pending, Path):  # already saved and verified
            self.saved_step = self.step
        else:
            self.pending_save = pending

    def finish_save(self) -> None:
        """Wait for the in-flight async save's files (every rank) and commit it; a no-op without one."""
        if self.pending_save is None:
            return
        HANG_RECORD.mark("checkpoint (async commit)")
        pending, self.pending_save = self.pending_save, None
        pending.finish()
        self.saved_step = pending.step
        self.committed(pending.step)

    def committed(self, step: int) -> None:
        """A checkpoint of ``step`` was just committed (every rank): its evaluation job starts
        (rank 0, ``checkpoints.eval_job``; training does not wait for it)."""
        if self.eval_jobs is not None:
            self.eval_jobs.committed(step)

    def close(self) -> None:
        if self.profiler is not None:
            self.profiler.close()  # training ended inside the window: the trace so far
        self.metrics.close()


def train_and_close(trainer: DistributedTrainer) -> tuple[Outcome, int, int]:
    """Train and close ``trainer``; returns (outcome, last step, agreed stop code). The caller
    drops its own reference right after, so that everything the trainer holds on to a process
    group (model, gradient sync, optimizer, pipeline engine) is freed before ``pc.destroy()``
    checks that no group outlives its destruction."""
    try:
        outcome = trainer.train()
        return outcome, trainer.step, trainer.stop_code
    finally:
        trainer.close()
