"""Collective load: pick the newest intact checkpoint, verify, then restore or reshard.

For every parameter (and its optimizer state) the loader looks in the index of meta.json for a
saved shard with exactly this rank's ShardInfo, local shape (and ZeRO range): found, the tensor is
copied as it is (the same-topology case, bit-exact). Otherwise the full tensor is assembled from
all saved shards of that name by their (local, global) slice pairs and this rank's pieces are cut
from it — which covers any change of tp, pp, dp, cp and ZeRO stage. Optimizer states are handled
the same way through a map "flattened local element -> flat global element" built from the
ShardInfo, so ZeRO-1 ranges cut through tp shards and padding in any combination. All of this is
copying, never arithmetic, so resharded values are bit-identical to the saved ones.

Integrity: every file a rank is about to read is checked against the size and sha256 recorded
in meta.json (itself checked against COMPLETE) before anything is modified. Any damage found on
any rank is shared (one all-gather), logged with the file names, and all ranks fall back together
to the previous complete checkpoint; rank 0 moves the damaged one aside (``damage.py``) and points
``latest`` at the one loaded, so no later save or prune counts it again. Errors that a fallback
cannot fix (a parameter missing or of another shape, a checkpoint of another run) raise
``CheckpointMismatch`` on every rank.
"""

from __future__ import annotations

import json
import logging
import math
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint.assemble import ShardReader, assemble_full, assemble_optimizer_full, cut_local
from nanotrain.checkpoint.comm import World
from nanotrain.checkpoint.damage import quarantine
from nanotrain.checkpoint.format import CheckpointError, CheckpointMismatch
from nanotrain.checkpoint.items import (
    GRID_AXES,
    Models,
    config_as_dict,
    named_params,
    optimizer_layout,
    restore_rng,
    same_grid,
    topology_of,
)
from nanotrain.checkpoint.layout import model_differences
from nanotrain.optim.optimizer import load_optimizer_state_by_name
from nanotrain.parallel.data_parallel.shard_params import full_parameters
from nanotrain.parallel.sharding import copy_from_full_, get_shard_info

log = logging.getLogger("nanotrain.checkpoint")


@dataclass
class LoadedCheckpoint:
    """What a resumed run needs besides the restored objects."""

    path: Path
    step: int
    extra: dict  # as given to save_checkpoint (consumed_samples, consumed_tokens, ...)
    rank_state: dict | None  # this rank's rank_state; None when the topology changed
    resharded: bool  # some tensor was rebuilt from other shards (topology change)
    rng_restored: bool
    skipped: list[str] = field(default_factory=list)  # damaged newer checkpoints, with the files
    meta: dict = field(default_factory=dict, repr=False)

    def provenance(self) -> str:
        """What is known of how the loaded state relates to the run that saved it, for the
        "resumed from" line: resharded here from the saved topology, or the same topology as the
        files, which `scripts/reshard_checkpoint.py` may have written offline from another one
        (its meta records the source). No claim of bit-exactness: nothing here compares values
        with the run that saved them (the resume tests do)."""
        if self.resharded:
            return f"resharded from another topology: {topology_text(self.meta.get('topology') or {})}"
        offline = self.meta.get("resharded_from")
        if offline:
            return f"same topology; resharded offline from {topology_text(offline.get('topology') or {})}"
        return "same topology"


def topology_text(topology: dict) -> str:
    """`dp2 tp2 pp1 cp1 ep1` of a checkpoint meta's topology (its grid axes that it records)."""
    return " ".join(f"{axis}{topology[axis]}" for axis in GRID_AXES if axis in topology)


def load_checkpoint(
    root: str | Path,
    model: Models,
    optimizer=None,
    scheduler=None,
    pc=None,
    *,
    config=None,
    path: str | Path | None = None,
    load_rng: bool = True,
    strict: bool = True,
    run_id: str | None = None,
    allow_foreign: bool = False,
    move_damaged: bool = True,
) -> LoadedCheckpoint | None:
    """Restore the newest intact complete checkpoint under ``root`` into the given objects.

    Collective: every rank calls it. The caller builds ``model``/``optimizer``/``scheduler`` for
    the current topology first, as for a fresh run; the saved shards are resharded to it. A
    checkpoint that fails verification on any rank is skipped on all of them (rank 0 moves it
    aside) and the previous complete one is tried.

    Args:
        root: the checkpoints directory (``checkpoints.path``).
        model: this rank's module, or its list of virtual pipeline chunks.
        optimizer: as built by ``build_optimizer`` (None: weights only).
        scheduler: its ``state_dict`` is restored (None: not restored).
        pc: the ParallelContext (None: one process).
        config: if given, its ``model`` section must match the saved one (dtype aside).
        path: load this checkpoint directory instead, with no fallback.
        load_rng: restore the RNG states (only at the same topology).
        strict: every saved parameter must be taken by some rank (a checkpoint of a bigger model
            is an error, not a silent partial load).
        run_id: the loading run's identity; a checkpoint of another one is refused unless
            ``allow_foreign`` (``checkpoints.allow_foreign``). Checkpoints without a recorded
            run id (offline tools) are accepted.
        move_damaged: rank 0 moves a damaged checkpoint aside (``step_N.damaged``) and points
            ``latest`` at the one loaded (never for an explicit ``path``).

    Returns:
        A ``LoadedCheckpoint``, or None when there is no complete checkpoint to resume.

    Raises:
        CheckpointMismatch: on every rank, when the checkpoint is intact but not this run's to
            load (another model shape, parameters no rank takes under ``strict``, another run).
        CheckpointError: ``path`` is damaged, the checkpoint cannot be planned for this model
            on some rank, or restoring failed on some rank (the objects may then be partly
            loaded).
    """
    world = World(pc)
    if path is not None:
        candidates = [str(path)]
    else:
        candidates = [str(p) for p in fmt.load_candidates(Path(root))] if world.rank == 0 else None
        candidates = world.broadcast(candidates)
    if not candidates:
        return None
    params = named_params(model)
    cfg = config_as_dict(config)
    topology = topology_of(pc, optimizer, cfg)
    skipped: list[str] = []
    for cand in map(Path, candidates):
        problems, fatal, plan, meta = [], [], None, None
        try:
            meta = fmt.read_meta(cand)
        except Exception as e:  # unreadable or altered meta.json: damaged, try the previous one
            problems.append(str(e))
        if meta is not None:
            try:
                _check_identity(cand, meta, run_id, allow_foreign)
                plan = _plan(cand, meta, params, optimizer, topology, cfg, world.rank, load_rng)
                problems = [
                    p
                    for rel, keys in sorted(plan.files.items())
                    if (p := fmt.verify_file(cand, rel, meta["files"].get(rel), keys))
                ]
            except CheckpointError as e:  # does not fit this model: a fallback would not help
                fatal.append(e)
            except Exception:
                fatal.append(CheckpointError(traceback.format_exc()))
        replica_zero = pc is None or (pc.dp_rank == 0 and pc.cp_rank == 0)  # the others hold the same
        used = sorted(plan.used_names) if plan is not None and replica_zero else []
        mismatch = all(isinstance(f, CheckpointMismatch) for f in fatal)
        reports = world.all_gather(
            {"problems": problems, "fatal": [str(f) for f in fatal], "used": used, "mismatch": mismatch}
        )
        fatal_all = [f for r in reports for f in r["fatal"]]
        if fatal_all:
            kind = CheckpointMismatch if all(r["mismatch"] for r in reports) else CheckpointError
            if kind is CheckpointMismatch:  # one line: the first reason, said once
                raise CheckpointMismatch(fatal_all[0])
            raise CheckpointError(f"cannot load {cand}:\n" + "\n".join(dict.fromkeys(fatal_all)))
        problems_all = list(dict.fromkeys(p for r in reports for p in r["problems"]))
        if problems_all:
            msg = f"checkpoint {cand} is damaged, falling back to the previous complete one: " + "; ".join(problems_all)
            if world.rank == 0:
                log.warning(msg)
            skipped.append(msg)
            if path is not None:
                raise CheckpointError(msg)
            if move_damaged and world.rank == 0:
                quarantine(cand, problems_all)
            continue
        if strict:
            saved = set(meta["index"]["model"])
            used_all = {n for r in reports for n in r["used"]}
            unused = sorted(saved - used_all)
            if unused:
                raise CheckpointMismatch(
                    f"cannot load {cand}: it holds parameters no rank of this model has "
                    f"(pass strict=False to ignore): {unused[:8]}"
                )
        result = error = None
        try:
            result = _apply(cand, meta, plan, params, optimizer, scheduler, world, topology)
        except Exception:
            error = world.error_here()
        world.all_gather_checked(None, error, f"loading {cand} failed (model/optimizer may be partly loaded)")
        result.skipped = skipped
        if skipped and move_damaged and world.rank == 0:
            try:  # `latest` named a checkpoint that is gone now: name the one in use
                fmt.update_latest(cand.parent, cand.name)
            except OSError as e:
                log.warning("could not point %s at %s: %s", cand.parent / fmt.LATEST, cand.name, e)
        resharded = world.any(result.resharded)
        result.resharded = resharded
        if world.rank == 0:
            log.info("loaded %s (step %d%s)", cand, result.step, ", resharded" if resharded else "")
        return result
    raise CheckpointError(f"no intact complete checkpoint under {root}:\n" + "\n".join(skipped))


# ----------------------------------------------------------------------------- planning
def _check_identity(cand: Path, meta: dict, run_id: str | None, allow_foreign: bool) -> None:
    """Another run's checkpoint (e.g. ``checkpoints.path`` pointing into another run directory)
    must not be resumed silently: its weights were trained under another config."""
    saved = meta.get("run_id")
    if run_id is None or saved is None or saved == run_id or allow_foreign:
        return
    run = (meta.get("config") or {}).get("logging") or {}
    where = f" ({run.get('dir')}/{run.get('run_name')})" if run.get("run_name") else ""
    raise CheckpointMismatch(
        f"{cand} belongs to another run (run id {saved}{where}, this run is {run_id}): "
        "not resuming another run's weights; point checkpoints.path elsewhere, or set "
        "checkpoints.allow_foreign=true to start from it on purpose"
    )


@dataclass
class _Plan:
    model: dict = field(default_factory=dict)  # name -> (entries, fast)
    optimizer: dict = field(default_factory=dict)  # name -> (entries, fast, OptSlot)
    files: dict = field(default_factory=dict)  # file -> the tensor keys read from it (None: all)
    used_names: set = field(default_factory=set)
    state_file: str | None = None
    same_grid: bool = False
    want_rng: bool = True


def _plan(cand: Path, meta: dict, params, optimizer, topology, cfg, rank, load_rng) -> _Plan:
    if cfg is not None and meta.get("config"):
        diff = model_differences(meta["config"], cfg)
        if diff:
            raise CheckpointMismatch(f"{cand}: model config differs from the saved one in " + ", ".join(diff))
    plan = _Plan(same_grid=same_grid(meta["topology"], topology))
    model_index, opt_index = meta["index"]["model"], meta["index"]["optimizer"]
    missing, mismatched = [], []
    for name, plist in params.items():
        if name not in model_index:
            missing.append(name)
            continue
        plan.used_names.add(name)
        info, p = get_shard_info(plist[0]), plist[0]
        entries = model_index[name]
        if entries[0]["shard"]["global_shape"] != list(info.global_shape):
            mismatched.append(f"{name}: saved {entries[0]['shard']['global_shape']}, model {list(info.global_shape)}")
            continue
        key = fmt.canonical(fmt.info_to_json(info))
        fast = [e for e in entries if fmt.canonical(e["shard"]) == key and e["local_shape"] == list(p.shape)]
        plan.model[name] = (fast[:1] or entries, bool(fast))
    if optimizer is not None and opt_index:
        for name, tmpl in optimizer_layout(optimizer).items():
            if name not in opt_index or name not in params:
                missing.append(f"{name} (optimizer state)")
                continue
            entries = opt_index[name]
            key = fmt.canonical(fmt.info_to_json(get_shard_info(params[name][0])))
            mine = (list(tmpl.local_shape), tmpl.start, tmpl.stop)
            fast = [
                e
                for e in entries
                if fmt.canonical(e["shard"]) == key and (e["local_shape"], e["start"], e["stop"]) == mine
            ]
            plan.optimizer[name] = (fast[:1] or entries, bool(fast), tmpl)
    elif optimizer is not None and rank == 0:
        log.warning("%s holds no optimizer state; the optimizer starts fresh", cand)
    if missing or mismatched:
        raise CheckpointMismatch(
            f"{cand} does not fit this model: "
            + (f"missing {missing[:8]}" if missing else "")
            + (f" shape mismatch {mismatched[:8]}" if mismatched else "")
        )
    for entries, _ in plan.model.values():
        for e in entries:
            plan.files.setdefault(e["file"], set()).add(e["key"])
    for entries, _, _ in plan.optimizer.values():
        for e in entries:
            keys = (f"{e['prefix']}/{k}" for k in ("exp_avg", "exp_avg_sq", "step"))
            plan.files.setdefault(e["file"], set()).update(keys)
    plan.want_rng = load_rng
    if plan.same_grid:  # per-rank state (RNG, rank_state) only means something on the same grid
        plan.state_file = meta["index"]["state"].get(str(rank))
        if plan.state_file:
            plan.files[plan.state_file] = None
    return plan


# ----------------------------------------------------------------------------- applying


def _apply(
    cand: Path, meta: dict, plan: _Plan, params, optimizer, scheduler, world: World, topology: dict
) -> LoadedCheckpoint:
    reader = ShardReader(cand)
    resharded = not plan.same_grid
    # ZeRO-3: the parameters whole while they are written, then cut back to the owned pieces
    whole = full_parameters([p for ps in params.values() for p in ps], write_back=True)
    with torch.no_grad(), whole:
        for name, (entries, fast) in plan.model.items():
            if fast:
                src = reader.get(entries[0]["file"], entries[0]["key"])
                for p in params[name]:
                    p.copy_(src)
            else:
                resharded = True
                full = assemble_full(reader, name, entries)
                for p in params[name]:
                    p.zero_()  # padding rows (not in the ShardInfo) stay zero
                    copy_from_full_(p, full.to(p.dtype))
        if plan.optimizer:
            states = {}
            for name, (entries, fast, tmpl) in plan.optimizer.items():
                st = {
                    "start": tmpl.start,
                    "stop": tmpl.stop,
                    "shape": tmpl.local_shape,
                    "numel": math.prod(tmpl.local_shape),
                }
                if fast:
                    e = entries[0]
                    for k in ("exp_avg", "exp_avg_sq", "step"):
                        st[k] = reader.get(e["file"], f"{e['prefix']}/{k}")
                    st["step"] = st["step"].reshape(())
                else:
                    resharded = True
                    full = assemble_optimizer_full(reader, name, entries)
                    mine = fmt.info_to_json(get_shard_info(params[name][0]))
                    for k in ("exp_avg", "exp_avg_sq"):
                        st[k] = cut_local(full[k], mine, tmpl.local_shape).reshape(-1)[tmpl.start : tmpl.stop].clone()
                    st["step"] = full["step"]
                states[name] = st
            load_optimizer_state_by_name(optimizer, states)
            groups = meta.get("param_groups") or []
            if len(groups) == len(optimizer.param_groups):
                for g, saved in zip(optimizer.param_groups, groups):
                    g.update(saved)
        if scheduler is not None and meta.get("scheduler") is not None:
            scheduler.load_state_dict(meta["scheduler"])

    rank_state, rng_restored = None, False
    if plan.state_file:
        handle = reader.get_handle(plan.state_file)
        tensors = {k: handle.get_tensor(k) for k in handle.keys()}
        header = json.loads((handle.metadata() or {}).get(fmt.HEADER_KEY, "{}"))
        rank_state = header.get("rank_state")
        if plan.want_rng:
            missing = restore_rng(tensors)
            rng_restored = not missing
            if missing:
                log.warning("rank %d: RNG states not restored for %s", world.rank, missing)
    elif plan.same_grid:
        if plan.want_rng and world.rank == 0:
            log.warning("%s holds no per-rank state (written offline?): fresh RNG streams", cand)
    elif world.rank == 0:
        saved = {k: meta["topology"].get(k) for k in GRID_AXES}
        now = {k: topology.get(k) for k in GRID_AXES}
        log.warning(
            "checkpoint %s was saved at %s, loading at %s: tensors resharded exactly; RNG states "
            "are not restored (fresh streams) and per-rank state is dropped; the data position "
            "carries over through the global sample count",
            cand,
            saved,
            now,
        )
    reader.close()
    return LoadedCheckpoint(
        path=cand,
        step=int(meta["step"]),
        extra=meta.get("extra") or {},
        rank_state=rank_state,
        resharded=resharded,
        rng_restored=rng_restored,
        meta=meta,
    )
