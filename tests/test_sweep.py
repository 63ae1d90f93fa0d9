"""`submit.py CONFIG --sweep ...` without a scheduler (issue 32, item 1): how points are expanded
(grid, zip) and named, every refusal as one `error:` line naming the point before anything is
written, `--dry-run` listing the points and the array's script, a local sweep running its points
one after another, and `--status SWEEP_DIR` as one row per point. The real job array is
tests/test_slurm_sweep.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nanotrain.commands import sweep
from nanotrain.commands.cli import main
from nanotrain.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
ONE_RANK = [
    "parallelism.dp=1",
    "parallelism.tp=1",
    "parallelism.pp=1",
    "slurm.tasks_per_node=1",
    "training.train_steps=3",
    "logging.log_interval=1",
    "training.eval_interval=3",
    "data.validation={fraction: 0.01}",
]


def run_cli(argv, capsys):
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def sets(tmp_path: Path, *extra: str) -> list[str]:
    args = []
    for item in [f"logging.dir={tmp_path}", "logging.run_name=sw", *ONE_RANK, *extra]:
        args += ["--set", item]
    return args


def one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_grid_is_every_combination_first_sweep_slowest_named_by_values():
    points = sweep.expand(["optimizer.lr=1e-4,3e-4", "model.hidden_size=64,128"], None)
    assert [p.label for p in points] == [
        "optimizer.lr=1e-4,model.hidden_size=64",
        "optimizer.lr=1e-4,model.hidden_size=128",
        "optimizer.lr=3e-4,model.hidden_size=64",
        "optimizer.lr=3e-4,model.hidden_size=128",
    ]
    assert [p.name for p in points] == [
        "lr-1e-4_hidden_size-64",
        "lr-1e-4_hidden_size-128",
        "lr-3e-4_hidden_size-64",
        "lr-3e-4_hidden_size-128",
    ]
    assert [p.index for p in points] == [0, 1, 2, 3]
    assert points[3].overrides == ["optimizer.lr=3e-4", "model.hidden_size=128"]


def test_zip_pairs_the_lists():
    points = sweep.expand(["optimizer.lr=1e-4,3e-4", "model.hidden_size=64,128"], "zip")
    assert [p.label for p in points] == [
        "optimizer.lr=1e-4,model.hidden_size=64",
        "optimizer.lr=3e-4,model.hidden_size=128",
    ]


def test_names_are_directory_names_and_unique():
    points = sweep.expand(["data.source=a/b,a b", "training.seed=1"], None)
    assert [p.name for p in points] == ["source-a.b_seed-1-p0", "source-a.b_seed-1-p1"]
    shared = sweep.name_points([sweep.Point(0, (("a.lr", "1"), ("b.lr", "2")))])  # fields by full name
    assert shared[0].name == "a.lr-1_b.lr-2"
    assert sweep.split_values("[1,2], [3, 4],'a,b'") == ["[1,2]", "[3, 4]", "'a,b'"]


@pytest.mark.parametrize(
    "specs, mode, fragment",
    [
        (
            ["optimizer.lr=1e-4,3e-4", "model.hidden_size=64"],
            "zip",
            "differ in length (optimizer.lr: 2, model.hidden_size: 1)",
        ),
        (["optimizer.lr=1e-4", "optimizer.lr=3e-4"], None, "--sweep optimizer.lr: given twice"),
        (["optimizer.lr"], None, "expected section.field=V1,V2"),
        (["optimizer.lr=1e-4,,3e-4"], None, "an empty value"),
        (["optimizer.lrr=1e-4"], None, "--sweep optimizer.lrr: unknown key in section 'optimizer'"),
        (["optimizer.lr=[1,"], None, "not valid YAML"),
        (["logging.run_name=a,b"], None, "sets logging.run_name of each point itself"),
        (["optimizer.lr=1e-4,1e-4"], None, "the point optimizer.lr=1e-4 comes twice"),
    ],
)
def test_bad_sweeps_are_refused(specs, mode, fragment):
    with pytest.raises(ConfigError) as info:
        sweep.expand(specs, mode)
    assert fragment in str(info.value), str(info.value)


def test_a_bad_point_is_named_and_nothing_is_written(tmp_path, capsys):
    argv = [TINY, "--sweep", "optimizer.lr=1e-3,3e-3", "--sweep", "model.hidden_size=64,60", *sets(tmp_path)]
    code, out, err = run_cli(argv, capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith("error: sweep point optimizer.lr=1e-3,model.hidden_size=60: model: head"), line
    assert list(tmp_path.iterdir()) == []


def test_points_of_one_array_share_one_job(tmp_path, capsys):
    argv = [TINY, "--dry-run", "--sweep", "slurm.cpus_per_task=1,2", *sets(tmp_path)]
    code, out, err = run_cli(argv, capsys)
    line = one_error_line(err)
    assert code == 2 and "sweep point slurm.cpus_per_task=2: its SLURM job differs from that of" in line, line
    assert "cpus_per_task" in line and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "argv, fragment",
    [
        (["--sweep-mode", "zip"], "--sweep-mode only applies to --sweep"),
        (["--dry-run", "--sweep", "optimizer.lr=1e-3", "--resume", "{d}"], "--sweep takes a config file"),
    ],
)
def test_flag_misuse(argv, fragment, tmp_path, capsys):
    argv = [a.format(d=tmp_path) for a in argv]
    full = ([] if "--resume" in argv else [TINY]) + argv
    code, _, err = run_cli(full, capsys)
    assert code == 2 and fragment in one_error_line(err)


def test_existing_sweep_directory_is_refused(tmp_path, capsys):
    (tmp_path / "sw").mkdir()
    code, _, err = run_cli([TINY, "--dry-run", "--sweep", "optimizer.lr=1e-3,3e-3", *sets(tmp_path)], capsys)
    assert code == 2 and "the sweep directory" in one_error_line(err) and "exists already" in err


def test_dry_run_lists_the_points_and_the_array_script(tmp_path, capsys):
    argv = [TINY, "--dry-run", "--sweep", "optimizer.lr=1e-3,3e-3", "--sweep", "model.hidden_size=64,128"]
    code, out, err = run_cli([*argv, *sets(tmp_path, "slurm.array_parallelism=3")], capsys)
    assert code == 0, err
    assert "sweep: 4 points (grid), one SLURM job array" in out
    assert "point 3: optimizer.lr=3e-3,model.hidden_size=128 -> lr-3e-3_hidden_size-128" in out
    assert "#SBATCH --array=0-3%3" in out and "#SBATCH --job-name=sw" in out
    assert f"--output={tmp_path}/sw/tasks/%a/job/%A_%a_0_log.out" in out
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


@pytest.mark.timeout(120)
def test_local_sweep_runs_the_points_one_after_another_and_status_shows_them(tmp_path, capsys):
    argv = [TINY, "--local", "--sweep", "optimizer.lr=1e-3,3e-3", *sets(tmp_path)]
    code, out, err = run_cli(argv, capsys)
    assert code == 0, out[-3000:] + err[-3000:]
    sweep_dir = tmp_path / "sw"
    assert out.index("sweep point 1/2: optimizer.lr=1e-3") < out.index("sweep point 2/2: optimizer.lr=3e-3")
    manifest = json.loads((sweep_dir / "sweep.json").read_text())
    assert manifest["launcher"] == "local" and manifest["fields"] == ["optimizer.lr"]
    assert [p["name"] for p in manifest["points"]] == ["lr-1e-3", "lr-3e-3"]
    assert [p["values"] for p in manifest["points"]] == [{"optimizer.lr": "1e-3"}, {"optimizer.lr": "3e-3"}]
    assert (tmp_path / ".cache" / "data").is_dir() and not (sweep_dir / ".cache").exists()  # logging.dir's cache
    for name, lr in (("lr-1e-3", 1e-3), ("lr-3e-3", 3e-3)):
        assert (sweep_dir / name / "tb").is_dir()  # TensorBoard: one run per point, named by values
        assert f"lr: {lr}" in (sweep_dir / name / "config.yaml").read_text()
    code, out, err = run_cli(["--status", sweep_dir], capsys)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"sweep: {sweep_dir} (2 points, grid, local")
    assert lines[1].split() == ["point", "optimizer.lr", "state", "step", "loss", "val", "loss", "tokens/s"]
    for line, (name, lr) in zip(lines[2:4], (("lr-1e-3", "1e-3"), ("lr-3e-3", "3e-3"))):
        cells = line.split()
        assert cells[:4] == [name, lr, "done", "3/3"], line
        assert all(cell != "-" for cell in cells[4:]), line  # loss, val loss, tokens/s


def test_points_never_share_checkpoints_and_share_the_token_cache(tmp_path):
    """A configured checkpoints.path gets <sweep>/<point> below it; the token cache stays that of
    the sweep's logging.dir (where --prepare-data put it)."""
    from argparse import Namespace

    from nanotrain.config import load_config

    args = Namespace(config=str(TINY), set=[f"logging.dir={tmp_path}", f"checkpoints.path={tmp_path}/ck"])
    base = load_config(args.config, args.set)
    a, b = sweep.expand(["optimizer.lr=1e-3,3e-3"], None)
    configs = [sweep.point_config(args, p, tmp_path / "sw", base) for p in (a, b)]
    assert [c.checkpoints.path for c in configs] == [f"{tmp_path}/ck/sw/lr-1e-3", f"{tmp_path}/ck/sw/lr-3e-3"]
    assert {c.data.cache_dir for c in configs} == {f"{tmp_path}/.cache/data"}
    assert [c.optimizer.lr for c in configs] == [1e-3, 3e-3]


def test_a_damaged_manifest_is_one_line(tmp_path, capsys):
    (tmp_path / "sweep.json").write_text('{"points": 3}')
    code, _, err = run_cli(["--status", tmp_path], capsys)
    assert code == 2 and "sweep.json: not a sweep manifest" in one_error_line(err)
