"""The start-up health check (``slurm.health``): every task times a fixed-size matmul, an all-reduce
within its node and one with the neighbouring nodes; a task or node far slower than the median is
named with its SLURM node, and on SLURM its node is excluded and the job requeued before training.

Why before training: a node that is slow (a throttled GPU, a degraded NVLink or NIC) makes every
step of a synchronous job as slow as itself, and comes back on every requeue. Found at start-up it
costs a few seconds and a requeue; found later it costs the run's throughput or a hang.

What is timed, on every task, after a warm-up (the first matmul and the first collective on a new
group pay for library and communicator start-up):

* ``matmul``: ``MATMUL`` x ``MATMUL`` (bf16 on GPU, float32 on CPU), the median of ``REPS``; a task
  whose time is above ``slurm.health.matmul_slowdown`` x the median task's is slow;
* ``all-reduce in node``: a buffer all-reduced among the tasks of one node (a group per node),
  the median of ``REPS``, each started together after an untimed barrier; a node above
  ``allreduce_slowdown`` x the median node is slow (nodes of one task have none);
* ``all-reduce across nodes``: the first task of each node all-reduces with the first task of the
  next node (a ring of pairs, in rounds so that no node is in two pairs at once); a node's time is
  its faster pair's, so only a node whose every pair is slow is named — a slow link between two
  healthy nodes slows one pair of each. With two nodes there is one pair and nothing to compare.

"The median" is the lower median (``statistics.median_low``): with one slow node of two, the
healthy one is the measure. Every task all-gathers every measurement, so each reaches the same
verdict; rank 0 writes ``<run>/health/startup.jsonl`` (one line per start-up), prints it, and on
SLURM excludes the slow nodes (``exclusions.py``, up to ``slurm.max_excluded_nodes``) and
requeues the job; every rank then ends without training. Not on SLURM, with nothing left to
exclude, or with the requeue budget spent, the job trains on (the log says so).

The groups it creates are created by every rank in one order (no local synchronisation: the
process-group counts stay equal on every rank) and destroyed when the check ends. It adds about
a second on CPU and a few on GPUs (NCCL communicators for the new groups); ``seconds`` in the
record says how long it took.

Test-only fault hook: ``NANOTRAIN_TEST_SLOW_NODE=NODE[:FACTOR]`` makes the timed matmul and
all-reduces of the tasks on NODE take FACTOR (10) times as long: each such task sleeps, inside its
timer, FACTOR - 1 times what the operation took (after the operation: the peers' own timings stay
theirs, and the untimed barrier before each repetition absorbs the wait).
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.distributed as dist

from nanotrain.config.validate_slurm import health_enabled, max_excluded_nodes
from nanotrain.parallel.observe.nodes import NODES, node_name
from nanotrain.runtime import exclusions
from nanotrain.runtime.preemption import request_requeue, requeue_min_nodes

SLOW_NODE_ENV = "NANOTRAIN_TEST_SLOW_NODE"
STARTUP_FILE = exclusions.STARTUP_FILE
DEFAULT_TEST_FACTOR = 10.0
CHECKS = ("matmul", "all-reduce in node", "all-reduce across nodes")


@dataclass(frozen=True)
class Sizes:
    """What is timed: a ``matmul`` x ``matmul`` product, an all-reduce of ``numel`` elements."""

    matmul: int
    numel: int
    dtype: torch.dtype
    reps: int
    warmup: int


def sizes_for(device: torch.device) -> Sizes:
    """GPU: a 8192^3 bf16 matmul (1.1 TFLOP, ~2 ms on an H100) and 64 MiB all-reduced; CPU: 256^3
    float32 and 1 MiB (milliseconds on one core)."""
    if device.type == "cuda":
        return Sizes(matmul=8192, numel=32 * 2**20, dtype=torch.bfloat16, reps=8, warmup=2)
    return Sizes(matmul=256, numel=2**18, dtype=torch.float32, reps=8, warmup=1)


def slow_factor(node: str, environ=os.environ) -> float:
    """The test hook's factor for ``node`` (1.0: not the named node, or no hook)."""
    spec = environ.get(SLOW_NODE_ENV, "").strip()
    if not spec:
        return 1.0
    name, _, factor = spec.partition(":")
    if name != node:
        return 1.0
    try:
        value = float(factor) if factor else DEFAULT_TEST_FACTOR
    except ValueError:
        value = DEFAULT_TEST_FACTOR
    return max(1.0, value)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(op: Callable[[], object], device: torch.device, factor: float) -> float:
    _sync(device)
    t0 = time.perf_counter()
    op()
    _sync(device)
    took = time.perf_counter() - t0
    if factor > 1.0:  # the fault hook: this node's operation takes factor times as long
        time.sleep((factor - 1.0) * took)
        took = time.perf_counter() - t0
    return took


def time_matmul(device: torch.device, sizes: Sizes, factor: float) -> float:
    # Constant operands: a matmul's time does not depend on its values, and no random generator
    # (the training's own, seeded later) is touched.
    a = torch.full((sizes.matmul, sizes.matmul), 0.5, device=device, dtype=sizes.dtype)
    b = torch.full((sizes.matmul, sizes.matmul), 0.25, device=device, dtype=sizes.dtype)
    for _ in range(sizes.warmup):
        torch.mm(a, b)
    times = [_timed(lambda: torch.mm(a, b), device, factor) for _ in range(sizes.reps)]
    return statistics.median(times)


def time_all_reduce(group, device: torch.device, sizes: Sizes, factor: float) -> float:
    buf = torch.zeros(sizes.numel, device=device, dtype=sizes.dtype)  # zeros: a sum that never grows
    for _ in range(sizes.warmup):
        dist.all_reduce(buf, group=group)
    times = []
    for _ in range(sizes.reps):
        dist.barrier(group=group)  # untimed: every member starts the timed all-reduce together
        times.append(_timed(lambda: dist.all_reduce(buf, group=group), device, factor))
    return statistics.median(times)


def node_ranks(nodes: list[str]) -> dict[str, list[int]]:
    """node -> its global ranks, nodes in the order of their first rank."""
    out: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        out.setdefault(node, []).append(rank)
    return out


def ring_rounds(count: int) -> list[list[tuple[int, int]]]:
    """The ring of node pairs (i, i+1 mod count) in rounds where no node is in two pairs: two
    rounds for an even count, three for an odd one; one pair for two nodes, none for one."""
    if count < 2:
        return []
    if count == 2:
        return [[(0, 1)]]
    pairs = [(i, (i + 1) % count) for i in range(count)]
    rounds: list[list[tuple[int, int]]] = []
    for pair in pairs:
        for members in rounds:
            if not any(set(pair) & set(p) for p in members):
                members.append(pair)
                break
        else:
            rounds.append([pair])
    return rounds


def measure(pc, sizes: Sizes, nodes: list[str], factor: float) -> dict:
    """This task's three times (None where it takes no part), every group created by every rank
    in one order and destroyed before returning."""
    rank, device = dist.get_rank(), pc.device
    mine: dict = {"rank": rank, "node": nodes[rank], "matmul": time_matmul(device, sizes, factor)}
    groups = []
    timeout = getattr(pc, "timeout", None)  # the job's group timeout (after the hang watchdog's)
    try:
        by_node = node_ranks(nodes)
        node_group = None
        for ranks in by_node.values():
            if len(ranks) > 1:
                group = dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=False)
                groups.append(group)
                if rank in ranks:
                    node_group = group
        leaders = [ranks[0] for ranks in by_node.values()]
        rounds = [
            [(leaders[a], leaders[b], dist.new_group(ranks=[leaders[a], leaders[b]], timeout=timeout)) for a, b in ring]
            for ring in ring_rounds(len(leaders))
        ]
        groups += [g for members in rounds for _, _, g in members]
        dist.barrier()
        mine["all-reduce in node"] = time_all_reduce(node_group, device, sizes, factor) if node_group else None
        pair_times = []
        for members in rounds:
            dist.barrier()  # one round at a time: a node is in at most one pair per round
            for a, b, group in members:
                if rank in (a, b):
                    pair_times.append(time_all_reduce(group, device, sizes, factor))
        mine["all-reduce across nodes"] = min(pair_times) if pair_times else None
        dist.barrier()
    finally:
        for group in reversed(groups):
            if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(group)
        if device.type == "cuda":  # the operands and buffers (~0.45 GB) back to the device
            torch.cuda.empty_cache()
    return mine


def judge(results: list[dict], matmul_slowdown: float, allreduce_slowdown: float) -> dict:
    """The verdict from every task's times (``results[r]``: rank r's ``measure``): per check the
    lower median, the slowest ratio to it, the slow tasks or nodes; ``slow_nodes`` worst first."""
    limits = {"matmul": matmul_slowdown, "all-reduce in node": allreduce_slowdown}
    limits["all-reduce across nodes"] = allreduce_slowdown
    summary, slow = {}, []
    for check in CHECKS:
        if check == "matmul":
            values = [(r["node"], [r["rank"]], r["matmul"]) for r in results]
        else:  # one value per node: the median of its tasks' (one task each across nodes)
            per_node: dict[str, list] = {}
            for r in results:
                if r.get(check) is not None:
                    per_node.setdefault(r["node"], []).append((r["rank"], r[check]))
            values = [(n, [k for k, _ in v], statistics.median(t for _, t in v)) for n, v in per_node.items()]
        if len(values) < 2:
            continue
        median = statistics.median_low([t for _, _, t in values])
        worst = max(values, key=lambda v: v[2])
        summary[check] = {
            "median_s": median,
            "max_ratio": worst[2] / median if median > 0 else 1.0,
            "slowest": worst[0],
            "count": len(values),
        }
        for node, ranks, seconds in values:
            ratio = seconds / median if median > 0 else 1.0
            if ratio > limits[check]:
                slow.append(
                    {
                        "check": check,
                        "node": node,
                        "ranks": ranks,
                        "seconds": seconds,
                        "median_s": median,
                        "ratio": round(ratio, 3),
                        "limit": limits[check],
                    }
                )
    worst_by_node: dict[str, float] = {}
    for s in slow:
        worst_by_node[s["node"]] = max(worst_by_node.get(s["node"], 0.0), s["ratio"] / s["limit"])
    return {
        "checks": summary,
        "slow": slow,
        "slow_nodes": sorted(worst_by_node, key=lambda n: -worst_by_node[n]),
    }


FIELDS = {"matmul": "matmul_slowdown", "all-reduce in node": "allreduce_slowdown"}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def why(node: str, verdict: dict) -> str:
    """What was slow on ``node``, one phrase per check (its worst task for the matmul)."""
    parts = []
    for check in CHECKS:
        found = [s for s in verdict["slow"] if s["node"] == node and s["check"] == check]
        if not found:
            continue
        worst = max(found, key=lambda s: s["ratio"])
        ranks = sorted(r for s in found for r in s["ranks"])
        who = f" (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))})" if check == "matmul" else ""
        field = FIELDS.get(check, "allreduce_slowdown")
        parts.append(
            f"{check}{who} {_ms(worst['seconds'])} = {worst['ratio']:.1f}x the median {_ms(worst['median_s'])} "
            f"(slurm.health.{field} {worst['limit']:g})"
        )
    return "; ".join(parts)


def summary_line(verdict: dict, seconds: float, tasks: int, node_count: int) -> str:
    checks = verdict["checks"]
    measured = ", ".join(
        f"{name} {_ms(c['median_s'])} (slowest {c['max_ratio']:.2f}x the median)" for name, c in checks.items()
    )
    state = "ok" if not verdict["slow_nodes"] else f"slow: {', '.join(verdict['slow_nodes'])}"
    return f"health: {state} in {seconds:.1f} s: {node_count} node(s), {tasks} task(s)" + (
        f"; {measured}" if measured else "; nothing to compare (one task)"
    )


def health_check(pc, config, env, run_dir: Path) -> dict:
    """Measure on every task, gather, judge; rank 0 records and prints. Returns the verdict
    (the same on every rank) with ``seconds`` and the rank -> node map (also in ``NODES``)."""
    from nanotrain.checkpoint.comm import World

    world = World(pc)
    t0 = time.monotonic()
    here = node_name()
    nodes = world.all_gather(here)
    NODES.set(nodes)
    h = config.slurm.health
    sizes = sizes_for(pc.device)
    results = world.all_gather(measure(pc, sizes, nodes, slow_factor(here)))
    verdict = judge(results, h.matmul_slowdown, h.allreduce_slowdown)
    verdict["seconds"] = round(time.monotonic() - t0, 3)
    verdict["nodes"] = nodes
    if env.rank == 0:
        record = {
            "time": time.time(),
            "job_id": env.job_id,
            "restart": env.restart_count,
            "seconds": verdict["seconds"],
            "tasks": len(nodes),
            "node_count": len(set(nodes)),
            "checks": verdict["checks"],
            "slow": verdict["slow"],
            "slow_nodes": verdict["slow_nodes"],
            "sizes": {"matmul": sizes.matmul, "all_reduce_elements": sizes.numel, "dtype": str(sizes.dtype)},
            "results": results,
        }
        path = Path(run_dir) / exclusions.HEALTH_DIR / STARTUP_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")
        print(summary_line(verdict, verdict["seconds"], len(nodes), len(set(nodes))), flush=True)
        for node in verdict["slow_nodes"]:
            print(f"health: node {node} is slow: {why(node, verdict)}", flush=True)
    return verdict


def act_on_verdict(verdict: dict, config, env, run_dir: Path, broadcast) -> bool:
    """Rank 0 excludes the slow nodes and requeues the job (SLURM); every rank learns whether
    (``broadcast``: rank 0's object to all). True: requeued, do not train."""
    decision = False
    if env.rank == 0 and verdict["slow_nodes"]:
        decision = _exclude_and_requeue(verdict, config, env, run_dir)
    return bool(broadcast(decision))


def _exclude_and_requeue(verdict: dict, config, env, run_dir: Path) -> bool:
    slow = ", ".join(verdict["slow_nodes"])
    if env.launcher != "slurm":
        print(f"health: training on: not a SLURM job, so {slow} cannot be excluded", flush=True)
        return False
    limit = max_excluded_nodes(config)
    added = []
    for node in verdict["slow_nodes"]:
        ok, note = exclusions.add(run_dir, node, "health", why(node, verdict), limit, env.job_id, env.restart_count)
        print(f"health: node {node}: {note}", flush=True)
        added += [node] if ok else []
    if not added:
        print(f"health: training on {slow}: nothing new to exclude (slurm.max_excluded_nodes {limit})", flush=True)
        return False
    if env.restart_count >= config.slurm.max_requeues:
        print(
            f"health: training on: slurm.max_requeues ({config.slurm.max_requeues}) is spent; "
            f"{', '.join(added)} will be avoided by --resume",
            flush=True,
        )
        return False
    warning = exclusions.fit_warning(run_dir, limit, min_nodes=requeue_min_nodes())
    if warning:
        print(f"health: warning: {warning}", flush=True)
    print(f"health: requeueing job {env.job_id} without {', '.join(exclusions.excluded(run_dir, limit))}", flush=True)
    return request_requeue(config.slurm.max_requeues, run_dir, limit)


def startup_health(pc, config, env, run_dir: Path, broadcast) -> Optional[dict]:
    """The check when ``slurm.health`` is on (None when off); its verdict gets ``requeued``."""
    if not health_enabled(config):
        return None
    verdict = health_check(pc, config, env, run_dir)
    verdict["requeued"] = act_on_verdict(verdict, config, env, run_dir, broadcast)
    return verdict
