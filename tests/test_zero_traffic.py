"""Data-parallel bytes of one training step: ZeRO-1 moves one DDP all-reduce's worth, not 1.5x.

In real gloo ranks, torch.distributed's collectives are wrapped and every call on a data-parallel
group (``pc.dp_cp_pg``, ``pc.dp_cp_ep_pg``) is charged what a ring moves per rank: an all-reduce
2(n-1)/n of its bytes, a reduce-scatter (n-1)/n of its input, an all-gather (n-1)/n of its
output. The gradient traffic of a step must be at most 2(n-1)/n of the fp32 gradient bytes of
the rank's parameters in each gradient sync's group (plus the padding of its buckets to a
multiple of n, under n elements each). Besides it only scalars cross the dp groups, by name: the
gradient norm's 2-element sum of squares (``nanotrain.optim.clip``, one per sync, ZeRO-1 only)
and the loss for logging (``nanotrain.training.step``). The first step of a run still
also all-gathers the reduced gradients (they stay whole until the optimizer's first update,
``grad_sync.py``): the second step is the one measured.

One launch of 4 ranks runs dp4, dp2 x tp2 and dp2 x ep2 (MoE: dense parameters over dp x ep,
experts over dp). Each trains the same two steps with ZeRO-0 too, whose traffic is the all-reduce
alone and whose gradient norms ZeRO-1's sharded norm must reproduce; then an inf in one rank's
gradient must make every rank's norm non-finite (what the trainer's stop vote looks at), and the
offline resharder's ranges (``reshard.optimizer_ranges``) must be the ones the optimizer holds.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import pytest
import torch

from helpers.dist import run_distributed
from helpers.models import GLOBAL_BATCH, MICRO_BATCH, MODEL, OPTIM, global_batch

WRAPPED = {  # torch.distributed function -> (kind, position of the tensor whose bytes count)
    "all_reduce": ("all_reduce", 0),
    "reduce_scatter_single": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 1),
    "all_gather_single": ("all_gather", 0),
    "all_gather_into_tensor": ("all_gather", 0),
    "all_gather": ("all_gather_list", 1),
    "broadcast": ("broadcast", 0),
}
SCALAR_CALLERS = {"nanotrain.optim.clip", "nanotrain.training.step"}


def _caller() -> str:
    """The module that called the collective (through ``nanotrain.parallel.collectives``)."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__") == "nanotrain.parallel.collectives":
        frame = frame.f_back
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


def _install(groups: list, calls: list) -> dict:
    """Wrap torch.distributed's collectives; every call on one of ``groups`` appends
    (kind, bytes moved per rank, numel, caller) to ``calls``. Returns the originals."""
    import torch.distributed as dist

    def wrap(name, fn):
        kind, arg = WRAPPED[name]

        def counted(*args, **kwargs):
            group = kwargs.get("group")
            if any(group is g for g in groups):
                t = args[arg]
                t = t if torch.is_tensor(t) else torch.cat([x.reshape(-1) for x in t])
                n = dist.get_world_size(group)
                share = (2 if kind == "all_reduce" else 1) * (n - 1) / n
                calls.append((kind, share * t.numel() * t.element_size(), t.numel(), _caller()))
            return fn(*args, **kwargs)

        return counted

    originals = {name: getattr(dist, name) for name in WRAPPED if hasattr(dist, name)}
    for name, fn in originals.items():
        setattr(dist, name, wrap(name, fn))
    return originals


def _two_steps(pc, zero: int) -> dict:
    import torch.distributed as dist

    from nanotrain.config import MoEArgs
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer, clip_grad_norm_, optimizer_groups
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.training.step import train_step

    ep = pc.ep_size
    args = (
        MODEL
        if ep == 1
        else dataclasses.replace(MODEL, moe=MoEArgs(num_experts=4, top_k=2, expert_intermediate_size=32))
    )
    model = build_llama(args, pc.tp_pg, seed=5, ep_pg=pc.ep_pg)
    # The trainer's construction (build_grad_sync, then build_optimizer); small buckets: several
    grad_sync = build_grad_sync(list(model.parameters()), pc, bucket_cap_mb=0.05)
    optimizer = build_optimizer(model.named_parameters(), OPTIM, zero_stage=zero, **optimizer_groups(pc))
    scheduler = build_lr_scheduler(optimizer, OPTIM, 10)
    syncs = getattr(grad_sync, "syncs", [grad_sync])
    logs = {id(s): [] for s in syncs}  # each sync's launch log, taken before train_step zeroes it
    for s in syncs:
        s.zero_grad = functools.partial(
            lambda s, zero_grad: (logs[id(s)].append(list(s.launch_log)), zero_grad())[1], s, s.zero_grad
        )
    per_rank = GLOBAL_BATCH // (pc.dp_size * ep)
    out: dict = {"norms": [], "calls": []}
    for step in range(2):
        calls: list = []
        originals = _install([pc.dp_cp_pg, pc.dp_cp_ep_pg], calls)
        try:
            rows = global_batch(step)[pc.data_rank * per_rank : (pc.data_rank + 1) * per_rank]
            stats = train_step(
                model,
                [(mb[:, :-1], mb[:, 1:]) for mb in rows.split(MICRO_BATCH)],
                grad_sync,
                optimizer,
                scheduler,
                pc,
                OPTIM.clip_grad,
            )
            out["norms"].append(stats.grad_norm)
        finally:
            for name, fn in originals.items():
                setattr(dist, name, fn)
        out["calls"].append(calls)
    out["syncs"] = [
        {  # per gradient sync: group size, fp32 gradient bytes, padding, overlap
            "n": s.world_size,
            "grad_bytes": sum(4 * p.numel() for p in s.params),
            "padding": [b.buffer.numel() - sum(p.numel() for p in b.params) for b in s.buckets],
            "from_hooks": [from_hook for *_, from_hook in logs[id(s)][-1]],
            "n_buckets": len(s.buckets),
            "first_launch_at": logs[id(s)][-1][0][1],
            "sharded": s.shards == s.world_size and s.grad_shards() is not None,
            "hooks_per_step": len(s.params) * per_rank // MICRO_BATCH,  # one per parameter and micro-batch
        }
        for s in syncs
    ]
    # The offline resharder computes the same ranges from the sizes alone (same bucket size).
    from nanotrain.checkpoint.reshard import optimizer_ranges

    offline = optimizer_ranges(model, zero, pc.dp_size, pc.dp_rank, ep, pc.ep_rank, bucket_cap_mb=0.05)
    out["offline_ranges_match"] = {n: (a, b) for n, a, b in offline} == (
        optimizer.param_ranges() if zero else {n: (0, p.numel()) for n, p in model.named_parameters()}
    )
    # Non-finite detection: an inf on the last dp rank, in an element the first one owns (the
    # first piece of bucket 0), reaches every rank's norm through the owner's reduced piece.
    rows = global_batch(2)[pc.data_rank * per_rank : (pc.data_rank + 1) * per_rank]
    with grad_sync.no_sync():
        model(rows[:, :-1], rows[:, 1:]).backward()
    if pc.dp_rank == pc.dp_size - 1:
        syncs[0].buckets[0].params[0].grad.view(-1)[0] = float("inf")
    grad_sync.finish_grad_sync()
    out["inf_norm"] = clip_grad_norm_(model.parameters(), OPTIM.clip_grad, pc, grad_sync.grad_shards()).item()
    grad_sync.zero_grad()
    return out


LAYOUTS = [(4, 1, 1), (2, 2, 1), (2, 1, 2)]  # (dp, tp, ep)


def _traffic_worker() -> dict:
    from nanotrain.parallel.parallel_context import ParallelContext

    out = {}
    for dp, tp, ep in LAYOUTS:  # the contexts live until the rank exits (the first owns the world)
        pc = ParallelContext(data_parallel_size=dp, tensor_parallel_size=tp, expert_parallel_size=ep)
        out[(dp, tp, ep)] = {zero: _two_steps(pc, zero) for zero in (0, 1)}
    return out


@functools.lru_cache(maxsize=None)
def traffic() -> list[dict]:
    return run_distributed(_traffic_worker, 4, timeout=240)


def _moved(calls) -> float:
    return sum(c[1] for c in calls if c[2] > 2)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dp,tp,ep", LAYOUTS, ids=["dp4", "dp2-tp2", "dp2-ep2"])
def test_zero1_moves_one_all_reduce_of_gradient_bytes(dp, tp, ep):
    for rank, res in enumerate(traffic()):
        zero0, zero1 = res[(dp, tp, ep)][0], res[(dp, tp, ep)][1]
        assert len(zero1["syncs"]) == (2 if ep > 1 else 1)  # with experts: dense and expert syncs
        ddp = sum(2 * (s["n"] - 1) / s["n"] * s["grad_bytes"] for s in zero1["syncs"])
        bound = sum(2 * (s["n"] - 1) / s["n"] * (s["grad_bytes"] + 4 * sum(s["padding"])) for s in zero1["syncs"])
        for s in zero1["syncs"]:
            assert s["sharded"], "the optimizer did not take over the gradient sync"
            assert s["n_buckets"] > 1 and all(0 <= pad < s["n"] for pad in s["padding"]), s
            assert all(s["from_hooks"]), "the reduce-scatters must be posted from the backward hooks"
            assert s["first_launch_at"] < s["hooks_per_step"], "the first reduce-scatter must overlap backward"
        for label, run, limit in (("zero0", zero0, ddp), ("zero1", zero1, bound)):
            calls = run["calls"][1]
            assert _moved(calls) <= limit, (rank, label, _moved(calls) / ddp)
            scalars = [c for c in calls if c[2] <= 2]
            assert all(c[0] == "all_reduce" and c[3] in SCALAR_CALLERS for c in scalars), scalars
            norm_sums = [c for c in scalars if c[3] == "nanotrain.optim.clip"]
            assert len(norm_sums) == (len(zero1["syncs"]) if label == "zero1" else 0), scalars
        assert _moved(zero0["calls"][1]) == pytest.approx(ddp)  # ZeRO-0: the all-reduce, unchanged
        assert {c[0] for c in zero1["calls"][1] if c[2] > 2} == {"reduce_scatter", "all_gather"}
        torch.testing.assert_close(torch.tensor(zero1["norms"]), torch.tensor(zero0["norms"]), rtol=1e-5, atol=0)
        assert zero1["inf_norm"] == float("inf") and zero0["inf_norm"] == float("inf"), rank
        assert zero1["offline_ranges_match"] and zero0["offline_ranges_match"], rank
        if rank == 0:
            print(
                f"dp{dp} tp{tp} ep{ep}: dp bytes / DDP all-reduce bytes, ZeRO-0 "
                f"{_moved(zero0['calls'][1]) / ddp:.5f}, ZeRO-1 first step {_moved(zero1['calls'][0]) / ddp:.5f}, "
                f"ZeRO-1 {_moved(zero1['calls'][1]) / ddp:.5f}"
            )
