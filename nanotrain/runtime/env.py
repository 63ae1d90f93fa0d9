"""Map whatever launched this process (SLURM, torchrun, our local launcher, nothing) to the
`RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT` variables of torch's `env://` init.

Why submitit for SLURM: its `JobEnvironment` already parses SLURM's variables and node lists
(`n[1-4,7]`), and `TorchDistributedEnvironment` derives MASTER_PORT from the job id, so every task
of a job (and of its requeued restarts) agrees on the rendezvous without talking to each other.
We never let it rewrite CUDA_VISIBLE_DEVICES: when SLURM binds GPUs per node every task sees all
of the node's GPUs and picks `LOCAL_RANK` itself (see ParallelContext).
"""

from __future__ import annotations

import os
import random
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

_RENDEZVOUS_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class DistEnv:
    launcher: str  # "slurm" | "torchrun" | "local" | "single"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    node_rank: int
    num_nodes: int
    job_id: str | None = None
    restart_count: int = 0


def detect_launcher(environ: Mapping[str, str] | None = None) -> str:
    """torchrun wins over SLURM (`srun torchrun` sets both); our local launcher marks itself."""
    environ = os.environ if environ is None else environ  # read at call time, never bound early
    if "TORCHELASTIC_RUN_ID" in environ or "TORCHELASTIC_RESTART_COUNT" in environ:
        return "torchrun"
    if environ.get("NANOTRAIN_LAUNCHER") == "local":
        return "local"
    if "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ:
        return "slurm"
    if all(v in environ for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):
        return "torchrun"  # any launcher that already speaks env://
    return "single"


def free_port() -> int:
    """A port free right now on this host, below the kernel's ephemeral range (the local
    launcher hands it to every rank; rank 0's store binds it moments later).

    Why not port 0's answer: that is an ephemeral port, and between this check and rank 0's
    bind the kernel may hand the same port to any other process's socket (another job's gloo
    pairs open dozens each), so rank 0 failed now and then with EADDRINUSE. Ports below the
    ephemeral range are only ever taken by an explicit bind, and this one is drawn at random."""
    low = _ephemeral_low()
    candidates = list(range(max(1024, low - 12000), low))
    random.SystemRandom().shuffle(candidates)
    for port in candidates[:200]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # all taken: the kernel's choice
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range (Linux; 32768, its default, elsewhere)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def export_user_env(variables: Mapping[str, str]) -> None:
    """`slurm.env` (NCCL_*, InfiniBand...) must be in the environment before NCCL initialises."""
    for key, value in variables.items():
        os.environ[key] = str(value)


def _from_slurm() -> DistEnv:
    import submitit.helpers

    os.environ.setdefault("SUBMITIT_EXECUTOR", "slurm")  # lets a plain srun use submitit's parser
    # Variables inherited from the submitting shell (sbatch exports its environment) must not
    # override what the job derives: another job's MASTER_PORT would deadlock the rendezvous.
    for var in _RENDEZVOUS_VARS:
        if var != "MASTER_PORT" or "NANOTRAIN_MASTER_PORT" not in os.environ:
            os.environ.pop(var, None)
    if "NANOTRAIN_MASTER_PORT" in os.environ:
        os.environ["MASTER_PORT"] = os.environ["NANOTRAIN_MASTER_PORT"]
    tde = submitit.helpers.TorchDistributedEnvironment().export(set_cuda_visible_devices=False, overwrite=True)
    job = tde._job_env
    return DistEnv(
        "slurm",
        tde.rank,
        tde.world_size,
        tde.local_rank,
        tde.local_world_size,
        tde.master_addr,
        int(tde.master_port),
        job.node,
        job.num_nodes,
        job.job_id,
        int(os.environ.get("SLURM_RESTART_COUNT", "0")),
    )


def _from_variables(launcher: str) -> DistEnv:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    # ParallelContext picks the rank's GPU from these two; a launcher that sets only the env://
    # four (RANK, WORLD_SIZE, MASTER_*) gets the same reading of them as this DistEnv's.
    os.environ.setdefault("LOCAL_RANK", str(local_rank))
    os.environ.setdefault("LOCAL_WORLD_SIZE", str(local_world))
    return DistEnv(
        launcher,
        rank,
        world,
        local_rank,
        local_world,
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ.get("GROUP_RANK", rank // local_world)),
        max(1, world // local_world),
        os.environ.get("TORCHELASTIC_RUN_ID"),
        int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )


def _single() -> DistEnv:
    port = free_port()
    os.environ.update(
        {
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
    )
    return DistEnv("single", 0, 1, 0, 1, "127.0.0.1", port, 0, 1)


def setup_distributed_env() -> DistEnv:
    """Export torch's env:// variables for this process and describe where it sits."""
    launcher = detect_launcher()
    if launcher == "slurm":
        return _from_slurm()
    if launcher in ("torchrun", "local"):
        return _from_variables(launcher)
    return _single()
