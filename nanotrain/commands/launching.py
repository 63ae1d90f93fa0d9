"""What every launch of `submit.py` shares, a single run's and each point of a sweep's
(`commands/sweep.py`): the checks made before anything is written or queued (`check_launch`),
where the job goes (`choose_launcher`), how its layout is described, and a local run.

They live apart from `cli.py` so that the sweep, which `cli.py` calls, can use them without
importing `cli.py` back.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nanotrain.commands.flags import Mode
from nanotrain.config import Config, ConfigError, SlurmLayout, validate
from nanotrain.config.cli_args import EXIT_INTERRUPTED
from nanotrain.config.path_fields import check_path_fields
from nanotrain.config.validate import validate_names
from nanotrain.launch import sbatch
from nanotrain.parallel.part.compile_check import compile_backend_problem
from nanotrain.runtime import rundir
from nanotrain.runtime.rundir import Launcher


def describe_layout(config: Config, layout: SlurmLayout | None) -> str:
    p = config.parallelism
    grid = f"world {p.world_size} = dp{p.dp} x tp{p.tp} x pp{p.pp} x cp{p.cp} x ep{p.ep}"
    if layout is None:
        return f"{grid}; {p.world_size} local processes"
    gpus = f", {layout.gpus_per_node} GPUs per node" if layout.gpus_per_node else " (CPU)"
    return f"{grid}; {layout.nodes_text} node(s) x {layout.tasks_per_node} tasks{gpus}"


def metrics_rank(config: Config) -> int:
    """The rank that logs metrics: last pipeline stage, tp/dp/cp/ep 0 (the loss lives there)."""
    from nanotrain.parallel.grid import RankGrid

    return RankGrid.of(config.parallelism).rank(pp=config.parallelism.pp - 1)


def run_locally(config: Config, run_dir: Path) -> int:
    from nanotrain.launch.local import Interrupted, report_interrupt, run_local, task_command

    config_path = rundir.write_run_dir(config, run_dir)
    rundir.write_launch_record(run_dir, mode=Launcher.LOCAL, argv=sys.argv[1:])
    world = config.parallelism.world_size
    print(f"local run: {describe_layout(config, None)}; run directory: {run_dir}", flush=True)
    try:
        status = run_local(
            task_command(config_path), world, sbatch.job_folder(run_dir), stream_ranks=(0, metrics_rank(config))
        )
    except Interrupted as stop:
        print(report_interrupt(run_dir, Path(config.checkpoints.path), stop), file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(f"tensorboard: tensorboard --logdir {config.logging.dir}", flush=True)
    return status


def check_paths(config: Config, run_dir: Path, emit_dir: str | None) -> None:
    """Every directory the launch will write: creatable and writable, checked before any of it
    is made (and by --dry-run, which promises that the launch would work)."""
    rundir.check_can_create(run_dir, "logging.dir")
    rundir.check_can_create(Path(config.checkpoints.path), "checkpoints.path")
    if emit_dir is not None:
        rundir.check_can_create(Path(emit_dir), "--emit")


def choose_launcher(mode: Mode, local: bool, resumed: Launcher | None, has_sbatch: bool) -> Launcher:
    """Where the job goes: --local keeps it here; --dry-run and --emit show the SLURM job; a
    resumed run goes where it ran; else to SLURM when `sbatch` is on PATH."""
    if local:
        return Launcher.LOCAL
    if not mode.launches:
        return Launcher.SLURM
    return resumed or (Launcher.SLURM if has_sbatch else Launcher.LOCAL)


def check_launch(
    config: Config, config_arg: str, mode: Mode, use_slurm: bool, emit_dir: str | None = None
) -> tuple[SlurmLayout | None, Path]:
    """Every check a launch makes before anything is written or queued (a sweep makes them for
    each of its points): the config and its SLURM layout, paths, data, the resume target and the
    run's owner. Returns the layout (None locally) and the run directory; raises ValueError
    (ConfigError, DataError: one `error:` line)."""
    layout = validate(config, slurm=use_slurm)
    if layout is not None and layout.min_nodes is not None:  # slurm.nodes 'min-max': a layout for
        from nanotrain.estimate.resize import range_layouts  # every count, before anything is queued

        range_layouts(config)
    check_path_fields(config)
    if not use_slurm:
        from nanotrain.launch.local import check_process_count

        check_process_count(config.parallelism.world_size)
        problem = config.training.compile and compile_backend_problem("cpu")
        if problem:  # local ranks compile here (on a GPU node each rank checks its device again)
            raise ConfigError(f"training.compile: {problem}; install one or set training.compile: false")
    elif mode.launches and sbatch.partition_problem(config):
        raise ConfigError(sbatch.partition_problem(config))  # plans may target another cluster
    from nanotrain.data import check_data_config

    check_data_config(config.data, vocab_size=config.model.vocab_size, config=config)
    if config.eval.sources or config.eval.prompts:  # what --evaluate and checkpoints.eval_job will read
        from nanotrain.data.check import check_eval_config

        check_eval_config(config)
    if mode is not Mode.PREPARE_DATA:
        from nanotrain.data import missing_cache_problem

        problem = missing_cache_problem(config)
        if problem:
            raise ConfigError(problem)
    run_dir = rundir.resolve_run(config, config_arg)
    validate_names(config)  # again: the default run name is only known now
    check_paths(config, run_dir, emit_dir)
    from nanotrain.commands.preflight import before_launch  # live owner / job, resume target

    for note in before_launch(config, run_dir, launching=mode.launches):
        print(f"warning: {note}", file=sys.stderr)
    return layout, run_dir
