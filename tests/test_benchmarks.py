"""Smoke test of the side-by-side benchmark harness (benchmarks/vs_native.py): a few rows, one
timed step each, on CPU/gloo. Checks the plumbing (launch, both sides train the same model from
the same weights, results JSON + Markdown), not the speed."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIELDS = {"name", "ours", "native", "unit", "ratio", "target", "same_loss"}


def test_vs_native_quick_rows(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "vs_native.py"), "--only", "tp2_ar", "pp2_1f1b",
                           "--reps", "1", "--steps", "1", "--warmup", "1", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads((tmp_path / "latest.json").read_text())
    names = [r["name"] for r in rows]
    assert any(n.startswith("tp2 ALL_REDUCE") for n in names) and any(n.startswith("pp2 1f1b") for n in names)
    assert any("1f1b vs afab" in n for n in names)
    for row in rows:
        assert FIELDS <= row.keys(), row
        assert row["ours"] > 0 and row["native"] > 0 and row["ratio"] > 0
        if row["unit"] == "tokens/s":
            assert row["same_loss"] is True, row  # identical weights and data: the losses must agree
            assert row["loss_rel_first"] <= 1e-4
    memory = next(r for r in rows if "1f1b vs afab" in r["name"])
    assert memory["ratio"] <= memory["target"], memory  # 1f1b holds pp, not m, micro-batches
    table = (tmp_path / "latest.md").read_text()
    assert "| row | nanotrain | native |" in table and all(r["name"] in table for r in rows)


def test_gpu_scripts_run_on_cpu(tmp_path):
    """benchmarks/gpu_check.sh, gpu_train_bench.py and gpu_trainer_check.py only run for real where
    a GPU is lent: CI keeps them from rotting (shell syntax; each script's whole path on a tiny
    CPU model — for the trainer check, the real task entry point in bf16)."""
    syntax = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_check.sh")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_train_bench.py"), "--cpu-smoke",
                           "--seq", "128", "--micro-batch", "2", "--steps", "2", "--warmup", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["tokens_per_step"] == 2 * 128 and result["tokens_per_s"] > 0
    assert len(result["step_ms"]) == 2 and all(x == x for x in result["loss_first_last"])  # not NaN
    trainer = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_trainer_check.py"), "--cpu-smoke",
                              "--steps", "3", "--out", str(tmp_path / "trainer")],
                             capture_output=True, text=True, timeout=180)
    assert trainer.returncode == 0, trainer.stdout[-2000:] + trainer.stderr[-2000:]
    runs = json.loads((tmp_path / "trainer" / "gpu_trainer.json").read_text())["runs"]
    assert [r["name"] for r in runs] == ["task-world1"] and runs[0]["step"] == 3 and runs[0]["tokens_per_sec"] > 0
    assert not (tmp_path / "trainer" / "task-world1").exists()  # run directories stay out of --out


def test_context_parallel_benchmark_runs_and_agrees(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "context_parallel.py"), "--quick", "--seq", "128"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]  # exit 1 when a loss differs
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| 128 |")]
    assert len(rows) == 3 and all(row.rstrip().endswith("| yes |") for row in rows), proc.stdout


def test_checkpoint_granularity_benchmark_runs(tmp_path):
    """benchmarks/checkpoint_granularity.py (the measurement behind one checkpoint file per rank):
    its ranks start, save, load and report, and the one-process resharding load agrees on size."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "checkpoint_granularity.py"), "--model", "tiny",
                           "--dp", "1", "--tp", "2", "--repeats", "1", "--dir", str(tmp_path / "ckpt")],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["params"] == 279_104 and result["tp"] == 2 and result["files"] > 0 and result["save_s"] > 0


def test_async_checkpoint_benchmark_runs(tmp_path):
    """benchmarks/async_checkpoint.py (the stall and throughput table in the README): every row,
    ours and DCP's, is measured and printed, and it leaves nothing behind in its directory."""
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "async_checkpoint.py"), "--mb", "24",
                           "--repeats", "1", "--batch", "4", "--dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    for row in ("raw write (1 file, fsync)", "nanotrain sync save", "async: training blocked (stall)",
                "async: until committed", "DCP save", "DCP async_save: until done"):
        assert any(line.startswith(row) for line in proc.stdout.splitlines()), (row, proc.stdout)
    assert "sync save throughput / raw write:" in proc.stdout and "vs PyTorch-native DCP" in proc.stdout
    assert list(tmp_path.iterdir()) == []
