"""The layout a job with a node range (``slurm.nodes: 'min-max'``) trains at when SLURM gives it
N nodes: the config's own layout at the most nodes (the grid's count), else the first layout of
``--plan`` for N x (GPUs, or tasks, per node) ranks.

Every rank of the job computes it from the config and N alone (``SLURM_JOB_NUM_NODES``), with no
communication: the planner is plain arithmetic on the config, its candidates come in a fixed
order and its ranking sorts them stably, so every rank, on any node, picks the same layout.

What stays: the model, the optimizer and its schedule, the data, and the global batch (micro
batch x accumulation x dp), which the planner keeps by choosing the accumulation (the trainer's
data position is the count of samples consumed, so the next samples are the same at any layout).
What may change: dp, tp, pp, cp (ep folds into dp: the planner lays out experts at ep 1), the
pipeline engine, the micro-batch size, recomputation and the ZeRO stage; the checkpoint is
resharded to it on load (``checkpoint/load.py``), exactly.
"""

from __future__ import annotations

import dataclasses

from nanotrain.config import Config, ConfigError
from nanotrain.config.validate_slurm import slurm_layout
from nanotrain.estimate import plan as planner


def ranks_per_node(config: Config) -> int:
    """Tasks per node: one per GPU, or ``slurm.tasks_per_node`` on CPU nodes."""
    s = config.slurm
    return s.gpus_per_node or s.tasks_per_node or 1


def global_batch(config: Config) -> int:
    """Samples per optimizer step: micro batch x accumulation x the replicas that read data."""
    t = config.training
    return t.micro_batch_size * t.batch_accumulation_per_replica * config.parallelism.batch_replicas


def layout_for_nodes(config: Config, nodes: int) -> Config:
    """``config`` itself at the grid's node count; at fewer nodes within ``slurm.nodes``, a copy
    at the planner's fastest valid layout for ``nodes`` x ``ranks_per_node`` ranks, its
    ``slurm.nodes`` unset (the copy describes a job of exactly that many nodes).

    Raises:
        ConfigError: ``nodes`` outside ``slurm.nodes``, or no layout of that many ranks keeps the
            global batch and fits (the planner's reason, one line).
    """
    layout = slurm_layout(config)
    if nodes == layout.nodes:
        return config
    low = layout.nodes if layout.min_nodes is None else layout.min_nodes
    if not low <= nodes <= layout.nodes:
        raise ConfigError(
            f"slurm.nodes: the allocation has {nodes} node(s), outside {layout.nodes_text}: "
            f"run it on {layout.nodes_text} nodes, or widen slurm.nodes"
        )
    p = config.parallelism
    base = dataclasses.replace(
        config,
        parallelism=dataclasses.replace(p, dp=p.dp * p.ep, ep=1),  # the same samples per step
        slurm=dataclasses.replace(config.slurm, nodes=None),
    )
    per_node = ranks_per_node(config)
    ranks, memory = planner.check_request(base, nodes * per_node, None)
    result = planner.make_plan(base, ranks, memory, planner.Hardware(gpus_per_node=per_node), shown=1)
    if not result.proposals:
        raise ConfigError(
            f"slurm.nodes: no layout for {nodes} node(s) x {per_node} tasks: {planner.explain_none(result, base)}; "
            f"or raise the minimum of slurm.nodes above {nodes}"
        )
    chosen = result.proposals[0].config
    if global_batch(chosen) != global_batch(config):  # the planner's promise, relied on here
        raise AssertionError(f"planned global batch {global_batch(chosen)} != {global_batch(config)}")
    return chosen


def summary(config: Config) -> str:
    """``dp1 tp2 pp2 1f1b cp1 mbs2 acc8 recompute=none zero0``: --plan's words for a layout."""
    return planner.Proposal(config, 0, 0, 0, 0, {}).summary()


def set_args(config: Config) -> list[str]:
    """The ``--set`` arguments that put a config at this layout (--plan's lines)."""
    return planner.Proposal(config, 0, 0, 0, 0, {}).set_args()


def range_layouts(config: Config) -> list[tuple[int, Config]]:
    """(nodes, layout) for every count of ``slurm.nodes``, most nodes first; the job's own
    count alone without a range. Raises ConfigError as ``layout_for_nodes``, for the first count
    (from the top) that has no layout: a submission checks them all before anything is queued."""
    layout = slurm_layout(config)
    low = layout.nodes if layout.min_nodes is None else layout.min_nodes
    return [(n, layout_for_nodes(config, n)) for n in range(layout.nodes, low - 1, -1)]


def describe_range(config: Config) -> list[str]:
    """--dry-run's and --plan's lines for a node range: the layout at both ends (every count was
    checked by ``range_layouts``)."""
    layouts = range_layouts(config)
    if len(layouts) < 2:
        return []
    per_node, batch = ranks_per_node(config), global_batch(config)
    lines = [
        f"slurm.nodes {slurm_layout(config).nodes_text}: the job may start or requeue on fewer nodes; each "
        f"count trains at its own layout, the global batch of {batch} samples kept:"
    ]
    for nodes, cfg in (layouts[0], layouts[-1]):
        origin = "the config's layout" if cfg is config else "--plan's first layout"
        lines.append(f"  {nodes} node(s) x {per_node} tasks: {summary(cfg)} ({origin})")
    return lines


def allocation_line(config: Config, chosen: Config, nodes: int) -> str:
    """The one line rank 0 prints when the allocation's node count chose the layout."""
    per_node = ranks_per_node(config)
    text = slurm_layout(config).nodes_text
    if chosen is config:
        return f"nodes: {nodes} of slurm.nodes {text}: the config's layout {summary(config)}"
    return (
        f"nodes: {nodes} of slurm.nodes {text} ({nodes * per_node} ranks): planned layout {summary(chosen)}, "
        f"global batch {global_batch(chosen)} kept (the config's {summary(config)} needs "
        f"{slurm_layout(config).nodes})"
    )
