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
    node_range(config)  # slurm.nodes' text, for a local run too (its maximum: slurm_layout)


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
    min_nodes: int | None = None  # slurm.nodes 'min-max' with min < max: the fewest nodes it may run on

    @property
    def nodes_text(self) -> str:
        """sbatch's --nodes value: the count, or 'min-max'."""
        return str(self.nodes) if self.min_nodes is None else f"{self.min_nodes}-{self.nodes}"


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
    nodes = world // per_node
    low = _range_against_grid(config, nodes, per_node, field)
    return SlurmLayout(nodes=nodes, tasks_per_node=per_node, gpus_per_node=s.gpus_per_node, min_nodes=low)


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


# --- continue on another number of nodes: slurm.nodes 'min-max' ---
_NODE_RANGE = re.compile(r"^\s*(\d{1,9})\s*(?:-\s*(\d{1,9})\s*)?$")


def node_range(config: Config) -> tuple[int, int] | None:
    """``slurm.nodes`` as (min, max), or None when unset; the text alone is checked here (the
    maximum against the grid: ``slurm_layout``).

    Raises:
        ConfigError: not 'N' or 'min-max' with whole numbers, a minimum below 1, or min > max.
    """
    text = config.slurm.nodes
    if text is None:
        return None
    match = _NODE_RANGE.match(text)
    if match is None:
        _fail(
            f"slurm.nodes: {text!r} is not a node count or range: write 'min-max' with whole numbers "
            "(e.g. '1-2'), or null for the grid's count"
        )
    low, high = int(match.group(1)), int(match.group(2) or match.group(1))
    if low < 1:
        _fail(f"slurm.nodes: {text!r}: the minimum must be at least 1 node")
    if low > high:
        _fail(f"slurm.nodes: {text!r}: the minimum {low} is above the maximum {high}: write 'min-max' with min <= max")
    return low, high


def _range_against_grid(config: Config, nodes: int, per_node: int, field: str) -> int | None:
    """The range's minimum when it is below the grid's node count (None: the job has a fixed
    count). The config's own layout is the one for the most nodes, so the maximum must be the
    count its grid needs; the layouts of the smaller counts come from the planner (checked per
    count at submission: ``estimate/resize.py``)."""
    bounds = node_range(config)
    if bounds is None:
        return None
    low, high = bounds
    if high != nodes:
        fix = f"'{min(low, nodes)}-{nodes}'" if low <= nodes else f"'1-{nodes}'"
        _fail(
            f"slurm.nodes: {config.slurm.nodes!r}: the maximum must be the grid's node count, {nodes} "
            f"({parallel_product(config)} / slurm.{field} {per_node}), the size the parallel layout is for: "
            f"write {fix}, or change the parallel sizes"
        )
    return low if low < high else None


# --- end: continue on another number of nodes ---


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
