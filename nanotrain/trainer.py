"""DistributedTrainer: config -> ParallelContext -> model stage -> optimizer -> data -> loop.

Read top to bottom: `__init__` builds everything in the order a step needs it, `train` is the
loop. One step = the engine runs this rank's micro-batches (DP sync on the last one), the
gradients are clipped by the global norm, the optimizer and LR step. Metrics go out from one rank;
checkpoints are written every `checkpoints.interval` steps and when SLURM (or a local signal)
asks the job to stop, after all ranks agreed on the step.

Precision: CPU runs compute in fp32. On GPU, `model.dtype: bfloat16` computes the forward under
autocast in bf16 while weights, gradients (and their accumulation) and optimizer states stay fp32.
Reproducibility: every source of randomness derives from `training.seed` (weights from
(seed, parameter name), data order from (seed, epoch)), so a run repeats bit for bit on CPU.
"""
from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from nanotrain.checkpoint import load_checkpoint, save_checkpoint
from nanotrain.config import Config
from nanotrain.data import build_sampler
from nanotrain.launch.env import DistEnv
from nanotrain.launch.preemption import PreemptionHandler
from nanotrain.logging import metrics_logger_for
from nanotrain.optim import build_lr_scheduler, build_optimizer
from nanotrain.parallel.context import ParallelContext
from nanotrain.parallel.data_parallel import BucketedGradSync
from nanotrain.parallel.pipeline_parallel import build_engine, build_pipeline_model, train_step
from nanotrain.training.stop import TrainingDiverged, agree_on_stop


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
    def __init__(self, config: Config, run_dir: Path, env: DistEnv, pc: ParallelContext,
                 preemption: PreemptionHandler, run_id: str | None = None):
        self.config, self.run_dir, self.env, self.pc = config, Path(run_dir), env, pc
        self.run_id = run_id  # stored in every checkpoint; another run's are refused on resume
        t = config.training
        self.device = pc.device
        seed_everything(t.seed)
        quiet_libraries()

        self.model = build_pipeline_model(config, self.pc, device=self.device)
        self.engine = build_engine(config, self.pc)  # None when pp = 1
        self.grad_sync = BucketedGradSync(list(self.model.parameters()), self.pc.dp_cp_pg)
        self.optimizer = build_optimizer(self.model.named_parameters(), config.optimizer, self.pc.dp_cp_pg)
        self.scheduler = build_lr_scheduler(self.optimizer, config.optimizer, t.train_steps)

        stage_needs_data = self.pc.is_pipeline_first_stage or self.pc.is_pipeline_last_stage
        self.sampler = build_sampler(config, builder=self.pc.world_rank == 0, needs_data=stage_needs_data,
                                     barrier=dist.barrier)
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

        self.metrics = metrics_logger_for(config, self.run_dir, self.pc, device=self.device,
                                          start_step=self.step)
        self.preemption = preemption  # installed by the task before anything slow

    def train(self) -> str:
        """Run to `training.train_steps`; returns "completed" or "preempted" (a stop request was
        agreed and saved; `self.stop_code` says which). Raises TrainingDiverged (nothing saved)."""
        t = self.config.training
        global_batch = self.config.parallelism.dp * t.micro_batch_size * t.batch_accumulation_per_replica
        while self.step < t.train_steps:
            microbatches = self.sampler.batch(self.consumed_samples, self.pc.dp_rank) if self.sampler else None
            start = time.perf_counter()
            stats = train_step(self.model, microbatches, self.grad_sync, self.optimizer, self.scheduler,
                               self.pc, self.config, engine=self.engine)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            self.step += 1
            self.consumed_samples += global_batch
            self.metrics.log(self.step, stats.loss, stats.lr, stats.grad_norm, time.perf_counter() - start)

            self.stop_code, diverged = agree_on_stop(self.preemption.code, stats.loss, stats.grad_norm, self.device)
            if diverged:  # before any save: the last finite checkpoint stays the latest
                raise TrainingDiverged(self.step, stats.loss, stats.grad_norm)
            interval = self.config.checkpoints.interval
            if interval and self.step % interval == 0:
                self.save()
            if self.stop_code:
                return self.stop_for_preemption()
        if not (self.config.checkpoints.interval and self.step % self.config.checkpoints.interval == 0):
            self.save()  # the final state, unless the interval just wrote it
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

    def stop_for_preemption(self) -> str:
        """Save (all ranks) and return "preempted"; what the stop means (requeue, a user's cancel)
        is decided by the task, which knows the scheduler."""
        if self.config.checkpoints.save_on_preemption:
            self.save()
        return "preempted"

    def close(self) -> None:
        self.metrics.close()
