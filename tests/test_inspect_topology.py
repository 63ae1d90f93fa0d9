"""scripts/inspect_topology.py: every group of the grid, offline (no process is launched)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "inspect_topology.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def groups_in(output: str, name: str) -> list[list[int]]:
    block = output.split(f"\n{name} groups:\n", 1)[1].split("\n\n", 1)[0]
    return [ast.literal_eval(line.strip()) for line in block.splitlines() if line.strip()]


def test_every_group_of_3d_16gpu():
    proc = run(str(ROOT / "configs" / "3d_16gpu.yaml"))
    assert proc.returncode == 0, proc.stderr
    assert groups_in(proc.stdout, "tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert groups_in(proc.stdout, "pp") == [[i, i + 8] for i in range(8)]
    assert groups_in(proc.stdout, "dp") == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]


def test_one_rank_view_and_overrides():
    proc = run(
        str(ROOT / "configs" / "tiny_cpu.yaml"),
        "--set",
        "parallelism.tp=4",
        "--set",
        "parallelism.pp=1",
        "--set",
        "model.num_key_value_heads=4",
        "--rank",
        "5",
    )
    assert proc.returncode == 0, proc.stderr
    assert "rank 5: {'ep': 0, 'pp': 0, 'dp': 1, 'cp': 0, 'tp': 1}" in proc.stdout
    assert "tp_pg: [4, 5, 6, 7]" in proc.stdout and "dp_pg: [1, 5]" in proc.stdout


def test_bad_config_is_one_line_error():
    proc = run(str(ROOT / "configs" / "tiny_cpu.yaml"), "--set", "parallelism.tp=3")
    assert proc.returncode == 2 and proc.stderr.startswith("error: ") and "Traceback" not in proc.stderr
