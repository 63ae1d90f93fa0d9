"""``slurm.nodes: 'min-max'``: the range's one-line errors, the sbatch lines it becomes, the layout
each node count trains at (the planner's, deterministic, the global batch kept), what a rank
does with ``SLURM_JOB_NUM_NODES``, and the restorer that gives a requeued job its range back.
The real cluster run is ``test_slurm_shrink.py``."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nanotrain.config import ConfigError, load_config, validate
from nanotrain.estimate import resize

from helpers.cli import dry_run_error_line, run_cli

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


def tiny(*sets: str):
    return load_config(TINY, ["slurm.nodes=1-2", *sets])


@pytest.mark.parametrize(
    "value, words",
    [
        ("x", "'x' is not a node count or range: write 'min-max' with whole numbers"),
        ("1-2-3", "'1-2-3' is not a node count or range"),
        ("1.5-2", "'1.5-2' is not a node count or range"),
        ("0-2", "'0-2': the minimum must be at least 1 node"),
        ("3-2", "'3-2': the minimum 3 is above the maximum 2: write 'min-max' with min <= max"),
        ("1-3", "'1-3': the maximum must be the grid's node count, 2 (dp*tp*pp*cp*ep = 2*2*2*1*1 = 8 / "),
        ("3", "'3': the maximum must be the grid's node count, 2"),
    ],
)
def test_a_bad_range_is_one_line_naming_the_field(value, words, tmp_path, capsys):
    line = dry_run_error_line(TINY, [f"slurm.nodes={value}"], tmp_path, capsys)
    assert line.startswith("error: slurm.nodes: ") and words in line, line


def test_the_text_is_checked_for_a_local_run_too_and_the_maximum_only_for_slurm():
    with pytest.raises(ConfigError, match="slurm.nodes: 'a-b' is not a node count"):
        validate(load_config(TINY, ["slurm.nodes=a-b"]))
    validate(load_config(TINY, ["slurm.nodes=1-5"]))  # a local run has no nodes
    assert validate(tiny(), slurm=True).nodes_text == "1-2"
    assert validate(load_config(TINY, ["slurm.nodes=2"]), slurm=True).min_nodes is None  # = the grid's


def test_a_count_without_a_layout_is_refused_at_submission(tmp_path, capsys):
    line = dry_run_error_line(
        TINY,
        ["slurm.nodes=1-2", "slurm.gpu_memory_gb=2.23", "model.hidden_size=256", "model.intermediate_size=1024"],
        tmp_path,
        capsys,
    )
    assert line.startswith("error: slurm.nodes: no layout for 1 node(s) x 4 tasks: no layout of 4 GPUs fits"), line
    assert line.endswith("or raise the minimum of slurm.nodes above 1"), line


def test_dry_run_and_plan_show_both_ends_and_the_sbatch_range(tmp_path, capsys):
    code, out, _ = run_cli([TINY, "--dry-run", "--set", f"logging.dir={tmp_path}", "--set", "slurm.nodes=1-2"], capsys)
    assert code == 0
    assert "layout: world 8 = dp2 x tp2 x pp2 x cp1 x ep1; 1-2 node(s) x 4 tasks (CPU)" in out
    ends = [
        "  2 node(s) x 4 tasks: dp2 tp2 pp2 1f1b cp1 mbs2 acc4 recompute=none zero0 (the config's layout)",
        "  1 node(s) x 4 tasks: dp1 tp1 pp4 afab cp1 mbs16 acc1 recompute=none zero0 (--plan's first layout)",
    ]
    for line in ends:
        assert line in out.splitlines(), out
    script = out[out.index("#!/bin/bash") :]
    assert script.count("#SBATCH --nodes") == 1 and "#SBATCH --nodes=1-2\n" in script
    assert "export SLURM_NTASKS=$((SLURM_JOB_NUM_NODES * 4)) SLURM_NPROCS=$((SLURM_JOB_NUM_NODES * 4))" in script
    code, out, _ = run_cli([TINY, "--plan", "--set", "slurm.nodes=1-2"], capsys)
    assert code == 0 and all(line in out.splitlines() for line in ends), out


def test_a_fixed_count_renders_as_before():
    from nanotrain.launch import sbatch

    config = load_config(TINY)
    layout = validate(config, slurm=True)
    params = sbatch.executor_parameters(config, layout)
    assert params["nodes"] == 2 and "nodes" not in params["additional_parameters"]
    assert sbatch.node_range_lines(config) == []
    ranged = tiny()
    params = sbatch.executor_parameters(ranged, validate(ranged, slurm=True))
    assert params["nodes"] == 2 and params["additional_parameters"]["nodes"] == "1-2"  # submitit's int stays


def test_each_count_keeps_the_model_schedule_and_global_batch():
    config = tiny()
    layouts = dict(resize.range_layouts(config))
    assert layouts[2] is config
    small = layouts[1]
    assert small.parallelism.world_size == 4 and small.slurm.nodes is None
    assert resize.global_batch(small) == resize.global_batch(config) == 16
    assert small.model == config.model and small.data == config.data
    assert small.optimizer.lr == config.optimizer.lr and small.training.train_steps == config.training.train_steps
    assert validate(small, slurm=True).nodes == 1
    with pytest.raises(ConfigError, match=r"slurm.nodes: the allocation has 3 node\(s\), outside 1-2"):
        resize.layout_for_nodes(config, 3)


def test_a_wider_range_on_gpus_plans_every_count():
    config = load_config(ROOT / "configs" / "3d_16gpu.yaml", ["slurm.nodes=2-4"])
    counts = {n: c for n, c in resize.range_layouts(config)}
    assert sorted(counts) == [2, 3, 4]
    for nodes, cfg in counts.items():
        assert cfg.parallelism.world_size == nodes * config.slurm.gpus_per_node
        assert resize.global_batch(cfg) == resize.global_batch(config)


def test_moe_expert_parallel_folds_into_dp_keeping_the_batch():
    config = load_config(ROOT / "configs" / "moe_16gpu.yaml")
    nodes = validate(config, slurm=True).nodes
    if nodes < 2:
        pytest.fail(f"moe_16gpu.yaml has {nodes} node(s); the test needs a config of several")
    config = load_config(ROOT / "configs" / "moe_16gpu.yaml", [f"slurm.nodes=1-{nodes}"])
    small = resize.layout_for_nodes(config, 1)
    assert config.parallelism.ep > 1 and small.parallelism.ep == 1
    assert resize.global_batch(small) == resize.global_batch(config)


def test_every_process_picks_the_same_layout():
    """The choice is arithmetic on the config and N: another interpreter (another rank, another
    node, another hash seed) computes the same one."""
    code = (
        "from nanotrain.config import load_config; from nanotrain.estimate import resize; "
        f"c = load_config({str(TINY)!r}, ['slurm.nodes=1-2']); print(resize.set_args(resize.layout_for_nodes(c, 1)))"
    )
    here = str(resize.set_args(resize.layout_for_nodes(tiny(), 1)))
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(ROOT))
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == here


def test_a_rank_takes_the_layout_of_its_allocation(capsys):
    from nanotrain.runtime import preemption
    from nanotrain.runtime.env import DistEnv
    from nanotrain.runtime.rank import layout_for_allocation, with_layout

    config = tiny()
    slurm = DistEnv("slurm", 0, 4, 0, 4, "n1", 1234, 0, 1, "77")
    try:
        chosen = layout_for_allocation(config, slurm)
        assert preemption._NODE_RANGE == [("1-2", 4, 4)]  # a requeue restores the range's minimum
    finally:
        preemption._NODE_RANGE.clear()
    assert resize.summary(chosen) == "dp1 tp1 pp4 afab cp1 mbs16 acc1 recompute=none zero0"
    out = capsys.readouterr().out
    assert out.startswith("nodes: 1 of slurm.nodes 1-2 (4 ranks): planned layout dp1 tp1 pp4 afab cp1 mbs16 acc1")
    merged = with_layout(config, chosen)
    assert merged.parallelism.world_size == 4 and merged.logging is config.logging
    assert layout_for_allocation(config, DistEnv("slurm", 0, 8, 0, 4, "n1", 1234, 0, 2, "77")) is config
    preemption._NODE_RANGE.clear()
    assert layout_for_allocation(config, DistEnv("local", 0, 8, 0, 8, "127.0.0.1", 1234, 0, 1)) is config
    fixed = load_config(TINY)
    assert layout_for_allocation(fixed, slurm) is fixed  # no range: as before (check_world_size then refuses)
    assert not preemption._NODE_RANGE


def test_the_restorer_updates_the_job_once_it_is_pending(tmp_path):
    """The detached process waits for squeue's PENDING, then sets the range back; it outlives
    the process that started it (its parent shell exits at once)."""
    bin_dir, state, calls = tmp_path / "bin", tmp_path / "state", tmp_path / "calls"
    bin_dir.mkdir()
    state.write_text("COMPLETING\n")
    (bin_dir / "squeue").write_text(f"#!/bin/sh\ncat {state}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
    for name in ("squeue", "scontrol"):
        (bin_dir / name).chmod(0o755)
    code = "from nanotrain.runtime.node_range import restore_after_requeue; restore_after_requeue('91', '1-2', 4, 8)"
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert "scontrol update JobId=91 NumNodes=1-2 NumTasks=4 NumCPUs=8" in out.stdout
    time.sleep(1.5)
    assert not calls.exists()  # not while the job is still completing
    state.write_text("PENDING\n")
    deadline = time.monotonic() + 20
    while not calls.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert calls.read_text().split() == ["update", "JobId=91", "NumNodes=1-2", "NumTasks=4", "NumCPUs=8"]
    time.sleep(1.0)
    assert len(calls.read_text().splitlines()) == 1  # done: it exits after the update
