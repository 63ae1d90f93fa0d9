"""A rank's process groups torn down for good, and the check that they are gone.

``destroy_process_groups`` (and ``ParallelContext.destroy``) end a rank's groups; ``check_freed``
lets go of what torch itself keeps of them, then warns about any group something still
references: its C++ threads would be torn down during interpreter shutdown, which is where a gloo
rank dies with "terminate called without an active exception" once in a while.

What torch keeps: dynamo stores each graph it compiles as a global of the compiled function's
module (``__compiled_fn_<n>_<uuid>`` in ``nanotrain.models.llama``, for a decoder layer), and the
graph holds the objects it traced as constants, the tensor-parallel group of the column/row
linears' autograd functions among them. ``torch._dynamo.reset()`` empties the code caches but
leaves those globals; ``forget_compiled_graphs`` drops them from nanotrain's modules (the next
compile makes new ones).
"""

from __future__ import annotations

import gc
import sys
import warnings
import weakref

import torch.distributed as dist

from nanotrain.parallel.observe.hang_record import HANG_RECORD


def destroy_process_groups(synchronize: bool = True) -> None:
    """Destroy every process group of this process, the default one last, and check that they
    are really gone: the one clean way for a rank to end.

    Why not just ``dist.destroy_process_group()``: it unregisters the groups but frees none
    that something else still references. A gloo group owns C++ threads (its work loop and
    socket loop) and, through its store, rank 0's TCPStore server thread; they stop only when the
    group object is freed. A group kept by a live object (a model's layers, a gradient sync, an
    autograd graph no collector can free) is freed by the interpreter's final garbage collection,
    after Python is already marked as finalizing, or never: its threads then run on through the
    interpreter's teardown and ``exit()``, which is where a gloo rank dies with "terminate called
    without an active exception" (SIGABRT) once in a while.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if synchronize:
        dist.barrier()
    HANG_RECORD.forget_groups()  # the hang record holds the last collective's group
    # Every registered group (ours, DeviceMesh's, ...); a private map, so read defensively.
    registered = list(getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", {}))
    refs = [weakref.ref(pg) for pg in registered]
    del registered
    dist.destroy_process_group()
    check_freed(refs)


def check_freed(refs: list) -> None:
    """Warn (once per call, naming them) about process groups that survive their destruction.

    A warning and not an error: the run itself succeeded. ``benchmarks/exit_stress.py`` and the
    tests treat it as a failure."""
    forget_compiled_graphs()  # compiled layers' graphs hold the groups they traced (tp's)
    gc.collect()  # plain Python cycles (a module and its hooks) are not a leak
    alive = [pg for pg in (r() for r in refs) if pg is not None]
    if alive:
        names = ", ".join(f"{getattr(pg, 'group_name', '?')} (size {pg.size()})" for pg in alive)
        warnings.warn(
            f"{len(alive)} process group(s) still referenced after destroy: {names}. Their C++ "
            "threads outlive the process group and are torn down during interpreter shutdown, "
            "which can abort the process; drop what holds them (model, gradient sync, optimizer, "
            "autograd graphs) before destroying the groups.",
            RuntimeWarning,
            stacklevel=3,
        )


_PREFIXES = ("__compiled_fn", "__resume_at")  # dynamo's names for a graph and a graph break's rest


def forget_compiled_graphs() -> int:
    """Reset dynamo and drop its compiled graphs from nanotrain's modules; returns how many (0,
    and nothing touched, when nothing was ever compiled in this process)."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return 0
    dropped = 0
    for name, module in list(sys.modules.items()):
        if name == "nanotrain" or name.startswith("nanotrain."):
            names = [k for k in vars(module) if k.startswith(_PREFIXES)]
            for k in names:
                delattr(module, k)
            dropped += len(names)
    if dropped:
        dynamo.reset()
    return dropped
