"""Start-up that scales: a rank's store traffic while ``ParallelContext`` builds its groups grows
with the groups that rank belongs to, never with the world or the number of groups in the grid.

Each rank wraps the job's real TCPStore in a counting ``Store`` (every group's store is a
``PrefixStore`` over it, so every operation of every group passes through it) and counts the
operations of the construction alone. gloo's rendezvous costs one ``set`` plus one ``wait`` and
one ``get`` per member of each group a rank joins; with ``TORCH_DIST_INIT_BARRIER=1`` each group
adds a barrier among its members only. A world-wide creation pattern (every rank calling
``new_group`` for every group) would instead add work for each of the grid's groups.
"""

import collections
import os
import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from nanotrain.parallel.grid import RankGrid

from helpers.dist import run_distributed

NAMES = ("world", "tp", "cp", "dp", "pp", "ep", "dp_cp", "mp")


def _counting_store(inner):
    import torch.distributed as dist

    class CountingStore(dist.Store):
        """Forwards to the TCPStore and counts what goes through it, by operation."""

        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def _count(self, op, *args):
            self.ops[op] += 1
            return getattr(inner, op)(*args)

        def set(self, key, value):
            return self._count("set", key, value)

        def get(self, key):
            return self._count("get", key)

        def add(self, key, n):
            return self._count("add", key, n)

        def check(self, keys):
            return self._count("check", keys)

        def compare_set(self, key, expected, desired):
            return self._count("compare_set", key, expected, desired)

        def delete_key(self, key):
            return self._count("delete_key", key)

        def num_keys(self):
            return self._count("num_keys")

        def set_timeout(self, timeout):
            return inner.set_timeout(timeout)

        def wait(self, keys, timeout=None):
            return self._count("wait", keys) if timeout is None else self._count("wait", keys, timeout)

    return CountingStore()


def count_store_ops(tp, pp, dp):
    """Count the store operations of two constructions with torch's init barrier on: the first
    of the process (locally synchronised), then a second after destroying it (the global
    fallback); check every group with a real all-reduce; return the counts."""
    import torch
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import ParallelContext

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    inner = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0, timeout=timedelta(seconds=60)
    )
    store = _counting_store(inner)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    os.environ["TORCH_DIST_INIT_BARRIER"] = "1"  # a store barrier after each new group
    out = {}
    for run in ("first", "again"):
        store.ops.clear()
        pc = ParallelContext(tensor_parallel_size=tp, pipeline_parallel_size=pp, data_parallel_size=dp)
        out[run] = {"ops": dict(store.ops), "local_sync": pc.local_sync}
        sums = {name: _rank_sum(pc.get_group(name)) for name in NAMES}
        if pc.embedding_pg is not None:
            sums["embedding"] = _rank_sum(pc.embedding_pg)
        # Every rank has registered as many groups: what a later locally synchronised group needs.
        n = torch.tensor([len(dist.distributed_c10d._world.pg_names)])
        everyone = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(everyone, n)
        out[run].update(sums=sums, registered=sorted({int(x) for x in everyone}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pc.destroy()  # every group freed (ParallelContext warns about any still alive)
        out[run]["warnings"] = [str(w.message) for w in caught]
    os.environ.pop("TORCH_DIST_INIT_BARRIER")
    return out


def _rank_sum(group) -> int:
    """Sum of the global ranks of a group, by a real all-reduce over it."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _my_groups(grid, rank):
    """This rank's distinct groups (the rank sets its context creates)."""
    groups = {grid.group_of(name, rank) for name in NAMES}
    pp_ranks = grid.group_of("pp", rank)
    first_last = tuple(sorted({pp_ranks[0], pp_ranks[-1]}))
    extra = [first_last if rank in first_last else (rank,)] if first_last not in groups else []
    return sorted(groups) + extra


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2), (2, 4, 2), (1, 3, 1)], ids=["8-ranks", "16-ranks", "odd-pp"])
def test_store_operations_grow_with_own_groups(tp, pp, dp):
    grid = RankGrid(tp=tp, pp=pp, dp=dp)
    results = run_distributed(count_store_ops, grid.world_size, tp, pp, dp, timeout=240)
    # Every group the grid has (what a world-wide creation pattern makes each rank handle):
    # the named ones (shared rank sets once) and the first/last stages'.
    sets = {g for n in NAMES for g in grid.groups(n)}
    embedding = {tuple(sorted({g[0], g[-1]})) for g in grid.groups("pp")} - sets
    grid_groups = len(sets) + len(embedding)
    for rank, out in enumerate(results):
        mine = _my_groups(grid, rank)
        n, members = len(mine), sum(map(len, mine))
        calls = n  # the new_group calls of this rank
        first, again = out["first"], out["again"]
        assert first["local_sync"] and not again["local_sync"]
        assert len(first["registered"]) == 1  # as many groups on every rank, for any later one
        # gloo's rendezvous: set own address, wait for and get each member's; the barrier:
        # two adds, one wait, and a set by whichever member arrives last, all on the group's
        # own keys. Nothing for any group this rank is not in.
        ops = first["ops"]
        assert (ops["add"], ops["wait"], ops["get"]) == (2 * calls, members + calls, members), (rank, ops)
        assert n <= ops["set"] <= n + calls and set(ops) == {"add", "wait", "get", "set"}, (rank, ops)
        # The global pattern, with the same barrier, meets the whole world at every grid group.
        assert again["ops"]["add"] >= 2 * grid_groups > 2 * n, (rank, again["ops"])
        for run in (first, again):
            assert run["warnings"] == [], (rank, run["warnings"])
            for name in NAMES:
                assert run["sums"][name] == sum(grid.group_of(name, rank))
            pp_ranks, i = grid.group_of("pp", rank), grid.coords(rank).pp
            if i in (0, pp - 1):
                assert run["sums"]["embedding"] == pp_ranks[0] + pp_ranks[-1]
    print(
        f"{grid.world_size} ranks, rank 0: {sum(results[0]['first']['ops'].values())} store operations "
        f"locally synchronised, {sum(results[0]['again']['ops'].values())} globally "
        f"({grid_groups} groups in the grid)"
    )


def test_counts_the_readme_states_for_16384_gpus():
    """The README's figures for tp8·pp8·dp256, from the grid arithmetic and the per-group costs
    measured above (gloo: 1 + 2 x size operations per group a rank joins)."""
    grid = RankGrid(tp=8, pp=8, dp=256)
    mine = _my_groups(grid, 0)
    ops = sum(1 + 2 * len(g) for g in mine)
    sets = {g for n in NAMES for g in grid.groups(n)}
    embedding = {tuple(sorted({g[0], g[-1]})) for g in grid.groups("pp")} - sets
    grid_groups = len(sets) + len(embedding)
    assert (len(mine), ops, ops - (1 + 2 * grid.world_size)) == (7, 33_453, 684)
    assert grid_groups == 22_849
    assert 3 * grid_groups == 68_547 and 3 * grid_groups * grid.world_size == 1_123_074_048
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for figure in ("33,453", "684", "22,849", "68,547", "1.1 billion"):
        assert figure in readme, figure
