"""One rank's part of a save (``save.py``): what it holds, what it writes, and its files.

``plan_records`` lists the rank's records (parameters and optimizer ranges), each with a key that
identical replicas on other ranks share; once every rank's keys are known, ``take_work`` takes
the records this rank was assigned (the lowest global rank holding a record writes it), as
they are at the save's step: host copies (``HostSnapshot``) for an async save. ``write_rank``
writes them with the rank's RNG and per-rank state, and returns what the commit needs to know.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from nanotrain.checkpoint import format as fmt
from nanotrain.checkpoint import shard_files
from nanotrain.checkpoint.items import OptEntry, capture_rng, coords_of, optimizer_entries
from nanotrain.checkpoint.snapshot import HostSnapshot
from nanotrain.parallel.sharding import ShardInfo, get_shard_info


@dataclass
class RankPlan:
    """What this rank holds: its parameters and optimizer ranges, each record with a key that
    identical replicas on other ranks share."""

    params: dict[str, list[torch.Tensor]]
    infos: dict[str, ShardInfo]
    opt: dict[str, OptEntry]
    keys: dict[tuple[str, str], str]  # ("model" | "optimizer", name) -> replica key


@dataclass
class RankWork:
    """What this rank writes, taken at the save's step (host copies: an async save)."""

    rank: int
    coords: dict[str, int]
    model_tag: str
    opt_tag: str
    model_items: list[tuple]
    opt_items: list[tuple]
    rng: dict[str, torch.Tensor]
    rank_state: dict | None
    snapshot: HostSnapshot | None


@dataclass
class Written:
    """A rank's answer to the commit (sent as JSON): its files' meta.json records, its part of
    the tensor index and its state file; or its error."""

    files: dict[str, dict] = field(default_factory=dict)
    index: dict[str, dict] = field(default_factory=dict)  # {"model": ..., "optimizer": ...}
    state: str = ""
    error: str | None = None


def plan_records(params: dict[str, list[torch.Tensor]], optimizer) -> RankPlan:
    """This rank's records, each with a key identifying identical replicas on other ranks."""
    infos = {n: get_shard_info(ps[0]) for n, ps in params.items()}
    opt = optimizer_entries(optimizer) if optimizer is not None else {}
    missing = sorted(set(opt) - set(params))
    if missing:
        raise fmt.CheckpointError(f"optimizer parameters not found in the model: {missing[:5]}")
    keys = {}
    for n, ps in params.items():
        keys[("model", n)] = fmt.key_hash(["model", n, fmt.info_to_json(infos[n]), list(ps[0].shape), str(ps[0].dtype)])
    for n, e in opt.items():
        keys[("optimizer", n)] = fmt.key_hash(
            ["optimizer", n, fmt.info_to_json(infos[n]), list(e.local_shape), e.start, e.stop]
        )
    return RankPlan(params, infos, opt, keys)


def take_work(
    rank: int, plan: RankPlan, writer: dict[str, int], pc, rank_state, snapshot: bool, values: dict | None = None
) -> RankWork:
    """What this rank writes, taken now: its assigned records (copied to the host when
    ``snapshot``: an async save), its RNG states and per-rank state. ``values``: host copies of
    the parameters it writes, already taken (ZeRO-3, whose parameters are not whole between
    steps)."""
    params, infos, opt, keys = plan.params, plan.infos, plan.opt, plan.keys
    keep = HostSnapshot() if snapshot else (lambda t: t.detach())
    coords = coords_of(pc)
    ep = coords["ep"] if pc is not None and pc.ep_size > 1 else None
    # Parameters are written by dp/cp rank 0 (the lowest rank of a replica set): their file is
    # named by (pp, tp); optimizer ranges differ per dp rank (ZeRO-1), so their files carry dp too.
    model_tag = fmt.coord_tag(pp=coords["pp"], tp=coords["tp"], ep=ep, dp=coords["dp"] or None, cp=coords["cp"] or None)
    opt_tag = fmt.coord_tag(
        pp=coords["pp"],
        tp=coords["tp"],
        ep=ep,
        dp=coords["dp"],
        cp=coords["cp"] if pc is not None and pc.cp_size > 1 else None,
    )
    model_items = [
        (n, keep(ps[0]) if values is None else values[n], infos[n])
        for n, ps in params.items()
        if writer[keys[("model", n)]] == rank
    ]
    # The step count too: AdamW increments it in place (it is a view of the live state).
    opt_items = [
        (n, infos[n], e.local_shape, e.start, e.stop, keep(e.step), keep(e.exp_avg), keep(e.exp_avg_sq))
        for n, e in opt.items()
        if writer[keys[("optimizer", n)]] == rank
    ]
    return RankWork(
        rank=rank,
        coords=coords,
        model_tag=model_tag,
        opt_tag=opt_tag,
        model_items=model_items,
        opt_items=opt_items,
        rng=capture_rng(),
        rank_state=rank_state,
        snapshot=keep if snapshot else None,
    )


def write_rank(tmp: Path, work: RankWork, granularity: str) -> Written:
    coords = work.coords
    model_jobs, model_index = shard_files.model_shard_files(work.model_tag, work.model_items, granularity, coords["pp"])
    opt_jobs, opt_index = shard_files.optimizer_shard_files(work.opt_tag, work.opt_items, granularity, coords["pp"])
    state_rel = f"state/rank-{work.rank:05d}.safetensors"
    state_job = (work.rng, {"kind": "state", "rank": work.rank, "coords": coords, "rank_state": work.rank_state})
    files = shard_files.write_files(tmp, {**model_jobs, **opt_jobs, state_rel: state_job})
    return Written(files=files, index={"model": model_index, "optimizer": opt_index}, state=state_rel)
