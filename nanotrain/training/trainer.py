"""DistributedTrainer: config -> ParallelContext -> model stage -> optimizer -> data -> loop.

Read top to bottom: `__init__` builds everything in the order a step needs it, `train` is the
loop. One step = the engine runs this rank's micro-batches (DP sync on the last one), the
gradients are clipped by the global norm, the optimizer and LR step. Metrics go out from one rank;
checkpoints are written every `checkpoints.interval` steps and when a stop is requested, after all
ranks agreed on the step. The trainer knows no launcher: it is handed a `stop_requested()`
callable (the task's signal flag) and returns an outcome, "completed" or "preempted"; the task
(`launch/task.py`) decides what that means for the job — requeue, exit code.

Precision: `model.dtype: bfloat16` computes forward and backward under autocast in bf16 (on GPU,
and on CPU where tests prove the path) while weights, gradients (and their accumulation) and
optimizer states stay fp32; `float32` computes in fp32.
Host syncs: none on a silent step. Batches are copied to the device a step ahead, the loss and
grad norm stay on the device until a logging step reads them, and the stop vote is read a step
late (`training/stop_vote.py`), so on a GPU the host runs ahead of the kernels it launches.
Reproducibility: every source of randomness derives from `training.seed` (weights from
(seed, parameter name), data order from (seed, epoch)), so a run repeats bit for bit on CPU.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist

from nanotrain.checkpoint import load_checkpoint, save_checkpoint
from nanotrain.checkpoint.hf_import import load_hf_weights
from nanotrain.config import Config
from nanotrain.data import BatchPrefetcher, build_sampler
from nanotrain.logging import metrics_logger_for
from nanotrain.optim import build_lr_scheduler, build_optimizer
from nanotrain.parallel.context import ParallelContext
from nanotrain.parallel.data_parallel import BucketedGradSync
from nanotrain.training.builder import build_engine, build_model
from nanotrain.training.step import train_step
from nanotrain.training.stop_vote import StopVote


def quiet_libraries() -> None:
    """No carriage-return progress bars from `datasets` in log files (SLURM, local ranks)."""
    if not sys.stdout.isatty():
        import datasets

        datasets.disable_progress_bars()


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


class DistributedTrainer:
    def __init__(self, config: Config, run_dir: Path, pc: ParallelContext, stop_code: Callable[[], int],
                 run_id: str | None = None):
        self.config, self.run_dir, self.pc = config, Path(run_dir), pc
        self.run_id = run_id  # stored in every checkpoint; another run's are refused on resume
        t = config.training
        self.device = pc.device
        seed_everything(t.seed)
        quiet_libraries()

        self.model = build_model(config, self.pc, device=self.device)
        self.engine = build_engine(config, self.pc)  # None when pp = 1
        # What crosses a pipeline stage boundary (the middle stages read no data to derive it).
        self.message = self.model.pipeline_message(t.micro_batch_size, t.sequence_length)
        self.grad_sync = BucketedGradSync(list(self.model.parameters()), self.pc.dp_cp_pg)
        self.optimizer = build_optimizer(self.model.named_parameters(), config.optimizer, self.pc.dp_cp_pg)
        self.scheduler = build_lr_scheduler(self.optimizer, config.optimizer, t.train_steps)

        stage_needs_data = self.pc.is_pipeline_first_stage or self.pc.is_pipeline_last_stage
        self.sampler = build_sampler(config, builder=self.pc.world_rank == 0, needs_data=stage_needs_data,
                                     barrier=dist.barrier)
        self.batches = BatchPrefetcher(self.sampler, self.pc.dp_rank, self.device) if self.sampler else None
        self.step, self.consumed_samples = 0, 0
        self.saved_step: int | None = None  # the step whose state is on disk, verified
        self.stop_code = 0  # the stop request all ranks agreed on (launch.preemption codes)
        if config.checkpoints.resume:
            resumed = load_checkpoint(config.checkpoints.path, self.model, self.optimizer, self.scheduler,
                                      self.pc, config=config, run_id=run_id,
                                      allow_foreign=config.checkpoints.allow_foreign)
            if resumed is not None:
                self.step, self.consumed_samples = resumed.step, resumed.extra["consumed_samples"]
                self.saved_step = resumed.step
                if self.pc.world_rank == 0:
                    how = "resharded from another topology" if resumed.resharded else "same topology, bit-exact"
                    print(f"resumed from {resumed.path} at step {self.step} ({how})", flush=True)
        if self.saved_step is None and config.checkpoints.init_from_hf:  # first start: HF weights
            loaded = load_hf_weights(config.checkpoints.init_from_hf, self.model, config.model)
            if self.pc.world_rank == 0:
                print(f"initialised from Hugging Face {config.checkpoints.init_from_hf}: rank 0 read "
                      f"{loaded['tensors']} slices, {loaded['bytes'] / 1e6:.1f} MB in {loaded['seconds']:.2f} s; "
                      "optimizer and step start fresh", flush=True)

        self.metrics = metrics_logger_for(config, self.run_dir, self.pc, device=self.device,
                                          start_step=self.step)
        self.votes = StopVote(stop_code, self.device)

    def train(self) -> str:
        """Run to `training.train_steps` ("completed"), or until the ranks agree to stop
        ("preempted", after saving when `checkpoints.save_on_preemption`; `self.stop_code` says
        which request). Raises TrainingDiverged (nothing saved after the last finite step)."""
        t = self.config.training
        m = t.batch_accumulation_per_replica
        global_batch = self.config.parallelism.dp * t.micro_batch_size * m
        start = time.perf_counter()
        while self.step < t.train_steps:
            # Middle pipeline stages read no data: m placeholders.
            microbatches = self.batches.get(self.consumed_samples) if self.batches else [None] * m
            stats = train_step(self.model, microbatches, self.grad_sync, self.optimizer, self.scheduler, self.pc,
                               self.config.optimizer.clip_grad, engine=self.engine, message=self.message)
            self.step += 1
            self.consumed_samples += global_batch
            if self.batches and self.step < t.train_steps:
                self.batches.prefetch(self.consumed_samples)  # overlaps this step's GPU work
            # Host time of the step (data included, saves not); the stop vote keeps the host
            # within a step of the GPU, so over a logging interval it is the device's time.
            self.metrics.log(self.step, stats.loss_tensor, stats.lr, stats.grad_norm_tensor,
                             time.perf_counter() - start)

            # Every rank agrees on stopping and on the numbers being finite; a step that saves
            # reads its own vote first, the others the previous step's (stop_vote.py).
            interval = self.config.checkpoints.interval
            saves = bool(interval and self.step % interval == 0) or self.step == t.train_steps
            self.votes.post(self.step, stats.loss_tensor, stats.grad_norm_tensor)
            self.stop_code = self.votes.settle(latest=saves)
            if self.stop_code and not saves:  # about to save: this step must be finite too
                self.stop_code = max(self.stop_code, self.votes.settle(latest=True))
            if interval and self.step % interval == 0:
                self.save()
            if self.stop_code:
                if self.config.checkpoints.save_on_preemption:
                    self.save()
                return "preempted"
            start = time.perf_counter()
        self.save()  # the final state (a no-op when the interval just wrote it)
        return "completed"

    def save(self) -> None:
        if self.saved_step == self.step:
            return  # written (or loaded and verified) by this process: not hashed again
        t = self.config.training
        extra = {"consumed_samples": self.consumed_samples,
                 "consumed_tokens": self.consumed_samples * t.sequence_length}
        save_checkpoint(self.config.checkpoints.path, self.step, self.model, self.optimizer, self.scheduler,
                        self.pc, extra=extra, config=self.config, run_id=self.run_id)
        self.saved_step = self.step

    def close(self) -> None:
        self.metrics.close()
