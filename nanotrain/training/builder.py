"""Config -> everything one rank trains with, built here and only here, in the order a step needs it.

    pc = build_parallel_context(config)                       # the five axes' groups of this rank
    parts = build_parts(config, pc, run_dir, run_id=...)     # model, engine, optimizer, data, state, ...
    trainer = DistributedTrainer(parts, stop_code)           # the loop; it builds nothing

``build_model`` / ``build_engine`` are the pieces the benchmarks and tests use alone, so every
caller builds exactly what a job builds. The trainer keeps what ``build_parts`` made and nothing
else (``training/trainer.py``); the task decides when it is built (``runtime/rank.py``).
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from nanotrain.checkpoint import load_checkpoint
from nanotrain.config import Config, ConfigError
from nanotrain.data import BatchPrefetcher, GlobalSampler, build_samplers
from nanotrain.hf.import_weights import load_hf_weights
from nanotrain.logging import metrics_logger_for
from nanotrain.logging.flops import attention_accounting
from nanotrain.logging.metrics import MetricsLogger
from nanotrain.models.family import family_of
from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_groups
from nanotrain.parallel.data_parallel import build_grad_sync
from nanotrain.parallel.data_parallel.shard_params import full_parameters
from nanotrain.parallel.documents import resolve_kernel
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.part.model_part import ModelPart
from nanotrain.parallel.pipeline_parallel import PipelineEngine
from nanotrain.training.profile import StepProfiler
from nanotrain.training.spike import SpikeGuard


def hang_timeouts(collective_timeout_s: float) -> tuple[float, float]:
    """(the hang watchdog's timeout, the process groups') for ``training.collective_timeout_s``.

    The watchdog must fire first: it writes the hang report and requeues, while NCCL's own
    watchdog, at the groups' timeout, aborts the process (SIGABRT: no report, no requeue). NCCL
    counts from when a collective is enqueued, the watchdog from the last progress mark, which
    the host passes before it blocks, plus up to a second of polling; so the groups get the
    setting plus a margin of at least two minutes, or a fifth of it for long settings."""
    return collective_timeout_s, collective_timeout_s + max(120.0, 0.2 * collective_timeout_s)


def build_parallel_context(config, timeout_s: Optional[float] = None) -> ParallelContext:
    """This process's ``ParallelContext`` for ``config.parallelism`` (dp, tp, pp, cp, ep); its
    groups time out after ``hang_timeouts``' group timeout unless ``timeout_s`` says otherwise."""
    p = config.parallelism
    groups_s = hang_timeouts(config.training.collective_timeout_s)[1] if timeout_s is None else timeout_s
    return ParallelContext(
        tensor_parallel_size=p.tp,
        pipeline_parallel_size=p.pp,
        data_parallel_size=p.dp,
        context_parallel_size=p.cp,
        expert_parallel_size=p.ep,
        timeout_s=groups_s,
    )


def build_model(config, pc, device=None) -> ModelPart:
    """This rank's part of the model: the family's plain model parallelized by its plan (its pp
    stage(s), tp shards, cp attention, ep experts, recompute, compile, compute dtype). Every rank
    starts from the single-process weights of ``training.seed``. ``device``: default torch's
    default device (the CPU unless set)."""
    return family_of(config.model).build_part(config, pc, device)


def build_engine(config, pc) -> Optional[PipelineEngine]:
    """The engine for ``parallelism.pp_engine``, or None when pp = 1 (no pipeline). It sends
    over the pp group, one batch per communication point (see ``p2p.py``)."""
    if pc.pp_size == 1:
        return None
    return PipelineEngine(config.parallelism.pp_engine, pc.pp_pg, pc.device)


def quiet_libraries() -> None:
    """No carriage-return progress bars from `datasets` in log files (SLURM, local ranks).

    Through the environment variable `datasets` reads when it is imported, not by importing it:
    a rank that reads an existing token cache never needs `datasets`, whose import costs more
    CPU time than the rest of a small rank's start-up (pyarrow, fsspec, the hub client)."""
    if sys.stdout.isatty():
        return
    if "datasets" in sys.modules:
        sys.modules["datasets"].disable_progress_bars()
    else:
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")


def seed_everything(seed: int) -> None:
    """Python's, numpy's and torch's generators from ``training.seed``: the weights drawn next
    and everything else random in a rank repeat bit for bit."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainingParts:
    """What one rank trains with (``build_parts``); the trainer uses these and builds nothing.

    Whoever holds it holds the process groups through the model, gradient sync, optimizer and
    engine: it is handed on, not kept (``ParallelContext.destroy`` checks that nothing survives)."""

    config: Config
    pc: ParallelContext
    run_id: Optional[str]  # stored in every checkpoint; another run's are refused on resume
    model: ModelPart
    engine: Optional[PipelineEngine]  # None when pp = 1
    message: Any  # what crosses a pipeline stage boundary (the middle stages read no data to derive it)
    grad_sync: Any
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: Optional[GlobalSampler]  # None on a middle pipeline stage: it reads no data (unless document masking)
    batches: Optional[BatchPrefetcher]
    val_batches: Optional[BatchPrefetcher]  # None without validation data
    metrics: MetricsLogger
    profiler: Optional[StepProfiler]  # None: training.profile is off
    step: int = 0  # where training starts: the resumed checkpoint's step, or 0
    consumed_samples: int = 0
    saved_step: Optional[int] = None  # the step whose state is on disk, verified (the resumed one)
    spike: Optional[SpikeGuard] = None  # training.spike skip or rewind: the skip decision and its record


def build_parts(config: Config, pc: ParallelContext, run_dir: Path, run_id: Optional[str] = None) -> TrainingParts:
    """This rank's parts, in the order a step needs them; weights, optimizer state and data
    position come from the latest checkpoint when ``checkpoints.resume`` finds one (else from
    ``checkpoints.init_from_hf``, else fresh from ``training.seed``)."""
    t, run_dir = config.training, Path(run_dir)
    seed_everything(t.seed)
    quiet_libraries()
    model = build_model(config, pc, device=pc.device)
    engine = build_engine(config, pc)
    message = model.pipeline_message(t.micro_batch_size, t.sequence_length)
    shard_size = config.optimizer.zero_shard_size  # hybrid sharding: this rank's block of replicas
    # optimizer.grad_reduce_dtype: bf16 on the wire, or the gradients' own dtype (fp32 masters)
    reduce_dtype = torch.bfloat16 if config.optimizer.grad_reduce_dtype == "bfloat16" else None
    grad_sync = build_grad_sync(list(model.parameters()), pc, shard_size=shard_size, reduce_dtype=reduce_dtype)
    skips = t.spike.policy in ("skip", "rewind")  # found_inf: the fused kernel (training/spike.py)
    groups = optimizer_groups(pc, shard_size)
    optimizer = build_optimizer(
        model.named_parameters(), config.optimizer, **groups, fused=skips, gather_dtype=model.compute_dtype
    )
    scheduler = build_lr_scheduler(optimizer, config.optimizer, t.train_steps)
    sampler, val_sampler = build_samplers(
        config,
        builder=pc.world_rank == 0,
        barrier=dist.barrier,
        # Document masking: every stage's attention needs the windows' document ids.
        needs_data=pc.is_pipeline_first_stage or pc.is_pipeline_last_stage or config.data.document_masking,
    )
    batches = BatchPrefetcher(sampler, pc.data_rank, pc.device) if sampler else None
    val_batches = BatchPrefetcher(val_sampler, pc.data_rank, pc.device) if val_sampler else None
    step, consumed_samples, saved_step, extra = _starting_state(config, pc, model, optimizer, scheduler, run_id)
    spike = SpikeGuard(t.spike, pc.device, run_dir, pc.world_rank == 0, extra.get("spike")) if skips else None
    metrics = metrics_logger_for(
        config, run_dir, pc, device=pc.device, start_step=step, flops=family_of(config.model).flops_per_token(config)
    )
    if config.data.document_masking:  # flex where torch cannot train it: one line now, not at step 1
        try:
            resolve_kernel(config.model.attention_kernel, pc.device)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
    if pc.world_rank == 0:  # which attention kernel runs, and what MFU counts of it (as --dry-run says)
        for line in attention_accounting(config, cuda=pc.device.type == "cuda"):
            print(line, flush=True)
    profiler = StepProfiler.from_config(t.profile, run_dir, pc.world_rank)
    return TrainingParts(
        config,
        pc,
        run_id,
        model,
        engine,
        message,
        grad_sync,
        optimizer,
        scheduler,
        sampler,
        batches,
        val_batches,
        metrics,
        profiler,
        step,
        consumed_samples,
        saved_step,
        spike,
    )


def _starting_state(config, pc, model, optimizer, scheduler, run_id) -> tuple[int, int, Optional[int], dict]:
    """(step, consumed samples, saved step, the checkpoint's ``extra``): the latest complete
    checkpoint's, loaded into the model, optimizer and schedule (``checkpoints.resume``); else the first start, with the
    Hugging Face weights of ``checkpoints.init_from_hf`` when set."""
    c = config.checkpoints
    if c.resume:
        resumed = load_checkpoint(
            c.path, model, optimizer, scheduler, pc, config=config, run_id=run_id, allow_foreign=c.allow_foreign
        )
        if resumed is not None:
            if pc.world_rank == 0:
                print(f"resumed from {resumed.path} at step {resumed.step} ({resumed.provenance()})", flush=True)
            return resumed.step, resumed.extra["consumed_samples"], resumed.step, resumed.extra
    if c.init_from_hf:
        with full_parameters(model.parameters(), write_back=True):  # ZeRO-3: written whole, kept as pieces
            loaded = load_hf_weights(c.init_from_hf, model, config.model)
        if pc.world_rank == 0:
            print(
                f"initialised from Hugging Face {c.init_from_hf}: rank 0 read "
                f"{loaded['tensors']} slices, {loaded['bytes'] / 1e6:.1f} MB in {loaded['seconds']:.2f} s; "
                "optimizer and step start fresh",
                flush=True,
            )
    return 0, 0, None, {}
