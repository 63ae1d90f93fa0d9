"""ParallelContext in real gloo process groups, plus the run_distributed harness itself.

Multi-process launches are expensive on a small CPU box (each rank imports torch), so there is one
16-rank launch that does every check of the 3D layout, one 4-rank launch for cp/ep, and two tiny
launches that prove the harness turns failures and hangs into prompt test failures.
"""

import os
import time

import numpy as np
import pytest

from nanotrain.parallel.grid import RankGrid

from helpers.dist import run_distributed

GROUPS = ("world", "tp", "cp", "dp", "pp", "ep", "dp_cp", "mp")


# ----------------------------------------------------------------------------- rank functions
def _inspect(pc):
    """Everything the parent needs to check one rank, gathered through real collectives."""
    import torch
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    out = {"rank": rank, "coords": tuple(pc.coords), "groups": {}}
    for name in GROUPS:
        pg = getattr(pc, f"{name}_pg")
        onehot = torch.zeros(world)
        onehot[rank] = 1.0
        dist.all_reduce(onehot, group=pg)  # membership as seen by the communicator itself
        total = torch.tensor([float(rank)])
        dist.all_reduce(total, group=pg)
        out["groups"][name] = {
            "ranks": dist.get_process_group_ranks(pg),
            "members": [int(i) for i in torch.nonzero(onehot).flatten()],
            "sum": int(total.item()),
            "group_rank": dist.get_rank(pg),
            "group_size": dist.get_world_size(pg),
            "group_ranks_attr": list(pc.group_ranks(name)),
        }
    out["sizes"] = (pc.ep_size, pc.pp_size, pc.dp_size, pc.cp_size, pc.tp_size)
    out["ranks_by_attr"] = (pc.ep_rank, pc.pp_rank, pc.dp_rank, pc.cp_rank, pc.tp_rank)
    out["global_from_coords"] = pc.get_global_rank(
        ep_rank=pc.ep_rank,
        pp_rank=pc.pp_rank,
        dp_rank=pc.dp_rank,
        cp_rank=pc.cp_rank,
        tp_rank=pc.tp_rank,
    )
    out["local_ranks"] = tuple(pc.get_local_ranks(rank))
    out["pp_prev"], out["pp_next"] = pc.pp_prev_rank, pc.pp_next_rank
    out["first"], out["last"] = pc.is_pipeline_first_stage, pc.is_pipeline_last_stage
    out["device"], out["backend"] = str(pc.device), pc.backend
    out["threads"] = torch.get_num_threads()  # run_distributed pins one thread per rank
    return out


def seed_snippet_16():
    """The nanotron seed snippet (its ``pg.ranks()`` is ``get_process_group_ranks``), then
    every check on the same context."""
    import torch
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=4)
    ranks = dist.get_process_group_ranks  # nanotron's pg.ranks()
    print(ranks(pc.tp_pg))
    print(ranks(pc.pp_pg))
    print(ranks(pc.dp_pg))
    out = _inspect(pc)
    out["snippet"] = (ranks(pc.tp_pg), ranks(pc.pp_pg), ranks(pc.dp_pg))

    # The groups are real ProcessGroups: C++-typed consumers such as DDP accept them.
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2), process_group=pc.dp_pg)
    model(torch.full((1, 3), float(pc.dp_rank + 1))).sum().backward()
    out["ddp_grad"] = model.module.weight.grad.tolist()  # mean over dp of (dp_rank + 1) = 2.5

    try:
        ParallelContext(tensor_parallel_size=2, pipeline_parallel_size=2, data_parallel_size=2)
    except ValueError as e:
        out["mismatch"] = str(e)
    pc.destroy()
    out["destroyed"] = not dist.is_initialized()
    return out


def preinitialised_cp_ep_4():
    """cp=2 x ep=2 on a world that the caller initialised itself (destroy() keeps it alive)."""
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import ParallelContext

    dist.init_process_group("gloo")
    pc = ParallelContext(context_parallel_size=2, expert_parallel_size=2, backend="gloo")
    out = _inspect(pc)
    pc.destroy()
    out["default_alive"] = dist.is_initialized()
    dist.barrier()
    return out


def fail_on_rank_1(pid_dir):
    import torch.distributed as dist

    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        raise RuntimeError("deliberate failure on rank 1")
    dist.barrier()  # rank 0 would wait here forever
    time.sleep(600)


def sleep_forever(pid_dir):
    open(os.path.join(pid_dir, str(os.getpid())), "w").close()
    time.sleep(600)


# ----------------------------------------------------------------------------- checks
def _check(results, grid):
    assert [r["rank"] for r in results] == list(range(grid.world_size))
    for r, out in enumerate(results):
        coords = grid.coords(r)
        assert out["coords"] == tuple(coords) == out["ranks_by_attr"] == out["local_ranks"]
        assert out["sizes"] == tuple(grid.sizes)
        assert out["global_from_coords"] == r
        for name in GROUPS:
            expected = list(grid.group_of(name, r))
            got = out["groups"][name]
            assert got["ranks"] == got["members"] == got["group_ranks_attr"] == expected, (r, name)
            assert got["sum"] == sum(expected)
            assert got["group_rank"] == expected.index(r) and got["group_size"] == len(expected)
        pp = grid.group_of("pp", r)
        i = pp.index(r)
        assert out["pp_prev"] == (pp[i - 1] if i > 0 else None)
        assert out["pp_next"] == (pp[i + 1] if i + 1 < len(pp) else None)
        assert out["first"] == (i == 0) and out["last"] == (i == len(pp) - 1)
        assert out["device"] == "cpu" and out["backend"] == "gloo"
        assert out["threads"] == 1


def _assert_dead(pid_dir):
    pids = [int(p) for p in os.listdir(pid_dir)]
    assert pids, "the ranks never started"
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(300)
def test_seed_snippet_16_ranks():
    t0 = time.monotonic()
    results = run_distributed(seed_snippet_16, 16, timeout=240)
    grid = RankGrid(tp=2, pp=2, dp=4)
    _check(results, grid)

    # The snippet's answers, independently from numpy: arange(16).reshape(ep, pp, dp, cp, tp).
    mat = np.arange(16).reshape(1, 2, 4, 1, 2)
    for r, out in enumerate(results):
        e, p, d, c, t = (int(i[0]) for i in np.nonzero(mat == r))
        tp, pp, dp = out["snippet"]
        assert tp == mat[e, p, d, c, :].tolist()
        assert pp == mat[e, :, d, c, t].tolist()
        assert dp == mat[e, p, :, c, t].tolist()
        assert out["ddp_grad"] == [[2.5] * 3] * 2
        assert out["destroyed"]
        msg = out["mismatch"]
        assert "= 8" in msg and "world size is 16" in msg and "data_parallel_size=4" in msg
    assert results[13]["snippet"] == ([12, 13], [5, 13], [9, 11, 13, 15])
    print(f"16-rank launch: {time.monotonic() - t0:.1f} s")


@pytest.mark.timeout(200)
def test_cp_ep_on_preinitialised_world():
    results = run_distributed(preinitialised_cp_ep_4, 4, timeout=150)
    grid = RankGrid(cp=2, ep=2)
    _check(results, grid)
    assert results[0]["groups"]["dp_cp"]["ranks"] == [0, 1]  # cp neighbours
    assert results[0]["groups"]["mp"]["ranks"] == [0, 2]  # ep x pp x tp at fixed (dp, cp)
    assert all(out["default_alive"] for out in results)


def test_world_size_mismatch_before_rendezvous(monkeypatch):
    """Raised from the environment alone: no process group is ever initialised here."""
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import ParallelContext

    assert not dist.is_initialized()
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match=r"tp\*cp\*dp\*pp\*ep = 3\*1\*1\*1\*1 = 3, but the world size is 4"):
        ParallelContext(tensor_parallel_size=3)
    with pytest.raises(ValueError, match=r"data_parallel_size=2"):
        ParallelContext(tensor_parallel_size=2, data_parallel_size=4)
    with pytest.raises(ValueError, match=">= 1"):
        ParallelContext(tensor_parallel_size=0)
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(RuntimeError, match="WORLD_SIZE is not set"):
        ParallelContext()
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
def test_harness_failing_rank_kills_all(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError) as info:
        run_distributed(fail_on_rank_1, 2, str(tmp_path), timeout=90)
    text = str(info.value)
    assert "rank 1 failed first" in text and "deliberate failure on rank 1" in text
    assert "Traceback" in text and "fail_on_rank_1" in text
    assert time.monotonic() - t0 < 60, "a failing rank must not wait for the timeout"
    _assert_dead(tmp_path)


@pytest.mark.timeout(60)
def test_harness_hang_is_a_failure(tmp_path):
    t0 = time.monotonic()
    with pytest.raises(AssertionError, match="timed out after 8 s") as info:
        run_distributed(sleep_forever, 1, str(tmp_path), timeout=8)
    assert time.monotonic() - t0 < 20
    assert "sleep_forever" in str(info.value)  # faulthandler shows where the rank hung
    _assert_dead(tmp_path)


def groups_freed_on_destroy_2():
    """dp2 with what the trainer builds on the groups: a model, its gradient sync (whose hooks
    live in C++ autograd metadata), an optimizer, one step. Once they are dropped, destroy()
    must free every group: a group that survives keeps gloo threads alive into interpreter
    shutdown, where a rank can abort ("terminate called without an active exception")."""
    import warnings

    import torch

    from nanotrain.config import ModelArgs, OptimizerArgs
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.training.step import train_step

    pc = ParallelContext(data_parallel_size=2)
    args = ModelArgs(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=16,
    )
    model = build_llama(args, pc.tp_pg, seed=0)
    grad_sync = BucketedGradSync(list(model.parameters()), pc.dp_cp_pg)
    optim_args = OptimizerArgs(lr=1e-3, warmup_steps=0)
    optimizer = build_optimizer(model.named_parameters(), optim_args, pc.dp_cp_pg)
    scheduler = build_lr_scheduler(optimizer, optim_args, 2)
    ids = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(pc.dp_rank))
    train_step(model, [(ids[:, :-1], ids[:, 1:])], grad_sync, optimizer, scheduler, pc, 1.0)
    del model, grad_sync, optimizer, scheduler
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pc.destroy()
    threads = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task"))
    return {"warnings": [str(w.message) for w in caught], "threads": threads}


@pytest.mark.timeout(180)
def test_destroy_frees_every_group():
    for rank, out in enumerate(run_distributed(groups_freed_on_destroy_2, 2, timeout=150)):
        assert out["warnings"] == [], (rank, out["warnings"])
        leftover = [t for t in out["threads"] if t.startswith(("pt_gloo", "gloo_", "pt_tcpstore"))]
        assert leftover == [], (rank, leftover)  # the groups' C++ threads (and the store's) are gone
