"""`submit.py CONFIG --sweep section.field=V1,V2 [--sweep ...] [--sweep-mode zip]`: one config, many runs.

A researcher rarely trains one run; typing one `submit.py` per point loses the points' common
origin and scatters their status. Here every point is built and checked the way a single launch
is (`launching.check_launch`: config, SLURM layout, paths, data) before anything is written or queued,
so a bad point costs one `error:` line naming it and nothing else. The points then go to SLURM as
one job array through submitit (`slurm.array_parallelism` caps how many run at once), or, with
`--local`, run here one after another.

    logs/<sweep>/sweep.json        the manifest: fields, points, their values, run dirs, array job id
    logs/<sweep>/<point>/          one ordinary run directory per point, named after its values
    logs/<sweep>/tasks/<i>         -> ../<point>: array index i's run directory

The array's job folder is `tasks/%a/job`, so SLURM and submitit write task i's logs and pickles
into point i's own `job/` folder: each point is a run directory like any other (`--status`,
`--resume`, preemption and requeue: an array task is requeued on its own, by its own job id).
`tensorboard --logdir logs/<sweep>` shows the points side by side, named after their values.
Values are YAML, exactly as `--set` reads them (`config.loader.apply_override`).
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from nanotrain.commands.launching import check_launch, choose_launcher, describe_layout, run_locally
from nanotrain.commands.stopping import Terminated, stop_line
from nanotrain.config import Config, ConfigError, load_config
from nanotrain.config.cli_args import EXIT_INTERRUPTED, refuse
from nanotrain.config.files import first_missing
from nanotrain.config.loader import apply_override
from nanotrain.config.validate_slurm import MAX_RUN_NAME, validate_names
from nanotrain.launch import sbatch
from nanotrain.runtime import rundir
from nanotrain.runtime.rundir import Launcher

MANIFEST = "sweep.json"
TASKS_DIR = "tasks"
# Fields the sweep sets itself for every point: sweeping them would put points in one place.
OWN_FIELDS = ("logging.dir", "logging.run_name", "checkpoints.path")


@dataclass(frozen=True)
class Point:
    """One run of the sweep: its array index, its (field, value text) pairs, its directory name."""

    index: int
    values: tuple[tuple[str, str], ...]
    name: str = ""

    @property
    def label(self) -> str:
        """How error lines and the output name the point: ``optimizer.lr=1e-4,model.hidden_size=64``."""
        return ",".join(f"{field}={value}" for field, value in self.values)

    @property
    def overrides(self) -> list[str]:
        return [f"{field}={value}" for field, value in self.values]


def split_values(text: str) -> list[str]:
    """``1e-4,3e-4`` -> ['1e-4', '3e-4']; commas inside brackets or quotes belong to one value
    (``[1,2],[3,4]`` is two YAML lists)."""
    values, depth, quote, start = [], 0, None, 0
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char in "[{":
            depth += 1
        elif char in "]}":
            depth -= 1
        elif char == "," and depth == 0:
            values.append(text[start:i].strip())
            start = i + 1
    values.append(text[start:].strip())
    return values


def parse_axis(spec: str) -> tuple[str, list[str]]:
    """One ``--sweep section.field=V1,V2,...``: the field and its value texts, each checked as
    ``--set section.field=V`` would be (known field, valid YAML); ConfigError otherwise."""
    field, sep, text = spec.partition("=")
    field = field.strip()
    if not sep or not field or not text.strip():
        raise ConfigError(f"--sweep {spec!r}: expected section.field=V1,V2,..., e.g. optimizer.lr=1e-4,3e-4")
    if field in OWN_FIELDS:
        raise ConfigError(f"--sweep {field}: the sweep sets {field} of each point itself; sweep another field")
    values = split_values(text)
    if any(not value for value in values):
        raise ConfigError(f"--sweep {spec!r}: an empty value in the list; separate values by single commas")
    for value in values:
        try:
            apply_override({}, f"{field}={value}")
        except ConfigError as exc:
            raise ConfigError(str(exc).replace("--set ", "--sweep ", 1)) from None
    return field, values


def expand(specs: list[str], mode: str | None) -> list[Point]:
    """The sweep's points in array order: the grid of every list (the first ``--sweep`` varies
    slowest), or with ``mode`` "zip" the lists' i-th values together; named (``name_points``)."""
    axes = [parse_axis(spec) for spec in specs]
    fields = [field for field, _ in axes]
    repeated = next((field for field in fields if fields.count(field) > 1), None)
    if repeated:
        raise ConfigError(f"--sweep {repeated}: given twice; list all its values in one --sweep")
    if mode == "zip":
        lengths = {len(values) for _, values in axes}
        if len(lengths) > 1:
            sizes = ", ".join(f"{field}: {len(values)}" for field, values in axes)
            raise ConfigError(
                f"--sweep-mode zip pairs the i-th values of every list, but the lists differ in length ({sizes}): "
                "give them equal lengths, or leave out --sweep-mode zip for the grid"
            )
        combos = list(zip(*(values for _, values in axes)))
    else:
        combos = list(itertools.product(*(values for _, values in axes)))
    points = [Point(i, tuple(zip(fields, combo))) for i, combo in enumerate(combos)]
    seen: dict[str, Point] = {}
    for point in points:
        if point.label in seen:
            raise ConfigError(f"--sweep: the point {point.label} comes twice; list each value once")
        seen[point.label] = point
    return name_points(points)


def _safe(text: str) -> str:
    """A value as part of a directory name (letters, digits, '.', '-'; anything else '.')."""
    return re.sub(r"[^A-Za-z0-9.-]+", ".", text).strip(".") or "x"


def name_points(points: list[Point]) -> list[Point]:
    """Each point's run directory name, from its values: ``lr-1e-4_hidden_size-64`` (a field by
    its last name unless two fields share it); unique (an index is added where two values only
    differ in characters a directory name cannot hold) and at most MAX_RUN_NAME characters."""
    fields = [field for field, _ in points[0].values] if points else []
    last = [field.rsplit(".", 1)[-1] for field in fields]
    keys = {field: short if last.count(short) == 1 else field for field, short in zip(fields, last)}
    names = ["_".join(f"{keys[field]}-{_safe(value)}" for field, value in p.values) for p in points]
    named = []
    for point, name in zip(points, names):
        if names.count(name) > 1 or len(name) > MAX_RUN_NAME:
            name = f"{name[: MAX_RUN_NAME - 8]}-p{point.index}"
        named.append(Point(point.index, point.values, name))
    return named


def point_config(args, point: Point, sweep_dir: Path, base: Config) -> Config:
    """The point's config: the file, ``--set``, then the point's values; its run directory is
    ``sweep_dir/<name>``, a configured ``checkpoints.path`` gets ``<sweep>/<name>`` below it (the
    points must never share checkpoints), and the token cache stays that of the sweep's
    ``logging.dir`` (where `--prepare-data` put it), not one per sweep."""
    from nanotrain.data import default_cache_dir

    config = load_config(args.config, [*args.set, *point.overrides])
    config.logging.dir = str(sweep_dir)
    config.logging.run_name = point.name
    if base.checkpoints.path is not None:
        config.checkpoints.path = str(Path(base.checkpoints.path).expanduser().resolve() / sweep_dir.name / point.name)
    if config.data.cache_dir is None:
        config.data.cache_dir = str(Path(default_cache_dir(base)).expanduser().resolve())
    return config


def _job_parameters(config: Config, layout, sweep_name: str, count: int) -> dict:
    """The array's sbatch parameters: the point's job, named after the sweep, with the cap."""
    params = {**sbatch.executor_parameters(config, layout), "job_name": sweep_name}
    params["array_parallelism"] = config.slurm.array_parallelism or count
    return params


def check_points(args, mode, use_slurm: bool) -> tuple[Path, list[Point], list[tuple[Config, object, Path]]]:
    """Expand and check every point before anything is written or queued. Returns the sweep
    directory, the points and each one's (config, SLURM layout, run directory); ConfigError
    (one line, naming the point) for the first bad one."""
    if args.resume is not None:
        raise ConfigError(
            "--sweep takes a config file; --resume continues one run: resume a point with --resume SWEEP_DIR/POINT"
        )
    if not args.sweep:
        raise ConfigError("--sweep-mode only applies to --sweep: add --sweep section.field=V1,V2")
    if args.config is None:
        raise ConfigError("the following arguments are required: config (see --help)")
    points = expand(args.sweep, args.sweep_mode)
    base = load_config(args.config, args.set)
    sweep_name = base.logging.run_name = base.logging.run_name or rundir.default_run_name(args.config)
    validate_names(base)  # the sweep's name is a directory and the array's job name
    sweep_dir = Path(base.logging.dir).expanduser().resolve() / sweep_name
    rundir.check_can_create(sweep_dir, "logging.dir")
    if sweep_dir.exists():
        raise ConfigError(
            f"logging.run_name: the sweep directory {sweep_dir} exists already: choose another logging.run_name "
            "(a point of that sweep resumes with --resume SWEEP_DIR/POINT)"
        )
    checked, first = [], None
    for point in points:
        try:
            config = point_config(args, point, sweep_dir, base)
            layout, run_dir = check_launch(config, args.config, mode, use_slurm)
            if use_slurm:  # one script for all: the job of every point must be the first's
                job = {
                    **_job_parameters(config, layout, sweep_name, len(points)),
                    "max_requeues": config.slurm.max_requeues,
                }
                first = first or (point, job)
                differ = [key for key in sorted(set(job) | set(first[1])) if job.get(key) != first[1].get(key)]
                if differ:
                    raise ConfigError(
                        f"its SLURM job differs from that of {first[0].label} ({', '.join(differ)}): the points of "
                        "one job array share one sbatch script; sweep fields that change the job separately"
                    )
        except ValueError as exc:  # ConfigError, DataError
            raise ConfigError(f"sweep point {point.label}: {exc}") from None
        checked.append((config, layout, run_dir))
    return sweep_dir, points, checked


def write_manifest(sweep_dir: Path, args, points: list[Point], launcher: Launcher, job_id: str | None) -> None:
    record = {
        "name": sweep_dir.name,
        "mode": args.sweep_mode or "grid",
        "launcher": launcher.value,
        "job_id": job_id,
        "config": str(Path(args.config).resolve()),
        "set": list(args.set),
        "sweep": list(args.sweep),
        "fields": [field for field, _ in points[0].values],
        "points": [
            {
                "index": p.index,
                "name": p.name,
                "values": dict(p.values),
                "job_id": f"{job_id}_{p.index}" if job_id else None,
            }
            for p in points
        ],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    (sweep_dir / MANIFEST).write_text(json.dumps(record, indent=2) + "\n")


def read_manifest(sweep_dir: Path) -> dict:
    """sweep.json as a dict; a damaged one is a ConfigError naming it."""
    path = sweep_dir / MANIFEST
    try:
        record = json.loads(path.read_text())
        if not isinstance(record, dict) or not isinstance(record.get("points"), list):
            raise ValueError("no points")
        for point in record["points"]:
            if not isinstance(point, dict) or not isinstance(point.get("name"), str):
                raise ValueError("a point without a name")
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path}: not a sweep manifest ({exc}); it is written by submit.py --sweep") from None
    return record


def dry_run(sweep_dir: Path, points: list[Point], checked: list, use_slurm: bool, args) -> int:
    config, layout, _ = checked[0]
    how = "one SLURM job array" if use_slurm else "local runs, one after another"
    print(f"config: {args.config} (valid, every point)")
    print(f"sweep: {len(points)} points ({args.sweep_mode or 'grid'}), {how}; sweep directory: {sweep_dir}")
    for point, (_, _, run_dir) in zip(points, checked):
        print(f"  point {point.index}: {point.label} -> {run_dir.name}")
    print(f"layout of each point: {describe_layout(config, layout)}")
    if use_slurm:
        from submitit.slurm.slurm import _make_sbatch_string

        params = _job_parameters(config, layout, sweep_dir.name, len(points))
        print("\n# sbatch script of the job array (written and submitted by submitit):")
        print(
            _make_sbatch_string(
                command=sbatch.submitit_command(sweep_dir / TASKS_DIR / "%a"),
                folder=str(sweep_dir / TASKS_DIR / "%a" / "job"),
                map_count=len(points),
                **params,
            )
        )
    return 0


def submit_array(sweep_dir: Path, points: list[Point], checked: list, args) -> int:
    """Write every point's run directory and the manifest, then queue the array; on a refusal
    (or a stop while sbatch runs) remove all of it again."""
    from nanotrain.launch.submission import submit_array as queue_array
    from nanotrain.runtime.task import TrainingTask

    config, layout, _ = checked[0]
    made = first_missing(sweep_dir) or sweep_dir
    try:
        (sweep_dir / TASKS_DIR).mkdir(parents=True)
        paths = []
        for point, (point_cfg, _, run_dir) in zip(points, checked):
            paths.append(rundir.write_run_dir(point_cfg, run_dir))
            (sweep_dir / TASKS_DIR / str(point.index)).symlink_to(Path("..") / run_dir.name)
        write_manifest(sweep_dir, args, points, Launcher.SLURM, None)
        jobs = queue_array(
            sweep_dir / TASKS_DIR / "%a" / "job",
            config.slurm.max_requeues,
            _job_parameters(config, layout, sweep_dir.name, len(points)),
            TrainingTask(),
            [(str(path),) for path in paths],
            what="the sweep's job array",
        )
    except (ConfigError, OSError) as exc:  # SubmitRefused, a write that failed although checked
        shutil.rmtree(made, ignore_errors=True)
        return refuse(rundir.os_error("logging.dir", exc) if isinstance(exc, OSError) else exc)
    except (KeyboardInterrupt, Terminated) as stop:
        shutil.rmtree(made, ignore_errors=True)
        line, status = stop_line(stop, "nothing was submitted")
        print(line, file=sys.stderr)
        return status
    array_id = jobs[0].job_id.split("_")[0]
    try:
        write_manifest(sweep_dir, args, points, Launcher.SLURM, array_id)
        for job, (_, _, run_dir) in zip(jobs, checked):
            rundir.write_launch_record(run_dir, mode=Launcher.SLURM, job_id=job.job_id, argv=sys.argv[1:])
        _report_submitted(sweep_dir, points, jobs, config, layout)
    except (KeyboardInterrupt, Terminated) as stop:  # the array is queued and runs regardless
        line, status = stop_line(stop, f"job array {array_id} was submitted; see it with: squeue -j {array_id}")
        print(line, file=sys.stderr)
        return status
    except (ConfigError, OSError) as exc:  # the records could not be written (a quota, a race)
        print(f"error: job array {array_id} was submitted, but: {exc}", file=sys.stderr)
        return 1
    return 0


def _report_submitted(sweep_dir: Path, points: list[Point], jobs: list, config: Config, layout) -> None:
    array_id = jobs[0].job_id.split("_")[0]
    cap = config.slurm.array_parallelism
    print(
        f"submitted job array {array_id}: {len(points)} points"
        + (f", at most {cap} at once" if cap and cap < len(points) else "")
        + f"; each {describe_layout(config, layout)}"
    )
    for job, point in zip(jobs, points):
        print(f"  {job.job_id}: {point.label} -> {point.name}")
    print(f"sweep directory: {sweep_dir}")
    print(f"status: python submit.py --status {sweep_dir}")
    print(f"tensorboard: tensorboard --logdir {sweep_dir}")


def run_points_locally(sweep_dir: Path, points: list[Point], checked: list, args) -> int:
    """The points one after another (a failed point does not stop the others; a stop does)."""
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_manifest(sweep_dir, args, points, Launcher.LOCAL, None)
    except OSError as exc:
        return refuse(rundir.os_error("logging.dir", exc))
    failed = []
    for point, (config, _, run_dir) in zip(points, checked):
        print(f"sweep point {point.index + 1}/{len(points)}: {point.label}", flush=True)
        status = run_locally(config, run_dir)
        if status == EXIT_INTERRUPTED:
            print(f"sweep: stopped at point {point.label}; the later points did not run", file=sys.stderr)
            return status
        if status != 0:
            print(f"sweep: point {point.label} failed (exit {status})", file=sys.stderr, flush=True)
            failed.append(status)
    print(
        f"sweep: {len(points) - len(failed)} of {len(points)} points finished; "
        f"status: python submit.py --status {sweep_dir}"
    )
    return failed[0] if failed else 0


def run_sweep(args, mode):
    """``submit.py CONFIG --sweep ...``: the exit status, or (local) the call that runs the points."""
    from nanotrain.commands.flags import Mode

    use_slurm = choose_launcher(mode, args.local, None, shutil.which("sbatch") is not None) is Launcher.SLURM
    try:
        sweep_dir, points, checked = check_points(args, mode, use_slurm)
    except ValueError as exc:
        return refuse(exc)
    if mode is Mode.DRY_RUN:
        return dry_run(sweep_dir, points, checked, use_slurm, args)
    if use_slurm:
        return submit_array(sweep_dir, points, checked, args)
    return functools.partial(run_points_locally, sweep_dir, points, checked, args)
