"""The `submit.py` command (its flags: ``flags.build_parser``).

Everything a user can get wrong is checked here, before anything is submitted or started, and
reported as one `error:` line with exit status 2. With no flag the job goes to SLURM when
`sbatch` is on PATH, else it runs as local processes.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path

from nanotrain.commands.config_commands import plan, rehearse
from nanotrain.commands.flags import Mode, build_parser, check_flags, given_flags
from nanotrain.commands.launching import check_launch, choose_launcher, describe_layout, metrics_rank, run_locally
from nanotrain.commands.stopping import Terminated, sigterm_ends_command, stop_line
from nanotrain.config import Config, ConfigError, SlurmLayout, load_config
from nanotrain.config.cli_args import refuse
from nanotrain.config.files import first_missing
from nanotrain.config.paths import CREATE_DIR, DIR, check_path
from nanotrain.launch import sbatch
from nanotrain.runtime import rundir
from nanotrain.runtime.rundir import Launcher


def grid_summary(config: Config) -> str:
    from nanotrain.parallel.grid import RankGrid

    return RankGrid.of(config.parallelism).summary()


def dry_run(config: Config, layout: SlurmLayout | None, run_dir: Path, config_arg: str) -> int:
    print(f"config: {config_arg} (valid)")
    print(f"run directory: {run_dir}")
    print(f"layout: {describe_layout(config, layout)}")
    from nanotrain.estimate.memory import describe as describe_memory

    for line in describe_memory(config):
        print(line)
    if layout is not None and layout.min_nodes is not None:
        from nanotrain.estimate.resize import describe_range

        for line in describe_range(config):  # slurm.nodes 'min-max': the layouts at both ends
            print(line)
    if layout is not None and sbatch.partition_problem(config):
        print(f"warning: {sbatch.partition_problem(config)} (sbatch here would refuse the job)")
    if config.checkpoints.eval_job.enabled:
        from nanotrain.launch.eval_job import describe

        print(describe(config, local=layout is None))
    print(grid_summary(config))
    if layout is None:
        print(
            f"\nlocal: {config.parallelism.world_size} processes of "
            f"`{sys.executable} -m nanotrain.runtime.task {run_dir / rundir.CONFIG_FILE}`"
        )
    else:
        print("\n# sbatch script (written and submitted by submitit):")
        print(sbatch.render_sbatch(config, layout, run_dir, sbatch.submitit_command(run_dir)))
    return 0


def emit(config: Config, layout: SlurmLayout, out_dir: Path) -> int:
    name = config.logging.run_name
    config_path = (out_dir / f"{name}.yaml").resolve()
    from nanotrain.config import dump_config

    script = out_dir / f"{name}.sbatch"
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        dump_config(config, config_path)
        script.write_text(
            sbatch.render_sbatch(config, layout, rundir.run_dir_of(config), sbatch.task_command(config_path))
        )
        script.chmod(0o755)
    except OSError as exc:
        raise rundir.os_error("--emit", exc) from None
    try:
        # SLURM opens the job's --output file before the script runs: its folder must exist.
        sbatch.job_folder(rundir.run_dir_of(config)).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise rundir.os_error("logging.dir", exc) from None
    print(f"wrote {script} and {config_path}")
    print(f"submit with: sbatch {script}")
    return 0


def _undo_run_dir(run_dir: Path, existed: set[Path] | None, old_config: bytes | None, made: Path | None) -> None:
    """After a refused submission leave the run directory as it was: gone (with the parents we
    made) if we made it, else without the pickled job and submission script we added, and with
    its previous config."""
    if existed is None:
        shutil.rmtree(made or run_dir, ignore_errors=True)
        return
    for path in set(run_dir.rglob("*")) - existed:
        if path.is_file() or path.is_symlink():
            path.unlink(missing_ok=True)
    if old_config is not None:
        (run_dir / rundir.CONFIG_FILE).write_bytes(old_config)


def submit_slurm(config: Config, layout: SlurmLayout, run_dir: Path) -> int:
    from nanotrain.launch.submission import SubmitRefused, submit
    from nanotrain.runtime.task import TrainingTask

    existed = set(run_dir.rglob("*")) if run_dir.is_dir() else None
    made = first_missing(run_dir)
    old_config = (run_dir / rundir.CONFIG_FILE).read_bytes() if (run_dir / rundir.CONFIG_FILE).is_file() else None
    try:
        config_path = rundir.write_run_dir(config, run_dir)
        job = submit(
            sbatch.job_folder(run_dir),
            config.slurm.max_requeues,
            sbatch.executor_parameters(config, layout, run_dir),
            TrainingTask(),
            str(config_path),
        )
    except SubmitRefused as exc:
        _undo_run_dir(run_dir, existed, old_config, made)
        return refuse(exc)
    except (KeyboardInterrupt, Terminated) as stop:  # a running sbatch was killed before it answered
        _undo_run_dir(run_dir, existed, old_config, made)
        line, status = stop_line(stop, "nothing was submitted")
        print(line, file=sys.stderr)
        return status
    try:
        return _report_submitted(config, layout, run_dir, job)
    except (KeyboardInterrupt, Terminated) as stop:
        line, status = stop_line(
            stop, f"job {job.job_id} was submitted; see it with: python submit.py --status {run_dir}"
        )
        print(line, file=sys.stderr)
        return status


def _report_submitted(config: Config, layout: SlurmLayout, run_dir: Path, job) -> int:
    rundir.write_launch_record(run_dir, mode=Launcher.SLURM, job_id=job.job_id, argv=sys.argv[1:])
    print(f"submitted job {job.job_id}: {describe_layout(config, layout)}")
    print(f"run directory: {run_dir}")
    print(
        f"stdout: {job.paths.stdout}  (task 0; task R writes {job.job_id}_R_log.out; "
        f"metrics: task {metrics_rank(config)})"
    )
    print(f"stderr: {job.paths.stderr}")
    print(f"tensorboard: tensorboard --logdir {config.logging.dir}")
    return 0


def _config_of(args) -> tuple[Config, str, Launcher | None]:
    """The config to launch: a YAML file, or (--resume) the run's own resolved config; plus how
    the resumed run was launched."""
    if args.resume is None:
        if args.config is None:
            raise ConfigError("the following arguments are required: config (see --help)")
        return load_config(args.config, args.set), args.config, None
    run_dir = Path(args.resume)
    if not (run_dir / rundir.CONFIG_FILE).is_file():
        raise ConfigError(
            f"--resume {args.resume}: not a run directory (no {rundir.CONFIG_FILE}); "
            "pass logs/<run> of an earlier submission"
        )
    config = load_config(run_dir / rundir.CONFIG_FILE, args.set)
    if config.checkpoints.path == str(rundir.run_dir_of(config) / "checkpoints"):
        config.checkpoints.path = None  # the default: follow the run directory if it was moved
    config.logging.run_name = run_dir.resolve().name  # the same run directory, whatever it held
    config.logging.dir = str(run_dir.resolve().parent)
    config.checkpoints.resume = True
    return config, str(run_dir / rundir.CONFIG_FILE), rundir.recorded_launcher(rundir.read_launch_record(run_dir))


def check_path_arguments(args) -> None:
    """Every path argument, by the one path checker, before anything runs: an empty one is an
    unset shell variable (`--emit $DIR`), never a choice (taken as given it would mean the current
    directory, taken as absent it would submit a job); a FIFO, a link loop, an over-long name or
    /proc is one line instead of a hang or a traceback. The config file is checked where it is
    read (`config.loader.read_yaml`), which keeps the wording of a missing one."""
    if args.config is not None and not args.config.strip():
        raise ConfigError("config: an empty path (an unset shell variable?): give a path")
    for flag, value, kind in (
        ("--status", args.status, DIR),
        ("--evaluate", args.evaluate, DIR),
        ("--resume", args.resume, DIR),
        ("--emit", args.emit, CREATE_DIR),
    ):
        if value is not None:
            check_path(flag, value, kind, ConfigError)


def main(argv: list[str] | None = None) -> int:
    """The ``submit.py`` command on ``argv`` (default ``sys.argv[1:]``); returns its exit status:
    0, 2 for any user error (one ``error:`` line on stderr, nothing submitted or started), or a
    local job's own status. User errors are never raised; ``--help`` exits through argparse.

    Ctrl-C or SIGTERM before the ranks start (while validating, writing, submitting) is exit
    130 / 143 with a line saying nothing was started, not a traceback (stopping.py); a local run
    starts its ranks after that window, with SIGTERM held as the entry point held it. A broken
    stdout pipe (`| head`) is quiet."""
    try:
        with sigterm_ends_command():
            outcome = _main(argv)
        return outcome() if callable(outcome) else outcome
    except (KeyboardInterrupt, Terminated) as stop:
        line, status = stop_line(stop, "no run was started")
        print(line, file=sys.stderr)
        return status
    except BrokenPipeError:  # the reader went away: nothing left to say; the flush at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # must not fail either
        return 0


def _main(argv: list[str] | None):
    """The command's exit status, or (a local run) the call that starts its ranks."""
    try:
        parser = build_parser()
        args = parser.parse_args(argv)
        mode = check_flags(given_flags(parser, args))  # before anything is read: flags.py's table
        check_path_arguments(args)
        if mode is Mode.PLAN:
            return plan(args)
        if mode is Mode.REHEARSE:
            return rehearse(args)
        if mode is Mode.STATUS:
            from nanotrain.commands.sweep_status import show_any_status

            return show_any_status(args.status)
        if mode is Mode.EVALUATE:
            from nanotrain.commands.evaluate import evaluate_run

            return evaluate_run(args.evaluate, args.step, args.set)
        if args.sweep or args.sweep_mode:
            from nanotrain.commands.sweep import run_sweep

            return run_sweep(args, mode)
        config, config_arg, resumed = _config_of(args)
        has_sbatch = shutil.which("sbatch") is not None
        use_slurm = choose_launcher(mode, args.local, resumed, has_sbatch) is Launcher.SLURM
        if use_slurm and not has_sbatch and mode.launches:
            raise ConfigError(
                "this run was launched on SLURM but `sbatch` is not on PATH: resume it where SLURM runs, or add --local"
            )
        layout, run_dir = check_launch(config, config_arg, mode, use_slurm, args.emit)
    except ValueError as exc:  # ConfigError, DataError: user errors
        return refuse(exc)
    try:
        if mode is Mode.PREPARE_DATA:
            from nanotrain.commands import prepare

            return prepare.submit_prepare(config, run_dir) if use_slurm else prepare.prepare_locally(config)
        if mode is Mode.DRY_RUN:
            return dry_run(config, layout, run_dir, config_arg)
        if mode is Mode.EMIT:
            return emit(config, layout, Path(args.emit))
        if use_slurm:
            return submit_slurm(config, layout, run_dir)
        return functools.partial(run_locally, config, run_dir)  # after SIGTERM is held again
    except ConfigError as exc:  # a write that failed although the checks passed (a race, a quota)
        return refuse(exc)


if __name__ == "__main__":
    sys.exit(main())
