"""Collective save with an atomic commit.

Protocol (every rank calls ``save_checkpoint`` at the same step):

1. rank 0 removes leftovers of interrupted saves (``*.tmp``, ``step_N`` without COMPLETE) and
   creates ``step_N.tmp/``; the decision is broadcast (nothing else starts before it). A
   ``step_N`` that ``latest`` already names is only trusted (the save skipped) after every file
   of it verified; one that fails is moved aside (``damage.py``) and written anew;
2. the ranks agree who writes what: every (name, ShardInfo, ...) record held by several ranks (dp
   and cp replicas, tp-replicated norms, a tied copy on another pipeline stage, ZeRO-0 states) is
   written once, by the lowest global rank holding it — dp rank 0 for parameters, every dp rank
   for its ZeRO-1 ranges, each tp/pp rank for its own shards;
3. every rank writes and fsyncs its files, hashing the bytes as they are written, and reports
   sizes, checksums and its part of the tensor index to rank 0 (a gather: the barrier);
4. rank 0 checks that every reported file exists with its size, writes meta.json and then
   COMPLETE (holding meta.json's sha256), renames ``step_N.tmp`` -> ``step_N``, moves ``latest``
   (temp file + ``os.replace``) and prunes to ``keep_last`` (only this run's checkpoints, and
   only ones that pass a size check count as kept); the outcome is broadcast.

A process killed anywhere before the rename leaves a ``*.tmp`` directory that the loader ignores;
killed between the rename and the update of ``latest``, it leaves ``latest`` on the previous one.
Failures inside a rank are reported through the collectives, so every rank raises together
instead of some of them waiting forever in a barrier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint import shard_files
from nanotrain.checkpoint.comm import World
from nanotrain.checkpoint.damage import full_problems, prune, quarantine
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.checkpoint.items import Models, config_as_dict, named_params, topology_of
from nanotrain.checkpoint.save_rank import Written, plan_records, take_work, write_rank
from nanotrain.checkpoint.snapshot import HostSnapshot
from nanotrain.parallel.data_parallel.shard_params import gather_of_params

log = logging.getLogger("nanotrain.checkpoint")


def save_checkpoint(
    root: str | Path,
    step: int,
    model: Models,
    optimizer=None,
    scheduler=None,
    pc=None,
    extra: dict | None = None,
    config=None,
    *,
    keep_last: int | None = None,
    rank_state: dict | None = None,
    granularity: str = "rank",
    run_id: str | None = None,
    protected: Callable[[int], bool] | None = None,
) -> Path:
    """Write ``<root>/step_<step>/`` on all ranks together; returns its path once committed.

    ``model``: this rank's module (or list of modules: virtual pipeline chunks). ``optimizer``:
    AdamW or ZeroOneOptimizer from ``build_optimizer`` (None: weights only). ``scheduler``: any
    scheduler whose ``state_dict`` is plain data (LambdaLR). ``pc``: ParallelContext (None = one
    process). ``extra``: JSON-able run state from rank 0 (consumed_samples, consumed_tokens, ...),
    returned by ``load_checkpoint``. ``config``: Config or dict, stored for resharding and
    ``--resume``; its ``checkpoints.keep_last`` applies unless ``keep_last`` is given (None and
    no config: keep all). ``rank_state``: JSON-able per-rank state (e.g. a data iterator's
    position) stored next to the RNG states. ``run_id``: the identity of the run that writes
    (stored in meta.json; pruning never deletes a checkpoint of another run id). ``protected``:
    rank 0's ``protected(step)`` keeps an older checkpoint beyond ``keep_last`` for now
    (``damage.prune``). Saving a step
    that ``latest`` already names is a no-op if that checkpoint verifies completely (every
    tensor's sha256, on rank 0; callers that know they just wrote it skip the call instead),
    otherwise it is moved aside and written again.

    Raises:
        CheckpointError: on every rank together, when any rank failed to plan, write or commit
            (the message names the rank and its traceback).
    """
    pending = begin_save(
        root,
        step,
        model,
        optimizer,
        scheduler,
        pc,
        extra,
        config,
        keep_last=keep_last,
        rank_state=rank_state,
        granularity=granularity,
        run_id=run_id,
        protected=protected,
    )
    return pending if isinstance(pending, Path) else pending.finish()


def begin_save(
    root: str | Path,
    step: int,
    model: Models,
    optimizer=None,
    scheduler=None,
    pc=None,
    extra: dict | None = None,
    config=None,
    *,
    keep_last: int | None = None,
    rank_state: dict | None = None,
    granularity: str = "rank",
    run_id: str | None = None,
    background: bool = False,
    protected: Callable[[int], bool] | None = None,
) -> "PendingSave | Path":
    """Steps 1-2 of the protocol (collectives on the world group, at the step boundary) and this
    rank's state taken as it is now; returns the path when the save is skipped, else a
    ``PendingSave`` whose ``finish()`` (every rank, at one step) writes what is left and commits.

    ``background``: a thread copies the state to host memory (pinned, on a GPU: ``snapshot.py``)
    and writes it while training goes on (``checkpoints.async_save``); until
    ``wait_snapshot()`` returns, the caller must not change a parameter or an optimizer state
    (the next forward and backward may run). The thread does no collective (the commit's gather
    runs in ``finish``, on the calling thread). Everything else of the step that the commit
    records (RNG states, scheduler, learning rates, ``extra``) is captured here. Other arguments
    as ``save_checkpoint``; raises CheckpointError as it does, here or from ``finish()``.
    """
    t0 = time.perf_counter()
    world = World(pc)
    root = Path(root)
    name = fmt.step_dir_name(step)
    final, tmp = root / name, root / f"{name}.tmp"
    cfg = config_as_dict(config)
    if keep_last is None and cfg is not None:
        keep_last = (cfg.get("checkpoints") or {}).get("keep_last")

    decision = _prepare(root, name, tmp) if world.rank == 0 else None
    decision = world.broadcast(decision)
    if "error" in decision:
        raise CheckpointError(decision["error"])
    if decision.get("skip"):
        if world.rank == 0:
            log.info("checkpoint %s already saved and latest; not written again", final)
        return final

    # Two phases, each closed by a collective that carries errors, so a failing rank never leaves
    # the others waiting: plan (what this rank holds), then write (what it was assigned).
    plan = plan_error = None
    try:
        plan = plan_records(named_params(model), optimizer)
    except Exception:
        plan_error = world.error_here()
    held = world.all_gather_checked(
        None if plan is None else sorted(plan.keys.values()), plan_error, f"saving {final} failed"
    )
    writer: dict[str, int] = {}  # record -> the lowest global rank holding it
    for r, keys in enumerate(held):
        for k in keys:
            writer.setdefault(k, r)
    work = work_error = None
    try:
        values = _gathered_values(plan, writer, world.rank)
        work = take_work(world.rank, plan, writer, pc, rank_state, background, values)
    except Exception:  # reported by the commit, on every rank together
        work_error = world.error_here()
    live = None
    if world.rank == 0:
        try:
            live = _live_state(optimizer, scheduler, extra)
        except Exception:  # reported by the commit, on every rank together
            live = _Live(error=traceback.format_exc())
    commit = _Commit(
        root=root,
        final=final,
        tmp=tmp,
        step=step,
        cfg=cfg,
        pc=pc,
        keep_last=keep_last,
        run_id=run_id,
        granularity=granularity,
        live=live,
        t0=t0,
        topology=topology_of(pc, optimizer, cfg),
        protected=protected,
    )
    write = (lambda: Written(error=work_error)) if work is None else (lambda: write_rank(tmp, work, granularity))
    return PendingSave(world, commit, None if work is None else work.snapshot, write, background)


def _gathered_values(plan, writer: dict[str, int], rank: int) -> dict[str, torch.Tensor] | None:
    """ZeRO-3: host copies of the parameters this rank writes, gathered one layer at a time (every
    rank of the data-parallel groups takes part); None below ZeRO-3 (the parameters are whole)."""
    gather = gather_of_params(p for ps in plan.params.values() for p in ps)
    if gather is None:
        return None
    mine = {id(ps[0]): n for n, ps in plan.params.items() if writer[plan.keys[("model", n)]] == rank}
    return gather.host_copies(mine)


@dataclass
class _Live:
    """The training state the commit records (rank 0, taken at the save's step: an async commit
    happens steps later); or why it could not be taken."""

    scheduler: dict | None = None
    param_groups: list[dict] | None = None
    extra: dict = field(default_factory=dict)
    error: str | None = None


@dataclass
class _Commit:
    """Where the save goes and what its meta.json records besides the ranks' files."""

    root: Path
    final: Path
    tmp: Path
    step: int
    cfg: dict | None
    pc: object
    keep_last: int | None
    run_id: str | None
    granularity: str
    live: _Live | None  # rank 0 only
    t0: float
    topology: dict
    protected: Callable[[int], bool] | None = None  # rank 0: keep beyond keep_last (damage.prune)


class PendingSave:
    """The writing and the commit of one save (``begin_save``): ``wait_snapshot()`` returns once
    the host copies of an async save are taken (before then the parameters and optimizer states
    must not change: ``train_step`` calls it before the update); ``done()`` says whether this
    rank's files are written (no communication); ``finish()`` waits for them, then every rank
    takes part in the commit (gather to rank 0, COMPLETE, rename, ``latest``, broadcast)."""

    def __init__(
        self,
        world: World,
        commit: _Commit,
        snapshot: HostSnapshot | None,
        write: Callable[[], Written],
        background: bool,
    ):
        self.world, self.commit, self.step, self.path = world, commit, commit.step, commit.final
        self._report: Written | None = None
        self._thread = None
        self._taken = threading.Event()
        if background:
            self._thread = threading.Thread(
                target=self._write, args=(snapshot, write), daemon=True, name="nanotrain-checkpoint-writer"
            )
            self._thread.start()
        else:
            self._write(None, write)

    def _write(self, snapshot, write) -> None:
        try:
            if snapshot is not None:
                snapshot.complete()
                self._taken.set()  # the update may run while the files are written
                _yield_to_training()
            self._report = write()
        except Exception:
            self._report = Written(error=self.world.error_here())
        finally:
            self._taken.set()  # also after a failed copy: the commit reports it

    def wait_snapshot(self) -> None:
        self._taken.wait()

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def finish(self) -> Path:
        if self._thread is not None:
            self._thread.join()
        c, world = self.commit, self.world
        reports = world.gather(asdict(self._report))  # to rank 0, which commits (or reports every rank's error)
        result = _commit(c, [Written(**r) for r in reports]) if world.rank == 0 else None
        result = world.broadcast(result)
        if "error" in result:
            raise CheckpointError(f"saving {c.final} failed:\n{result['error']}")
        if world.rank == 0:
            log.info("saved %s: %.1f MB in %.2f s", c.final, result["bytes"] / 1e6, time.perf_counter() - c.t0)
        return c.final


def _yield_to_training() -> None:
    """Lower this writer thread (and the file and hash threads it starts, which inherit it) to
    the lowest CPU priority: where training runs on the CPU, the background save's hashing and
    copying would otherwise take cores from the steps it is meant not to stall. On a GPU node it
    changes nothing: the host has cores to spare. Linux only (per-thread nice); elsewhere a no-op."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def _prepare(root: Path, name: str, tmp: Path) -> dict:
    try:
        root.mkdir(parents=True, exist_ok=True)
        if fmt.read_latest(root) == name and (root / name / fmt.COMPLETE).is_file():
            problems = full_problems(root / name)
            if not problems:
                return {"skip": True}
            quarantine(root / name, problems)  # never trusted, never replaced silently
        for stale in fmt.stale_entries(root):
            log.warning("removing leftover of an interrupted checkpoint save: %s", stale)
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir()
        for sub in ("model", "optimizer", "state"):
            (tmp / sub).mkdir()
        return {"skip": False}
    except Exception:
        return {"error": traceback.format_exc()}


def _live_state(optimizer, scheduler, extra) -> _Live:
    sched = None
    if scheduler is not None:
        sched = scheduler.state_dict()
        try:
            sched = json.loads(json.dumps(sched))
        except TypeError as e:
            raise fmt.CheckpointError(f"scheduler state is not plain data (JSON): {e}") from None
    groups = None
    if optimizer is not None:
        groups = [{k: g[k] for k in ("lr", "initial_lr") if k in g} for g in optimizer.param_groups]
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except TypeError as e:
        raise fmt.CheckpointError(f"`extra` must be JSON-able: {e}") from None
    return _Live(scheduler=sched, param_groups=groups, extra=extra_json)


def _meta(c: _Commit, reports: list[Written]) -> dict:
    files, model_index, opt_index, state_index = {}, {}, {}, {}
    for rank, report in enumerate(reports):
        files.update(report.files)
        shard_files.merge_index(model_index, report.index["model"])
        shard_files.merge_index(opt_index, report.index["optimizer"])
        state_index[str(rank)] = report.state
    return {
        "format": fmt.FORMAT,
        "format_version": fmt.FORMAT_VERSION,
        "step": int(c.step),
        "extra": c.live.extra,
        "topology": c.topology,
        "world_size": len(reports),
        "config_hash": hashlib.sha256(fmt.canonical(c.cfg).encode()).hexdigest() if c.cfg is not None else None,
        "config": c.cfg,
        "scheduler": c.live.scheduler,
        "param_groups": c.live.param_groups,
        "granularity": c.granularity,
        "checksum": fmt.CHECKSUM,
        "created_unix": time.time(),
        "torch_version": torch.__version__,
        "files": dict(sorted(files.items())),
        "index": {"model": model_index, "optimizer": opt_index, "state": state_index},
    }


def _commit(c: _Commit, reports: list[Written]) -> dict:
    """Step 4 (rank 0): every rank's error, or the files checked, meta.json and COMPLETE, the
    rename, ``latest`` and pruning; the outcome (``{"bytes"}`` or ``{"error"}``) every rank gets."""
    errors = [r.error for r in reports if r.error] + ([c.live.error] if c.live.error else [])
    if errors:
        return {"error": "\n".join(errors)}
    try:
        meta = _meta(c, reports)
        meta["run_id"] = c.run_id
        meta["save_seconds_before_commit"] = round(time.perf_counter() - c.t0, 4)
        for rel, rec in meta["files"].items():
            try:
                size = (c.tmp / rel).stat().st_size
            except OSError:
                raise fmt.CheckpointError(f"{c.tmp / rel}: reported written but missing") from None
            if size != rec["bytes"]:
                raise fmt.CheckpointError(f"{c.tmp / rel}: {size} bytes on disk, {rec['bytes']} written")
        fmt.write_meta_and_complete(c.tmp, meta)
        fmt.commit_rename(c.tmp, c.final)
        fmt.update_latest(c.root, c.final.name)
        if c.keep_last:
            prune(c.root, c.step, c.keep_last, c.run_id, c.protected)
        return {"bytes": sum(f["bytes"] for f in meta["files"].values())}
    except Exception:
        return {"error": traceback.format_exc()}
