"""What reaches the sbatch script and SLURM: names, #SBATCH options, environment and the job's
nodes x tasks, each checked before a job is submitted.

No *value* (names, #SBATCH options, environment) may inject shell. ``slurm.setup`` is the
exception by design: its lines are shell that the user writes and trusts (module load, source
venv), checked only to be one line each. Each check raises ``ConfigError`` with one line naming the
field and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nanotrain.config.loader import ConfigError
from nanotrain.config.schema import Config
from nanotrain.config.text import problem

# SLURM names (partition, account, qos, constraint expressions) never need shell metacharacters.
_SLURM_NAME = re.compile(r"^[A-Za-z0-9_.,:|&*\[\]@+-]+$")
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_SBATCH_KEY = re.compile(r"^[a-z][a-z0-9_-]*$")
_ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Options that nanotrain derives itself; setting them in sbatch_extra would contradict the grid.
_DERIVED_SBATCH = {
    "nodes",
    "ntasks",
    "ntasks-per-node",
    "gpus-per-node",
    "gpus",
    "gres",
    "time",
    "partition",
    "account",
    "qos",
    "constraint",
    "cpus-per-task",
    "mem",
    "signal",
    "output",
    "error",
    "job-name",
    "exclusive",
    "open-mode",
    "requeue",
    "gpus-per-task",
    "ntasks-per-gpu",
    "gpus-per-socket",
    "cpus-per-gpu",
    "tres-per-task",
}
# Options that would break the job rather than contradict a field, and why.
_BREAKING_SBATCH = {
    "wrap": "it replaces the batch script, so the training command would never run",
    "array": "every array task would train the same run in the same directory",
    "wait": "sbatch would block until the job ends",
    "test-only": "sbatch would submit nothing",
    "parsable": "it changes the output that the job id is read from",
    "no-requeue": "preemption and time-limit saves requeue the job",
    "export": "the job needs the submitting environment; set variables with slurm.env",
    "export-file": "the job needs the submitting environment; set variables with slurm.env",
    "help": "it is not a job option",
    "usage": "it is not a job option",
    "version": "it is not a job option",
}
_MEM_OPTIONS = ("mem-per-cpu", "mem-per-gpu")
MAX_RUN_NAME = 200  # a file name is at most 255 bytes, and --emit adds ".sbatch"


def _fail(message: str):
    raise ConfigError(message)


def parallel_product(config: Config) -> str:
    p = config.parallelism
    return f"dp*tp*pp*cp*ep = {p.dp}*{p.tp}*{p.pp}*{p.cp}*{p.ep} = {p.world_size}"


def validate_names(config: Config) -> None:
    """Values that end up in paths or in the sbatch script must be inert."""
    s = config.slurm
    for name, value in [(n, getattr(s, n)) for n in ("partition", "account", "qos", "constraint")] + [
        ("prepare.partition", s.prepare.partition)
    ]:
        if value is not None and not _SLURM_NAME.match(value):
            _fail(
                f"slurm.{name}: {value!r} contains characters SLURM names never use "
                "(letters, digits and _.,:|&*[]@+- only)"
            )
    for where, path in (
        ("logging.dir", config.logging.dir),
        ("checkpoints.path", config.checkpoints.path),
        ("checkpoints.init_from_hf", config.checkpoints.init_from_hf),
    ):
        if path is not None:
            _one_line(where, path)
    run = config.logging.run_name
    if run is not None and len(run) > MAX_RUN_NAME:
        _fail(
            f"logging.run_name: {len(run)} characters; at most {MAX_RUN_NAME} (it names a directory "
            "and files): choose a shorter name"
        )
    if run is not None and not RUN_NAME.match(run):
        _fail(f"logging.run_name: {run!r} must be letters, digits, '.', '_' or '-' (it is a directory name)")
    for i, line in enumerate(s.setup):
        _one_line(f"slurm.setup[{i}]", line)
    for key, value in s.sbatch_extra.items():
        if not _SBATCH_KEY.match(key):
            _fail(f"slurm.sbatch_extra.{key}: not an sbatch option name (lowercase, e.g. mail-type)")
        check_sbatch_option(key, mem_set=s.mem_gb is not None)
        _one_line(f"slurm.sbatch_extra.{key}", value)
    for key, value in s.env.items():
        if not _ENV_KEY.match(key):
            _fail(f"slurm.env.{key}: not a valid environment variable name")
        _one_line(f"slurm.env.{key}", value)


def _one_line(where: str, text: str) -> None:
    """Raise ConfigError naming `where` unless `text` is one line of printable text (it reaches the
    sbatch script and the terminal)."""
    found = problem(text)
    if found:
        _fail(f"{where}: {found}")


def check_sbatch_option(key: str, mem_set: bool) -> None:
    """One `slurm.sbatch_extra` key. sbatch (getopt) accepts any unambiguous prefix of an option,
    so `wra` is `--wrap`: a key that abbreviates a refused option is refused too."""
    option = key.replace("_", "-")
    where = f"slurm.sbatch_extra.{key}"
    refused = sorted(_DERIVED_SBATCH | set(_BREAKING_SBATCH) | (set(_MEM_OPTIONS) if mem_set else set()))
    full = option if option in refused else next((o for o in refused if o.startswith(option)), None)
    if full is None:
        return
    named = f"--{full}" + (f" (as the abbreviation --{option})" if full != option else "")
    if full in _DERIVED_SBATCH:
        _fail(
            f"{where}: nanotrain sets this option itself ({named}); use the slurm.* field or the "
            "parallelism sizes instead"
        )
    if full in _MEM_OPTIONS:
        _fail(
            f"{where}: {named} conflicts with slurm.mem_gb (sbatch takes one of --mem, --mem-per-cpu, "
            "--mem-per-gpu): drop one of them"
        )
    _fail(f"{where}: {named} would break the job ({_BREAKING_SBATCH[full]}): remove it")


@dataclass(frozen=True)
class SlurmLayout:
    """The SLURM job's shape: ``nodes`` x ``tasks_per_node`` tasks (one per rank), ``gpus_per_node``
    (0: CPU nodes)."""

    nodes: int
    tasks_per_node: int
    gpus_per_node: int


def slurm_layout(config: Config) -> SlurmLayout:
    """Nodes and tasks per node for a SLURM job, from the world size: the grid decides the job.

    Raises:
        ConfigError: ``tasks_per_node`` missing on CPU nodes or not equal to ``gpus_per_node`` on
            GPU nodes, a world size that is not a multiple of the tasks per node, or a
            ``signal_delay_s`` not shorter than ``slurm.time``.
    """
    s, world = config.slurm, config.parallelism.world_size
    if s.gpus_per_node > 0:
        if s.tasks_per_node is not None and s.tasks_per_node != s.gpus_per_node:
            _fail(
                f"slurm.tasks_per_node ({s.tasks_per_node}) must equal slurm.gpus_per_node "
                f"({s.gpus_per_node}) on GPU nodes (one task per GPU); drop tasks_per_node"
            )
        per_node, field = s.gpus_per_node, "gpus_per_node"
    else:
        if s.tasks_per_node is None:
            _fail("slurm.tasks_per_node: must be set when slurm.gpus_per_node is 0 (CPU-only nodes)")
        per_node, field = s.tasks_per_node, "tasks_per_node"
    if s.signal_delay_s >= s.time * 60:
        _fail(
            f"slurm.signal_delay_s ({s.signal_delay_s}) is not shorter than slurm.time ({s.time} min = "
            f"{s.time * 60} s): SLURM would signal the job as it starts, so it would save and requeue "
            "without training; lower signal_delay_s or raise slurm.time"
        )
    if world < per_node:
        _fail(
            f"parallelism: {parallel_product(config)} is smaller than slurm.{field} ({per_node}): "
            f"set slurm.{field}: {world} or raise dp"
        )
    if world % per_node:
        _fail(
            f"parallelism: {parallel_product(config)} is not a multiple of slurm.{field} ({per_node}): "
            f"make the product a multiple of {per_node}, or set slurm.{field} to a divisor of {world}"
        )
    return SlurmLayout(nodes=world // per_node, tasks_per_node=per_node, gpus_per_node=s.gpus_per_node)


def check_world_size(config: Config, world_size: int, where: str) -> None:
    """The product of the parallel sizes must equal the processes actually running.

    Args:
        world_size: the processes running (``WORLD_SIZE``).
        where: what runs them, for the message (e.g. ``"this slurm job"``).

    Raises:
        ConfigError: the sizes do not multiply to ``world_size``.
    """
    if config.parallelism.world_size != world_size:
        _fail(
            f"parallelism: {parallel_product(config)} but {where} has {world_size} processes: "
            f"change dp (or tp/pp) so that the product is {world_size}, "
            f"or launch {config.parallelism.world_size} processes"
        )


# --- node health and exclusion: the defaults that depend on the nodes ---
GPU_MAX_EXCLUDED_NODES = 4  # slurm.max_excluded_nodes: null on GPU nodes


def health_enabled(config: Config) -> bool:
    """``slurm.health.enabled``, its null resolved: on with GPUs, off on CPU nodes (where tasks share
    cores and a timing says more about the neighbours than about the node)."""
    enabled = config.slurm.health.enabled
    return config.slurm.gpus_per_node > 0 if enabled is None else bool(enabled)


def max_excluded_nodes(config: Config) -> int:
    """``slurm.max_excluded_nodes``, its null resolved: GPU_MAX_EXCLUDED_NODES with GPUs, else 0."""
    limit = config.slurm.max_excluded_nodes
    if limit is None:
        return GPU_MAX_EXCLUDED_NODES if config.slurm.gpus_per_node > 0 else 0
    return int(limit)


# --- end of node health and exclusion ---
