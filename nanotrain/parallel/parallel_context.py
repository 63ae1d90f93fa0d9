"""ParallelContext: owns the torch.distributed process groups of the (ep, pp, dp, cp, tp) grid.

Same interface and rank layout as nanotron's ``ParallelContext`` (TP fastest), but it also runs
on CPU with gloo, so every parallel feature can be tested without GPUs. The rank arithmetic lives
in ``grid.py`` (pure Python); this file only turns it into process groups.

The groups are the real ``torch.distributed.ProcessGroup`` objects returned by ``new_group``, so
they work everywhere torch takes a group: collectives, ``DistributedDataParallel``, functional
collectives and C++ bindings. torch's own classes are left as they are: a group's global ranks
come from ``torch.distributed.get_process_group_ranks(pg)`` (nanotron's ``pg.ranks()``), or,
without asking torch, from ``ParallelContext.group_ranks(name)``.
"""

from __future__ import annotations

import importlib
import os
import weakref
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from nanotrain.parallel import accelerator
from nanotrain.parallel.grid import Coords, RankGrid
from nanotrain.parallel.observe.hang_record import HANG_RECORD
from nanotrain.parallel.teardown import check_freed, destroy_process_groups  # noqa: F401 (also the benchmarks')

# Group attributes created on every ParallelContext, in creation order: each rank creates its own
# group of each, in this order (torch names locally synchronised groups by their ranks and the
# number of groups the process created before, so the members' orders must agree).
GROUP_NAMES = ("world", "tp", "cp", "dp", "pp", "ep", "dp_cp", "dp_cp_ep", "mp")


class ParallelContext:
    """Process groups and coordinates of this rank in the 5D grid.

    Initialises ``torch.distributed`` from the environment (``RANK``, ``WORLD_SIZE``,
    ``MASTER_ADDR``, ``MASTER_PORT``) when it is not initialised yet, because that is the contract
    of every launcher we support (SLURM via submitit, torchrun, local processes). Every rank
    constructs it with the same sizes (collective: it creates every group); ``destroy()`` ends it.

    Args:
        tensor_parallel_size, pipeline_parallel_size, data_parallel_size, context_parallel_size,
            expert_parallel_size: the grid (``grid.py``); their product must be the world size.
        backend: ``nccl`` or ``gloo``; default nccl when CUDA is available, else gloo.
        timeout_s: every group's timeout (None: torch's default).

    Raises:
        RuntimeError: torch.distributed is not initialised and ``WORLD_SIZE`` is not set, or the
            node's GPUs are bound so that ranks would share one.
        ValueError: a size that is not an integer >= 1, sizes that do not multiply to the world
            size, or a ``backend`` other than the one torch.distributed was initialised with.
    """

    def __init__(
        self,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        data_parallel_size: int = 1,
        context_parallel_size: int = 1,
        expert_parallel_size: int = 1,
        backend: Optional[str] = None,
        timeout_s: Optional[float] = None,
    ):
        # The timeout of every group (``training.collective_timeout_s``): a rank that never
        # reaches a collective fails the others after this long instead of hanging the job.
        # new_group does not inherit it from the world group, so each group gets it explicitly.
        self.timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        self.grid = RankGrid(
            tp=tensor_parallel_size,
            cp=context_parallel_size,
            dp=data_parallel_size,
            pp=pipeline_parallel_size,
            ep=expert_parallel_size,
        )
        self.tensor_parallel_size = self.tp_size = self.grid.tp
        self.context_parallel_size = self.cp_size = self.grid.cp
        self.data_parallel_size = self.dp_size = self.grid.dp
        self.pipeline_parallel_size = self.pp_size = self.grid.pp
        self.expert_parallel_size = self.ep_size = self.grid.ep

        # Check the world size *before* rendezvous: a wrong product would otherwise surface as a
        # hang or a confusing reshape error on some ranks only.
        initialised = dist.is_available() and dist.is_initialized()
        if initialised:
            world_size = dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
        else:
            raise RuntimeError(
                "ParallelContext: torch.distributed is not initialised and WORLD_SIZE is not set; "
                "launch with `submit.py --local`, torchrun or srun (which set RANK, WORLD_SIZE, "
                "MASTER_ADDR, MASTER_PORT)"
            )
        self._check_world_size(world_size)
        self.world_size = world_size

        self.device = accelerator.stand_in_device() or self._select_device()  # rehearsal: its stand-in
        self._owns_init = not initialised
        if initialised:
            active = dist.get_backend()
            if backend is not None and backend not in str(active):
                raise ValueError(
                    f"ParallelContext(backend={backend!r}) but torch.distributed is already "
                    f"initialised with backend {active!r}"
                )
            self.backend = str(active)
        else:
            self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
            # Before the default group exists: torch._dynamo's import (which the optimizer, the
            # checkpoint code and others trigger lazily) takes references to an existing default
            # group that live until interpreter exit, so the group, its gloo threads and rank 0's
            # TCPStore server would outlive destroy() (see destroy_process_groups).
            importlib.import_module("torch._dynamo")
            # The CUDA device is already set above, which is what NCCL binds its communicators to.
            dist.init_process_group(
                backend=self.backend,
                init_method="env://",
                **({} if self.timeout is None else {"timeout": self.timeout}),
            )

        self.world_rank = dist.get_rank()
        coords = self.grid.coords(self.world_rank)
        self.ep_rank, self.pp_rank, self.dp_rank, self.cp_rank, self.tp_rank = coords
        self.coords: Coords = coords
        self._create_groups()
        self._create_embedding_group()

    # ------------------------------------------------------------------ setup
    def _check_world_size(self, world_size: int) -> None:
        g = self.grid
        if g.world_size == world_size:
            return
        msg = (
            f"ParallelContext: tp*cp*dp*pp*ep = {g.tp}*{g.cp}*{g.dp}*{g.pp}*{g.ep} = "
            f"{g.world_size}, but the world size is {world_size}. Launch {g.world_size} processes, "
            f"or change the parallel sizes so that their product is {world_size}"
        )
        non_dp = g.world_size // g.dp
        if world_size % non_dp == 0:
            msg += f" (e.g. data_parallel_size={world_size // non_dp})"
        raise ValueError(msg + ".")

    @staticmethod
    def _select_device() -> torch.device:
        """One GPU per process. Unambiguous only if each rank of the node sees all its GPUs
        (LOCAL_WORLD_SIZE of them: index LOCAL_RANK) or exactly one, or runs alone on it; a
        subset per task (``--gpu-bind=closest``) would give ranks of different subsets one
        physical GPU under ``LOCAL_RANK % device_count`` (NCCL: "Duplicate GPU detected"; else
        silently shared), so it is refused, naming the variables that show the mismatch."""
        if not torch.cuda.is_available():
            return torch.device("cpu")
        env = os.environ
        local_rank, visible = int(env.get("LOCAL_RANK", "0")), torch.cuda.device_count()
        local_world = int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
        if visible != 1 and local_world != 1 and visible != local_world:
            bound = ", ".join(
                f"{k}={env.get(k, '(unset)')}" for k in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_LOCALID")
            )
            raise RuntimeError(
                f"ParallelContext: LOCAL_RANK={local_rank} of LOCAL_WORLD_SIZE={local_world} ranks on this node "
                f"sees torch.cuda.device_count()={visible} GPUs ({bound}): every rank must see all of the "
                "node's GPUs (one per rank) or exactly one, or ranks would share a GPU. Fix: drop the "
                "per-task GPU binding (--gpu-bind, SLURM_GPU_BIND), use srun --gpus-per-task=1, or set "
                "CUDA_VISIBLE_DEVICES so each rank sees all of the node's GPUs or only its own"
            )
        index = 0 if visible == 1 or local_world == 1 else local_rank
        torch.cuda.set_device(index)
        return torch.device("cuda", index)

    def _new_group(self, ranks: tuple[int, ...]) -> Optional[dist.ProcessGroup]:
        """The group ``ranks``, created once per rank set; None where this rank is no member.

        Locally synchronised (``self.local_sync``): only the members call ``new_group`` and
        only they meet on the store (gloo's rendezvous, and the barrier when
        ``TORCH_DIST_INIT_BARRIER=1``), so a rank's start-up grows with the groups it belongs
        to, not with the world. torch names such a group by hashing its ranks with the number
        of groups this process has registered, so all members must have created equally many
        before it: the callers keep that count equal on every rank. Otherwise every rank calls
        this for every group, in one order (torch's global rule)."""
        pg = self._pg_by_ranks.get(ranks)
        if pg is None and (self.world_rank in ranks or not self.local_sync):
            pg = dist.new_group(ranks=list(ranks), timeout=self.timeout, use_local_synchronization=self.local_sync)
            self._pg_by_ranks[ranks] = pg
        return pg if self.world_rank in ranks else None

    def subgroup(self, ranks: tuple[int, ...]) -> Optional[dist.ProcessGroup]:
        """A further group (hybrid sharding's blocks), made and destroyed like the axes' ones."""
        return self._new_group(ranks)

    def _groups(self, name: str) -> list[tuple[int, ...]]:
        """The groups of ``name`` this rank must create: its own, or all of them (global)."""
        return [self.grid.group_of(name, self.world_rank)] if self.local_sync else self.grid.groups(name)

    def _create_groups(self) -> None:
        """Create this rank's group of every axis (and, without local sync, every other one).

        Local synchronisation needs names that were never used in this process: torch hashes
        a group's ranks with the count of live groups, which repeats once groups have been
        destroyed, and a repeated name finds the stale rendezvous keys of its predecessor
        (connection refused). So it is used when this context's world group is the first
        group the process creates after the default one (``group_count``: torch's count of
        sequentially named groups, which never decreases); a process that built and destroyed
        a context before (tests) falls back to the global pattern, as does a world initialised
        with a bound device (NCCL then splits every group from the world communicator, a
        collective of all ranks). Each rank then creates exactly one group per name, in
        ``GROUP_NAMES`` order; identical rank sets (e.g. ``dp_cp`` when cp == 1) share one
        group, as in nanotron, and which names coincide depends only on the axis sizes, so the
        counts stay equal on every rank.
        """
        self._pg_by_ranks: dict[tuple[int, ...], dist.ProcessGroup] = {}
        self._group_ranks: dict[str, tuple[int, ...]] = {}
        # With a device bound at init (``init_process_group(device_id=...)`` by a caller), NCCL
        # builds every group by splitting the world communicator, which all ranks must join.
        bound = getattr(dist.distributed_c10d._get_default_group(), "bound_device_id", None)
        fresh = getattr(dist.distributed_c10d._world, "group_count", None) == 1 and bound is None
        self.local_sync = False  # for "world" (first): every rank is a member; named sequentially
        for name in GROUP_NAMES:
            for ranks in self._groups(name):
                pg = self._new_group(ranks)
                if pg is not None:
                    self._group_ranks[name] = ranks
                    setattr(self, f"{name}_pg", pg)
                    HANG_RECORD.name_group(pg, name)  # hang reports say "dp", not "group"
            self.local_sync = fresh

    def _create_embedding_group(self) -> None:
        """``embedding_pg``: the first and the last pipeline stage of each pp group (Megatron's
        embedding group), which sum the gradients of tied embeddings. None on middle stages;
        the pp group itself when pp <= 2 (the two sets are equal).

        Locally synchronised with pp > 2, a middle stage creates a one-rank group in its place,
        used for nothing: every rank then has created the same number of groups once this
        context exists, as torch's hashed names need for any group created after it."""
        self.embedding_pg = self._placeholder_pg = None
        for pp_ranks in self._groups("pp"):
            pg = self._new_group(tuple(sorted({pp_ranks[0], pp_ranks[-1]})))
            if pg is not None:
                self.embedding_pg = pg
                HANG_RECORD.name_group(pg, "embedding")
        if self.embedding_pg is None and self.local_sync:
            self._placeholder_pg = dist.new_group(
                ranks=[self.world_rank], timeout=self.timeout, use_local_synchronization=True
            )

    # ------------------------------------------------------------------ queries
    def get_group(self, name: str) -> dist.ProcessGroup:
        """This rank's group by name: one of ``GROUP_NAMES``."""
        if name not in self._group_ranks:
            raise ValueError(f"unknown group {name!r}; known: {list(GROUP_NAMES)}")
        return getattr(self, f"{name}_pg")

    def group_ranks(self, name: str) -> tuple[int, ...]:
        """Global ranks of this rank's group ``name``, ascending (no communication)."""
        self.get_group(name)
        return self._group_ranks[name]

    def get_global_rank(
        self,
        ep_rank: int = 0,
        pp_rank: int = 0,
        dp_rank: int = 0,
        cp_rank: int = 0,
        tp_rank: int = 0,
    ) -> int:
        return self.grid.rank(ep=ep_rank, pp=pp_rank, dp=dp_rank, cp=cp_rank, tp=tp_rank)

    def get_local_ranks(self, world_rank: int) -> Coords:
        """Coordinates (ep, pp, dp, cp, tp) of a global rank; ``._asdict()`` gives nanotron's dict."""
        return self.grid.coords(world_rank)

    def _pp_neighbour(self, step: int) -> Optional[int]:
        pp = self.pp_rank + step
        if not 0 <= pp < self.pp_size:
            return None
        c = self.coords._replace(pp=pp)._asdict()
        return self.grid.rank(**c)

    @property
    def pp_prev_rank(self) -> Optional[int]:
        """Global rank of the previous pipeline stage (same ep/dp/cp/tp), None on the first."""
        return self._pp_neighbour(-1)

    @property
    def pp_next_rank(self) -> Optional[int]:
        """Global rank of the next pipeline stage (same ep/dp/cp/tp), None on the last."""
        return self._pp_neighbour(+1)

    @property
    def dense_replica_pg(self) -> dist.ProcessGroup:
        """The group over which the replicas of a dense (not expert-sharded) parameter average
        their gradients, and the replicas' losses are averaged: dp x cp x ep (``dp_cp_ep_pg``),
        the ranks that hold the same dense shard and read different samples or sequence chunks.
        It is ``dp_cp_pg`` when ep == 1; an expert shard's replicas are always ``dp_cp_pg``."""
        return self.dp_cp_ep_pg

    @property
    def data_rank(self) -> int:
        """Which slice of the global batch this rank reads: ep ranks read different samples (ep
        is part of the data-parallel degree of the dense layers), so ``ep_rank * dp + dp_rank``."""
        return self.ep_rank * self.dp_size + self.dp_rank

    @property
    def data_size(self) -> int:
        """Ranks reading different samples (``dp * ep``); cp ranks share theirs."""
        return self.ep_size * self.dp_size

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def __repr__(self) -> str:
        g = self.grid
        return (
            f"ParallelContext(rank={self.world_rank}/{self.world_size}, tp={g.tp} cp={g.cp} "
            f"dp={g.dp} pp={g.pp} ep={g.ep}, coords={tuple(self.coords)}, backend={self.backend})"
        )

    def destroy(self, synchronize: bool = True) -> None:
        """Tear down this context's process groups now, while the interpreter is fully alive.

        ``synchronize``: barrier first, so that no rank closes its sockets while a peer still
        communicates; pass False on an error path, where the peers may never reach it. Then the
        groups are destroyed (the default group too if this context initialised it) and this
        context drops its references; ``check_freed`` verifies that nothing else still holds
        one (see ``destroy_process_groups`` for why that matters). Callers drop the objects
        built on these groups (model, gradient sync, optimizer, engine) before calling this.
        """
        if not (dist.is_available() and dist.is_initialized()):
            return
        if synchronize:
            dist.barrier()
        HANG_RECORD.forget_groups()  # the hang record holds the last collective's group
        mine = [pg for ranks, pg in self._pg_by_ranks.items() if self.world_rank in ranks]
        mine += [self._placeholder_pg] if self._placeholder_pg is not None else []
        self._placeholder_pg = None
        self._pg_by_ranks.clear()
        self.__dict__.pop("_shard_groups", None)  # hybrid sharding's (data_parallel/hybrid.py)
        for name in GROUP_NAMES:
            setattr(self, f"{name}_pg", None)
        self.embedding_pg = None
        if self._owns_init:
            del mine
            destroy_process_groups(synchronize=False)
            return
        refs = [weakref.ref(pg) for pg in mine]
        while mine:  # reverse creation order; no loop variable left holding a group
            if mine[-1] is not dist.group.WORLD:
                dist.destroy_process_group(mine[-1])
            mine.pop()
        check_freed(refs)
