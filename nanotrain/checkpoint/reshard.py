"""Offline resharding: a checkpoint at one topology -> a complete checkpoint at another, in one
process, with tensors only (no process group, no model weights computed).

The target layout comes from the model code itself: for every (ep rank, pp rank, tp rank) of the
new topology a *skeleton* model part is built on the meta device by the family's parallelize
plan, with stand-in tp and ep groups (size, rank) and no weight initialisation, which yields each
parameter's name, local shape and ShardInfo exactly as the real run will have them (fused QKV /
gate-up chunks, vocab padding, pipeline placement, tied replicas, the rank's experts). ZeRO-1/2/3 ranges come from
``zero_ranges``, the partition ``ZeroOneOptimizer`` takes from the trainer's gradient buckets
(``build_grad_sync``, default bucket size; at ZeRO-3 cut at the gather units too, as the
trainer cuts them; the model shards are whole parameters at every stage): with ep > 1 the dense parameters' buckets over
dp x ep (the rank's place in ``dp_cp_ep_pg`` is ``ep_rank * dp + dp_rank``) and the routed
experts' over dp. (Were they to differ from what a run holds, the loader cuts any saved ranges
into its own: only slower.) Full tensors are assembled from
the source shards with the loader's own functions, then cut into the new pieces: copies only,
so values are bit-identical.

The output has no RNG state files (the loader warns and starts fresh streams, as after any
topology change); step, counters, scheduler and learning rates are carried over. The whole model
and its optimizer states are held in memory once (3x the fp32 parameter bytes).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint import shard_files
from nanotrain.checkpoint.assemble import ShardReader, assemble_full, assemble_optimizer_full, cut_local
from nanotrain.checkpoint.format import CheckpointError
from nanotrain.checkpoint.items import named_params
from nanotrain.checkpoint.offline_checks import ReshardPlan, plan_reshard, resolve_checkpoint  # noqa: F401 (re-exported)
from nanotrain.config import Config, config_to_dict
from nanotrain.config.files import removed_on_failure
from nanotrain.models.family import family_of
from nanotrain.optim.optimizer import weight_decay_groups
from nanotrain.parallel.data_parallel import is_expert_param
from nanotrain.parallel.data_parallel.buckets import DEFAULT_BUCKET_CAP_MB, zero_ranges
from nanotrain.parallel.data_parallel.shard_params import unit_of_name
from nanotrain.parallel.grid import GroupShape
from nanotrain.parallel.sharding import ShardInfo, get_shard_info

log = logging.getLogger("nanotrain.checkpoint")


def skeleton_model(config: Config, tp_rank: int, pp_rank: int, ep_rank: int = 0) -> nn.Module:
    """The model of one (tp, pp, ep) rank with the right names, shapes and ShardInfo, no storage
    (offline resharding supports cp = 1 only)."""
    p = config.parallelism
    pc = SimpleNamespace(
        tp_pg=GroupShape(p.tp, tp_rank), pp_rank=pp_rank, pp_size=p.pp, cp_pg=None, ep_pg=GroupShape(p.ep, ep_rank)
    )
    return family_of(config.model).build_part(config, pc, initialize=False)


def _cut(full: torch.Tensor, info: ShardInfo, local_shape: tuple[int, ...]) -> torch.Tensor:
    if tuple(full.shape) != tuple(info.global_shape):
        raise CheckpointError(f"saved shape {tuple(full.shape)} != model shape {tuple(info.global_shape)}")
    return cut_local(full, fmt.info_to_json(info), local_shape)


def optimizer_order(model) -> list[str]:
    """Parameter names in the flat order of ``build_optimizer`` (decay group, then no-decay)."""
    groups = weight_decay_groups(model.named_parameters(), 0.0)
    return [n for g in groups for n in g["param_names"]]


def optimizer_ranges(
    model, zero: int, dp: int, dp_rank: int, ep: int, ep_rank: int, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB
) -> list[tuple[str, int, int]]:
    """(name, start, stop) of the optimizer states one rank holds, in ``build_optimizer``'s order:
    whole parameters for ZeRO-0; for ZeRO-1 and 2 (one partition) the ranges ``ZeroOneOptimizer`` gives rank
    (dp_rank, ep_rank), the dense parameters' buckets sharded over dp x ep and the experts' over
    dp (each set bucketed by its own gradient sync, in model order, ``bucket_cap_mb`` the
    trainer's); ZeRO-3 the same with every bucket cut at the gather units as well
    (``shard_params.unit_of_name``: a layer, the embedding, the head)."""
    params = dict(model.named_parameters())
    order = optimizer_order(model)
    if zero == 0:
        return [(n, 0, params[n].numel()) for n in order]
    out = []
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]  # the gradient sync's order
    dense = [n for n in trainable if ep == 1 or not is_expert_param(params[n])]
    experts = [n for n in trainable if ep > 1 and is_expert_param(params[n])]
    for names, size, rank in ((dense, dp * ep, ep_rank * dp + dp_rank), (experts, dp, dp_rank)):
        if names:
            units = [unit_of_name(n) for n in names] if zero == 3 else None
            pieces = zero_ranges([params[n] for n in names], size, rank, bucket_cap_mb, units)
            out += [(names[i], a, b) for i, a, b in pieces]
    position = {n: i for i, n in enumerate(order)}
    return sorted(out, key=lambda r: position[r[0]])


def read_full_state(ckpt: str | Path, verify: bool = True) -> tuple[dict, dict, dict]:
    """(meta, {name: full parameter}, {name: {"exp_avg", "exp_avg_sq" (full shape), "step"}})."""
    ckpt = resolve_checkpoint(ckpt)
    meta = fmt.read_meta(ckpt)
    if verify:
        bad = fmt.verify_checkpoint(ckpt)
        if bad:
            raise CheckpointError(f"{ckpt} is damaged: " + "; ".join(bad))
    reader = ShardReader(ckpt)
    params = {n: assemble_full(reader, n, e) for n, e in meta["index"]["model"].items()}
    optim = {}
    for n, e in meta["index"]["optimizer"].items():
        optim[n] = assemble_optimizer_full(reader, n, e)
    reader.close()
    return meta, params, optim


def reshard_offline(
    src: str | Path, dst_root: str | Path, overrides: list[str] = (), granularity: str = "rank"
) -> Path:
    """Write ``dst_root/step_N`` (+ ``latest``) at the topology of the source config with
    ``overrides`` (``parallelism.tp=4``, ``optimizer.zero_stage=0``...) applied.

    Raises ConfigError or CheckpointError for an impossible target or a wrong SRC/DST
    (``offline_checks.plan_reshard``: meta.json only, before any tensor is read or a byte
    written), CheckpointError for a damaged source. A failure after writing began removes
    ``step_N.tmp`` and, if this call made it, ``dst_root``: nothing half-written is left."""
    t0 = time.perf_counter()
    plan = plan_reshard(src, dst_root, overrides)
    meta, full, full_opt = read_full_state(plan.checkpoint)
    dst_root = Path(dst_root)
    with removed_on_failure(dst_root):
        dst_root.mkdir(parents=True, exist_ok=True)
        name = fmt.step_dir_name(int(meta["step"]))
        tmp = dst_root / f"{name}.tmp"
        for stale in fmt.stale_entries(dst_root):
            shutil.rmtree(stale, ignore_errors=True)
        with removed_on_failure(tmp):
            final = _write(plan, meta, full, full_opt, tmp, granularity, src)
            fmt.update_latest(dst_root, final.name)
    p = plan.config.parallelism
    log.info(
        "resharded %s -> %s (dp%d tp%d pp%d ep%d zero%s) in %.2f s",
        src,
        final,
        p.dp,
        p.tp,
        p.pp,
        p.ep,
        plan.config.optimizer.zero_stage,
        time.perf_counter() - t0,
    )
    return final


def _write(plan: ReshardPlan, meta: dict, full: dict, full_opt: dict, tmp: Path, granularity: str, src) -> Path:
    """Every rank's shards and the new meta.json into ``tmp``, committed as ``step_N``."""
    config = plan.config
    cfg = config_to_dict(config)
    par, zero = cfg["parallelism"], cfg["optimizer"]["zero_stage"]
    tp, pp, dp, ep = par["tp"], par["pp"], par["dp"], par["ep"]
    final = tmp.with_name(tmp.name.removesuffix(".tmp"))
    tmp.mkdir()
    files, model_index, opt_index = {}, {}, {}
    seen: set[str] = set()  # records already written by a lower rank (replicas)
    for ep_rank in range(ep):  # global rank order: ep, pp, then dp, then tp (tp fastest)
        for pp_rank in range(pp):
            stages = [skeleton_model(config, t, pp_rank, ep_rank) for t in range(tp)]
            tags = [fmt.coord_tag(pp=pp_rank, tp=t, ep=ep_rank if ep > 1 else None) for t in range(tp)]
            for tp_rank, skel in enumerate(stages):
                items = _model_items(skel, full, seen, src)
                if items:
                    f, i = shard_files.write_model_shards(tmp, tags[tp_rank], items, granularity, pp_rank)
                    files.update(f)
                    shard_files.merge_index(model_index, i)
            if not full_opt:
                continue
            for dp_rank in range(dp if zero >= 1 else 1):
                for tp_rank, skel in enumerate(stages):
                    ranges = optimizer_ranges(skel, zero, dp, dp_rank, ep, ep_rank)
                    items = _optimizer_items(skel, ranges, full_opt, seen, src)
                    if items:
                        tag = fmt.coord_tag(pp=pp_rank, tp=tp_rank, ep=ep_rank if ep > 1 else None, dp=dp_rank)
                        f, i = shard_files.write_optimizer_shards(tmp, tag, items, granularity, pp_rank)
                        files.update(f)
                        shard_files.merge_index(opt_index, i)

    new_meta = dict(meta)
    new_meta.update(
        {
            "topology": {
                "dp": dp,
                "tp": tp,
                "pp": pp,
                "cp": 1,
                "ep": ep,
                "zero_stage": zero if full_opt else None,
                "pp_engine": par.get("pp_engine"),
                "pp_virtual_stages": par.get("pp_virtual_stages"),
                "tp_mode": par.get("tp_mode"),
            },
            "world_size": dp * tp * pp * ep,
            "config": cfg,
            "config_hash": hashlib.sha256(fmt.canonical(cfg).encode()).hexdigest(),
            "granularity": granularity,
            "created_unix": time.time(),
            "torch_version": torch.__version__,
            "files": dict(sorted(files.items())),
            "index": {"model": model_index, "optimizer": opt_index, "state": {}},
            "resharded_from": {"path": str(plan.checkpoint), "topology": meta["topology"]},
        }
    )
    new_meta.pop("save_seconds_before_commit", None)
    fmt.write_meta_and_complete(tmp, new_meta)
    fmt.commit_rename(tmp, final)
    return final


def _model_items(skel, full: dict, seen: set, src) -> list[tuple]:
    """One rank's parameter shards cut from the full tensors, skipping records a lower rank wrote."""
    items = []
    for pname, (p, *_) in named_params(skel).items():
        if pname not in full:
            raise CheckpointError(f"{src} has no parameter {pname!r} (source model differs)")
        info = get_shard_info(p)
        key = fmt.key_hash(["model", pname, fmt.info_to_json(info), list(p.shape)])
        if key in seen:
            continue
        seen.add(key)
        items.append((pname, _cut(full[pname], info, tuple(p.shape)), info))
    return items


def _optimizer_items(skel, ranges: list[tuple[str, int, int]], full_opt: dict, seen: set, src) -> list[tuple]:
    """One rank's AdamW state ranges cut from the full states, skipping records a lower rank wrote."""
    params = dict(skel.named_parameters())
    items = []
    for pname, a, b in ranges:
        p = params[pname]
        if pname not in full_opt:
            raise CheckpointError(f"{src} has no optimizer state for {pname!r}")
        info = get_shard_info(p)
        key = fmt.key_hash(["optimizer", pname, fmt.info_to_json(info), list(p.shape), a, b])
        if key in seen:
            continue
        seen.add(key)
        st = full_opt[pname]
        cut = [_cut(st[k], info, tuple(p.shape)).reshape(-1)[a:b].clone() for k in ("exp_avg", "exp_avg_sq")]
        items.append((pname, info, tuple(p.shape), a, b, st["step"], *cut))
    return items
