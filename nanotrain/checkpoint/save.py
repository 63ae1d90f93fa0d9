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
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint import shard_files
from nanotrain.checkpoint.comm import World
from nanotrain.checkpoint.damage import full_problems, quarantine, quick_problems
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.checkpoint.items import (
    Models,
    capture_rng,
    config_as_dict,
    coords_of,
    named_params,
    optimizer_entries,
    topology_of,
)
from nanotrain.checkpoint.snapshot import HostSnapshot
from nanotrain.parallel.sharding import get_shard_info

log = logging.getLogger("nanotrain.checkpoint")


def save_checkpoint(root: str | Path, step: int, model: Models, optimizer=None, scheduler=None, pc=None,
                    extra: dict | None = None, config=None, *, keep_last: int | None = None,
                    rank_state: dict | None = None, granularity: str = "rank", run_id: str | None = None) -> Path:
    """Write ``<root>/step_<step>/`` on all ranks together; returns its path once committed.

    ``model``: this rank's module (or list of modules: virtual pipeline chunks). ``optimizer``:
    AdamW or ZeroOneOptimizer from ``build_optimizer`` (None: weights only). ``scheduler``: any
    scheduler whose ``state_dict`` is plain data (LambdaLR). ``pc``: ParallelContext (None = one
    process). ``extra``: JSON-able run state from rank 0 (consumed_samples, consumed_tokens, ...),
    returned by ``load_checkpoint``. ``config``: Config or dict, stored for resharding and
    ``--resume``; its ``checkpoints.keep_last`` applies unless ``keep_last`` is given (None and
    no config: keep all). ``rank_state``: JSON-able per-rank state (e.g. a data iterator's
    position) stored next to the RNG states. ``run_id``: the identity of the run that writes
    (stored in meta.json; pruning never deletes a checkpoint of another run id). Saving a step
    that ``latest`` already names is a no-op if that checkpoint verifies completely (every
    tensor's sha256, on rank 0; callers that know they just wrote it skip the call instead),
    otherwise it is moved aside and written again.

    Raises:
        CheckpointError: on every rank together, when any rank failed to plan, write or commit
            (the message names the rank and its traceback).
    """
    pending = begin_save(root, step, model, optimizer, scheduler, pc, extra, config, keep_last=keep_last,
                         rank_state=rank_state, granularity=granularity, run_id=run_id)
    return pending if isinstance(pending, Path) else pending.finish()


def begin_save(root: str | Path, step: int, model: Models, optimizer=None, scheduler=None, pc=None,
               extra: dict | None = None, config=None, *, keep_last: int | None = None,
               rank_state: dict | None = None, granularity: str = "rank", run_id: str | None = None,
               background: bool = False) -> "PendingSave | Path":
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

    params = named_params(model)
    # Two phases, each closed by a collective that carries errors, so a failing rank never leaves
    # the others waiting: plan (what this rank holds), then write (what it was assigned).
    try:
        plan = _plan(params, optimizer, pc)
        sent = {"keys": sorted(plan["keys"].values())}
    except Exception:
        plan, sent = None, {"error": f"rank {world.rank}: {traceback.format_exc()}"}
    plans = world.all_gather(sent)
    _raise_errors(plans, f"saving {final} failed")
    writer: dict[str, int] = {}  # record -> the lowest global rank holding it
    for r, p in enumerate(plans):
        for k in p["keys"]:
            writer.setdefault(k, r)
    try:
        work = _select(world.rank, plan, writer, rank_state, background)
    except Exception:
        work = {"error": f"rank {world.rank}: {traceback.format_exc()}"}
    try:
        live = _live_state(optimizer, scheduler, extra) if world.rank == 0 else None
    except Exception:  # reported by the commit, on every rank together
        live = {"error": traceback.format_exc()}
    commit = dict(root=root, final=final, tmp=tmp, step=step, cfg=cfg, pc=pc, keep_last=keep_last,
                  run_id=run_id, granularity=granularity, live=live, t0=t0, topology=topology_of(pc, optimizer, cfg))
    return PendingSave(world, commit, work.get("snapshot"), lambda: _write_rank(tmp, work, granularity), background)


class PendingSave:
    """The writing and the commit of one save (``begin_save``): ``wait_snapshot()`` returns once
    the host copies of an async save are taken (before then the parameters and optimizer states
    must not change: ``train_step`` calls it before the update); ``done()`` says whether this
    rank's files are written (no communication); ``finish()`` waits for them, then every rank
    takes part in the commit (gather to rank 0, COMPLETE, rename, ``latest``, broadcast)."""

    def __init__(self, world: World, commit: dict, snapshot, write, background: bool):
        self.world, self.commit, self.step, self.path = world, commit, commit["step"], commit["final"]
        self._report: dict | None = None
        self._thread = None
        self._taken = threading.Event()
        if background:
            self._thread = threading.Thread(target=self._write, args=(snapshot, write), daemon=True,
                                            name="nanotrain-checkpoint-writer")
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
            self._report = {"error": f"rank {self.world.rank}: {traceback.format_exc()}"}
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
        reports = world.gather(self._report)  # to rank 0, which commits (or reports every rank's error)
        result = None
        if world.rank == 0:
            errors = [r["error"] for r in [*reports, c["live"]] if "error" in r]
            if errors:
                result = {"error": "\n".join(errors)}
            else:
                try:
                    meta = _meta(c["step"], c["cfg"], c["pc"], c["topology"], c["live"], reports, c["granularity"])
                    meta["run_id"] = c["run_id"]
                    meta["save_seconds_before_commit"] = round(time.perf_counter() - c["t0"], 4)
                    _commit(c["root"], c["tmp"], c["final"], meta, c["step"], c["keep_last"], c["run_id"])
                    result = {"ok": True, "bytes": sum(f["bytes"] for f in meta["files"].values())}
                except Exception:
                    result = {"error": traceback.format_exc()}
        result = world.broadcast(result)
        if "error" in result:
            raise CheckpointError(f"saving {c['final']} failed:\n{result['error']}")
        if world.rank == 0:
            log.info("saved %s: %.1f MB in %.2f s", c["final"], result["bytes"] / 1e6, time.perf_counter() - c["t0"])
        return c["final"]


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


def _raise_errors(reports: list, what: str) -> None:
    errors = [r["error"] for r in reports if "error" in r]
    if errors:
        raise CheckpointError(f"{what}:\n" + "\n".join(errors))


def _plan(params, optimizer, pc) -> dict:
    """This rank's records, each with a key identifying identical replicas on other ranks."""
    infos = {n: get_shard_info(ps[0]) for n, ps in params.items()}
    opt = optimizer_entries(optimizer) if optimizer is not None else {}
    missing = sorted(set(opt) - set(params))
    if missing:
        raise fmt.CheckpointError(f"optimizer parameters not found in the model: {missing[:5]}")
    keys = {}
    for n, ps in params.items():
        keys[("model", n)] = fmt.key_hash(["model", n, fmt.info_to_json(infos[n]), list(ps[0].shape),
                                          str(ps[0].dtype)])
    for n, e in opt.items():
        keys[("optimizer", n)] = fmt.key_hash(["optimizer", n, fmt.info_to_json(infos[n]), list(e.local_shape),
                                              e.start, e.stop])
    return {"params": params, "infos": infos, "opt": opt, "keys": keys, "pc": pc}


def _select(rank: int, plan: dict, writer: dict, rank_state, snapshot: bool) -> dict:
    """What this rank writes, taken now: its assigned records (copied to the host when
    ``snapshot``: an async save), its RNG states and per-rank state."""
    params, infos, opt, keys, pc = plan["params"], plan["infos"], plan["opt"], plan["keys"], plan["pc"]
    keep = HostSnapshot() if snapshot else (lambda t: t.detach())
    coords = coords_of(pc)
    ep = coords["ep"] if pc is not None and pc.ep_size > 1 else None
    # Parameters are written by dp/cp rank 0 (the lowest rank of a replica set): their file is
    # named by (pp, tp); optimizer ranges differ per dp rank (ZeRO-1), so their files carry dp too.
    model_tag = fmt.coord_tag(pp=coords["pp"], tp=coords["tp"], ep=ep, dp=coords["dp"] or None,
                              cp=coords["cp"] or None)
    opt_tag = fmt.coord_tag(pp=coords["pp"], tp=coords["tp"], ep=ep, dp=coords["dp"],
                            cp=coords["cp"] if pc is not None and pc.cp_size > 1 else None)
    model_items = [(n, keep(ps[0]), infos[n]) for n, ps in params.items()
                   if writer[keys[("model", n)]] == rank]
    # The step count too: AdamW increments it in place (it is a view of the live state).
    opt_items = [(n, infos[n], e.local_shape, e.start, e.stop, keep(e.step), keep(e.exp_avg), keep(e.exp_avg_sq))
                 for n, e in opt.items() if writer[keys[("optimizer", n)]] == rank]
    return {"rank": rank, "coords": coords, "model_tag": model_tag, "opt_tag": opt_tag, "model_items": model_items,
            "opt_items": opt_items, "rng": capture_rng(), "rank_state": rank_state,
            "snapshot": keep if snapshot else None}


def _write_rank(tmp: Path, work: dict, granularity) -> dict:
    if "error" in work:
        return work
    rank, coords = work["rank"], work["coords"]
    model_jobs, model_index = shard_files.model_shard_files(work["model_tag"], work["model_items"], granularity,
                                                            coords["pp"])
    opt_jobs, opt_index = shard_files.optimizer_shard_files(work["opt_tag"], work["opt_items"], granularity,
                                                            coords["pp"])
    state_rel = f"state/rank-{rank:05d}.safetensors"
    state_job = (work["rng"], {"kind": "state", "rank": rank, "coords": coords, "rank_state": work["rank_state"]})
    files = shard_files.write_files(tmp, {**model_jobs, **opt_jobs, state_rel: state_job})
    return {"files": files, "index": {"model": model_index, "optimizer": opt_index}, "state": state_rel}


def _live_state(optimizer, scheduler, extra) -> dict:
    """What the commit records of the training state at the save's step (rank 0, taken at once:
    an async commit happens steps later)."""
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
    return {"scheduler": sched, "param_groups": groups, "extra": extra_json}


def _meta(step, cfg, pc, topology, live, reports, granularity) -> dict:
    files, model_index, opt_index, state_index = {}, {}, {}, {}
    for rank, report in enumerate(reports):
        files.update(report["files"])
        shard_files.merge_index(model_index, report["index"]["model"])
        shard_files.merge_index(opt_index, report["index"]["optimizer"])
        state_index[str(rank)] = report["state"]
    return {
        "format": fmt.FORMAT, "format_version": fmt.FORMAT_VERSION, "step": int(step), "extra": live["extra"],
        "topology": topology, "world_size": len(reports),
        "config_hash": hashlib.sha256(fmt.canonical(cfg).encode()).hexdigest() if cfg is not None else None,
        "config": cfg, "scheduler": live["scheduler"], "param_groups": live["param_groups"],
        "granularity": granularity, "checksum": fmt.CHECKSUM,
        "created_unix": time.time(), "torch_version": torch.__version__,
        "files": dict(sorted(files.items())),
        "index": {"model": model_index, "optimizer": opt_index, "state": state_index},
    }


def _commit(root: Path, tmp: Path, final: Path, meta: dict, step: int, keep_last: int | None,
            run_id: str | None) -> None:
    for rel, rec in meta["files"].items():
        try:
            size = (tmp / rel).stat().st_size
        except OSError:
            raise fmt.CheckpointError(f"{tmp / rel}: reported written but missing") from None
        if size != rec["bytes"]:
            raise fmt.CheckpointError(f"{tmp / rel}: {size} bytes on disk, {rec['bytes']} written")
    fmt.write_meta_and_complete(tmp, meta)
    fmt.commit_rename(tmp, final)
    fmt.update_latest(root, final.name)
    if keep_last:
        prune(root, step, keep_last, run_id)


def prune(root: Path, step: int, keep_last: int, run_id: str | None = None) -> list[Path]:
    """Keep the checkpoint of ``step`` (just written and checked) and the ``keep_last - 1`` newest
    complete ones before it; delete older ones.

    Only checkpoints of ``run_id`` are considered: another run's (a ``checkpoints.path`` shared
    on purpose, ``checkpoints.allow_foreign``) are never deleted. A checkpoint is counted among
    the kept ones only after a size check (``quick_problems``): one that fails is moved aside,
    so the last good checkpoint is never pruned in favour of a damaged one. Complete
    checkpoints after ``step`` (an abandoned future of a rolled-back run) are left alone.
    Returns the directories deleted."""
    kept, removed = 0, []
    for _, p in (sp for sp in fmt.complete_checkpoints(root) if sp[0] < step):  # newest first
        problems, meta = quick_problems(p)
        if meta is not None and meta.get("run_id") != run_id:
            continue  # another run's checkpoint: not ours to delete
        if problems:
            quarantine(p, problems)
        elif kept < keep_last - 1:
            kept += 1
        else:
            fmt.remove_dir(p)
            removed.append(p)
    return removed
