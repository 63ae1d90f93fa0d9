"""Config -> this rank's process groups, its part of the model and its pipeline engine.

    pc = build_parallel_context(config)                  # the five axes' groups of this rank
    model = build_model(config, pc, device=pc.device)   # its pp stage(s) and tp shards
    engine = build_engine(config, pc)                    # None when pp = 1

The only place where the config meets the ParallelContext's, the model's and the engine's
constructors, so the task, the benchmarks and the tests build exactly the same thing.
"""
from __future__ import annotations

from typing import Optional

from nanotrain.models.family import family_of
from nanotrain.parallel.model_part import ModelPart
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.parallel.pipeline_parallel import PipelineEngine


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
    return ParallelContext(tensor_parallel_size=p.tp, pipeline_parallel_size=p.pp, data_parallel_size=p.dp,
                           context_parallel_size=p.cp, expert_parallel_size=p.ep, timeout_s=groups_s)


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
