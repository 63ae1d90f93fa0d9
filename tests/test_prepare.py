"""`submit.py CONFIG --prepare-data`: locally (summary, then a training submission finds the cache),
two preparations of one source at once (one valid cache), a missing cache above
`data.max_build_mb` refused before anything is submitted, and the real SLURM CPU job followed by
a training job that finds the cache ready."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from helpers.runs import set_args
from helpers.slurm import submitted_job_id, wait_for_job

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
pytestmark = pytest.mark.timeout(400)


def corpus(path: Path, docs: int = 300) -> Path:
    with open(path, "w") as fh:
        for i in range(docs):
            fh.write(json.dumps({"text": f"document {i}: " + "lorem ipsum dolor sit amet " * 4}) + "\n")
    return path


def submit(*args, timeout=300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), str(TINY), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def sets(tmp_path: Path, source: Path, *extra: str) -> list[str]:
    items = [f"logging.dir={tmp_path / 'logs'}", f"data.source={source}", *extra]
    return set_args(items)


def caches(tmp_path: Path) -> list[Path]:
    return sorted(p for p in (tmp_path / "logs" / ".cache" / "data").iterdir() if p.name != "hf")


def expected_tokens(source: Path) -> int:
    """Byte tokenizer: every document's UTF-8 bytes plus one separator."""
    return sum(len(json.loads(line)["text"].encode()) + 1 for line in source.read_text().splitlines())


def test_prepare_locally_then_training_finds_the_cache(tmp_path):
    source = corpus(tmp_path / "c.jsonl")
    refused = submit("--dry-run", *sets(tmp_path, source, "data.max_build_mb=0"))
    assert refused.returncode == 2, refused.stdout + refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "above data.max_build_mb=0" in lines[0] and "--prepare-data" in lines[0], lines

    proc = submit("--prepare-data", "--local", *sets(tmp_path, source, "data.num_workers=2"))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "data: " in proc.stdout and "300 documents" in proc.stdout and "tokens/s" in proc.stdout
    again = submit("--prepare-data", "--local", *sets(tmp_path, source))
    assert "already prepared" in again.stdout, again.stdout
    ok = submit("--dry-run", *sets(tmp_path, source, "data.max_build_mb=0"))
    assert ok.returncode == 0, ok.stdout + ok.stderr


def test_two_preparations_at_once_give_one_valid_cache(tmp_path):
    source = corpus(tmp_path / "c.jsonl", docs=2000)
    cmd = [sys.executable, str(ROOT / "submit.py"), str(TINY), "--prepare-data", "--local", *sets(tmp_path, source)]
    procs = [
        subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)
    ]
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0, 0], outs
    (cache,) = caches(tmp_path)
    assert sorted(p.name for p in cache.iterdir()) == ["meta.json", "tokens.bin"]  # no scratch left
    meta = json.loads((cache / "meta.json").read_text())
    tokens = np.fromfile(cache / "tokens.bin", dtype=meta["dtype"])
    assert meta["num_tokens"] == tokens.size == expected_tokens(source)
    assert meta["num_documents"] == 2000


@pytest.mark.slurm
def test_prepare_as_slurm_cpu_job_then_training_finds_it(slurm_cluster, tmp_path):
    source = corpus(tmp_path / "c.jsonl")
    run = sets(tmp_path, source, "logging.run_name=prep", "slurm.prepare.cpus=1", "slurm.prepare.time=5")
    proc = submit("--prepare-data", *run, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    job_id = submitted_job_id(proc.stdout.replace("data preparation job", "job"))
    prep_dir = tmp_path / "logs" / "prep-prepare"
    assert wait_for_job(job_id, timeout=240) == "COMPLETED", (prep_dir / "job").iterdir()
    status = subprocess.run(
        [sys.executable, str(ROOT / "submit.py"), "--status", str(prep_dir)], capture_output=True, text=True, timeout=60
    )
    assert f"job: {job_id}" in status.stdout and "state: COMPLETED" in status.stdout, status.stdout
    assert "data: prepared 1 source(s)" in status.stdout, status.stdout
    (cache,) = caches(tmp_path)
    assert json.loads((cache / "meta.json").read_text())["num_tokens"] == expected_tokens(source)
    prepared_at = (cache / "meta.json").stat().st_mtime_ns

    train = submit(
        *sets(
            tmp_path,
            source,
            "logging.run_name=train",
            "data.max_build_mb=0",
            "training.train_steps=2",
            "checkpoints.interval=0",
        ),
        timeout=120,
    )
    assert train.returncode == 0, train.stdout + train.stderr
    train_id = submitted_job_id(train.stdout)
    assert wait_for_job(train_id, timeout=300) == "COMPLETED"
    progress = json.loads((tmp_path / "logs" / "train" / "progress.json").read_text())
    assert progress["step"] == 2
    assert caches(tmp_path) == [cache] and (cache / "meta.json").stat().st_mtime_ns == prepared_at  # not rebuilt


def test_training_job_refuses_a_large_missing_cache_itself(tmp_path):
    """Inside the job too (an --emit script skips submit.py's check): no tokenising above the limit."""
    from nanotrain.config.schema import DataArgs
    from nanotrain.data import DataError, TokenDataset

    args = DataArgs(source=str(corpus(tmp_path / "c.jsonl", docs=50)))
    with pytest.raises(DataError, match=r"above data.max_build_mb=0: run `python submit.py CONFIG --prepare-data`"):
        TokenDataset.build(args, seq_len=8, cache_dir=str(tmp_path / "cache"), max_build_mb=0)
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("meta.json"))
    built = TokenDataset.build(args, seq_len=8, cache_dir=str(tmp_path / "cache"), max_build_mb=1)
    assert not built.from_cache and built.num_documents == 50
