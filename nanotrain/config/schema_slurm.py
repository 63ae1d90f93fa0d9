"""The ``slurm:`` section of the config schema: the job a config becomes (nodes, tasks, time,
requeues, the signal before the limit), the CPU job of ``--prepare-data`` and the nodes' health
check. Re-exported by ``schema.py`` with the other sections."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from nanotrain.config.fields import bounded, doc, slurm_time


@dataclass
class PrepareArgs:
    """`slurm.prepare`: the CPU-only job of `submit.py CONFIG --prepare-data`."""

    partition: Optional[str] = doc(None, "SLURM partition; default slurm.partition")
    cpus: int = bounded(4, 1, 65536, doc="CPU cores of the one task (data.num_workers uses them)")
    time: int = slurm_time(60, doc="time limit: minutes, or a SLURM time (HH:MM:SS, D-HH:MM:SS)")
    mem_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="memory of the job", above=True)


@dataclass
class HealthArgs:
    """slurm.health: the start-up health check of every node and the straggler watch (README,
    "When a node is slow or hangs")."""

    enabled: Optional[bool] = doc(
        None,
        "time a matmul and all-reduces (within each node, across nodes) on every task before training, "
        "and watch for repeated stragglers; null = on with GPUs (slurm.gpus_per_node > 0), off on CPU nodes "
        "(shared cores make CPU timings noisy)",
    )
    matmul_slowdown: float = bounded(
        1.5, 1.0, 1000.0, above=True, doc="a task whose matmul takes more than this x the median task's is slow"
    )
    allreduce_slowdown: float = bounded(
        2.0,
        1.0,
        1000.0,
        above=True,
        doc="a node whose all-reduce (within it, or with its neighbours) takes more than this x the median is slow",
    )
    straggler_slowdown: float = bounded(
        1.5,
        1.0,
        1000.0,
        above=True,
        doc="a rank busy more than this x the median of its pipeline stage's ranks is straggling",
    )
    straggler_intervals: int = bounded(
        5,
        1,
        100000,
        doc="a rank straggling in this many log intervals in a row names its node (excluded at the next requeue)",
    )


@dataclass
class SlurmArgs:
    """`slurm:`: the job the config becomes (resources, requeues, signal) and the side jobs'."""

    gpus_per_node: int = bounded(0, 0, 1024, doc="0 = CPU-only cluster (then tasks_per_node)")
    tasks_per_node: Optional[int] = bounded(None, 1, 65536, doc="CPU clusters; GPU: = gpus_per_node")
    cpus_per_task: int = bounded(1, 1, 65536, doc="also OMP_NUM_THREADS of each task")
    mem_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="memory per node", above=True)
    gpu_memory_gb: Optional[float] = bounded(None, 0.0, 1e6, doc="for the --dry-run memory estimate", above=True)
    time: int = slurm_time(60, doc="time limit: minutes (at most a year), or a SLURM time (HH:MM:SS, D-HH:MM:SS)")
    partition: Optional[str] = doc(None, "SLURM partition")
    account: Optional[str] = doc(None, "SLURM account")
    qos: Optional[str] = doc(None, "SLURM quality of service")
    constraint: Optional[str] = doc(None, "node features, e.g. h100")
    exclusive: bool = doc(False, "whole nodes")
    nodes: Optional[str] = doc(
        None,
        "null = the grid's node count; 'min-max' (e.g. '1-2', max = the grid's count): the job may start or "
        "requeue on fewer nodes, each count at --plan's layout of the same global batch (README)",
    )
    max_requeues: int = bounded(3, 0, doc="requeues after preemption / time limit")
    array_parallelism: int = bounded(
        0, 0, 100000, doc="--sweep: at most this many points of the job array run at once; 0 = all"
    )
    signal: Literal["USR1", "USR2", "TERM", "INT", "HUP"] = doc(
        "USR2", "sent by SLURM before the time limit / on preemption"
    )
    signal_delay_s: int = bounded(120, 0, 65535, doc="seconds before the limit that the signal comes")
    setup: list[str] = doc(list, "trusted shell lines run before srun (module load, source venv)")
    sbatch_extra: dict[str, str] = doc(dict, "extra #SBATCH options, e.g. {mail-type: END}")
    env: dict[str, str] = doc(dict, "exported before init (NCCL_*, InfiniBand settings)")
    prepare: PrepareArgs = field(
        default_factory=PrepareArgs, metadata={"doc": "the CPU job of --prepare-data (partition, cpus, time)"}
    )
    health: HealthArgs = field(
        default_factory=HealthArgs, metadata={"doc": "node health check before training, straggler watch"}
    )
    max_excluded_nodes: Optional[int] = bounded(
        None,
        0,
        100000,
        doc="nodes named by the health check, a hang or repeated stragglers are excluded from the job's "
        "requeues (and from --resume) up to this many; null = 4 with GPUs, 0 on CPU nodes",
        why="0 never excludes a node, N > 0 excludes up to N, null: 4 on GPU nodes and 0 on CPU nodes",
    )
