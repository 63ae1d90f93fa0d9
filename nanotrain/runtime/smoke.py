"""A distributed smoke step: the job every launch path runs until the trainer exists, and the
fastest proof that a launch is wired right — every task builds the ParallelContext and one
all-reduce per process group returns the sum of that group's global ranks.

Each rank writes `smoke/rank-R.json` in the run directory so tests (and users) can check every
task of a SLURM job, not only what rank 0 printed.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from nanotrain.parallel.observe.nodes import node_name
from nanotrain.parallel.parallel_context import ParallelContext
from nanotrain.runtime.env import DistEnv
from nanotrain.runtime.hang_status import SMOKE_DIR

AXES = ("tp", "cp", "dp", "pp", "ep", "dp_cp", "dp_cp_ep", "world")


def smoke_step(pc: ParallelContext, env: DistEnv, run_dir: Path) -> dict:
    rank = dist.get_rank()
    sums, ok = {}, True
    for axis in AXES:
        group = pc.get_group(axis)
        value = torch.tensor([float(rank)], device=pc.device)
        dist.all_reduce(value, group=group)
        expected = float(sum(pc.grid.group_of(axis, rank)))
        sums[axis] = {"got": value.item(), "expected": expected, "ranks": dist.get_process_group_ranks(group)}
        ok &= value.item() == expected
    report = {
        "rank": rank,
        "world_size": dist.get_world_size(),
        "launcher": env.launcher,
        "local_rank": env.local_rank,
        "node_rank": env.node_rank,
        "job_id": env.job_id,
        "restart": env.restart_count,
        "host": socket.gethostname(),
        "node": node_name(),  # SLURM's node name: hosts may share a host name
        "backend": pc.backend,
        "device": str(pc.device),
        "coords": pc.grid.coords(rank)._asdict(),
        "sums": sums,
        "ok": ok,
    }
    out = run_dir / SMOKE_DIR
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps(report, indent=1))
    flags = torch.tensor([0.0 if ok else 1.0], device=pc.device)
    dist.all_reduce(flags)
    if rank == 0:
        status = "ok" if flags.item() == 0 else f"FAILED on {int(flags.item())} rank(s)"
        print(
            f"smoke: {status}: world={dist.get_world_size()} backend={pc.backend} "
            f"launcher={env.launcher} all-reduce over {', '.join(AXES)} on every rank",
            flush=True,
        )
    if flags.item() != 0:
        raise RuntimeError(f"smoke step: all-reduce sums wrong on {int(flags.item())} rank(s); see {out}")
    return report
