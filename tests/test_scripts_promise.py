"""Every script keeps submit.py's promise: a wrong input is ONE stderr line starting `error:`,
exit status 2, answered before torch is imported (in well under 2 CPU seconds) and with nothing
written: the directories around the source and the output list the same before and after.

The scripts run as real processes with a stand-in `torch` package first on PYTHONPATH that
raises on import: a refusal that imported torch first would be a traceback here, not a line.
The source checkpoint is the one-process tiny model saved with its config
(``helpers.checkpoints.saved_tiny``); the refusals read its meta.json only.
"""

from __future__ import annotations

import hashlib
import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.checkpoints import saved_tiny

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = (
    "config_reference",
    "export_hf",
    "fuzz_config",
    "generate",
    "hf_config",
    "import_graph",
    "inspect_topology",
    "reshard_checkpoint",
    "startup_path",
)
LIMIT_CPU_S = 2.0
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A directory holding ``ckpts`` (a checkpoints root with ``step_000001``), ``alien/step_000001``
    (COMPLETE and its meta.json checksum right, the meta.json not nanotrain's) and ``no-torch``
    (a ``torch`` package that refuses to be imported) and ``fifo-out`` (a FIFO named config.json)."""
    base = tmp_path_factory.mktemp("scripts_promise")
    saved_tiny(base / "ckpts")
    alien = base / "alien" / "step_000001"
    alien.mkdir(parents=True)
    (alien / "meta.json").write_text("[1]")
    (alien / "COMPLETE").write_text(f"sha256 {hashlib.sha256(b'[1]').hexdigest()}\n")
    poison = base / "no-torch" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text('raise ImportError("torch was imported before the refusal")\n')
    (base / "fifo-out").mkdir()
    os.mkfifo(base / "fifo-out" / "config.json")  # opened to write, it would block the export
    return base


def listing(base: Path) -> list[str]:
    return sorted(str(p.relative_to(base)) for p in base.rglob("*"))


def run(place: Path, script: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    """The script as a process, in ``place``, torch poisoned; returns it and its CPU seconds."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(place / "no-torch"), str(ROOT)]))
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args],
        cwd=place,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return proc, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def assert_refused(place: Path, script: str, *args: str, says: str = "") -> None:
    before = listing(place)
    proc, cpu = run(place, script, *args)
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    assert says in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout
    assert cpu < LIMIT_CPU_S, f"{cpu:.2f} CPU s to refuse"
    assert listing(place) == before, "a refusal wrote or removed files"


@pytest.mark.parametrize("script", SCRIPTS)
def test_a_bad_argument_is_one_line(place, script):
    assert_refused(place, script, "--no-such-flag", says="(see --help)")
    proc, _ = run(place, script, "--help")
    assert proc.returncode == 0 and proc.stdout.startswith("usage: ") and proc.stderr == "", proc.stderr


CKPT = "ckpts"
STEP = "ckpts/step_000001"
BAD = [  # (script, args, what the line says)
    ("export_hf", [CKPT, "out", "--max-shard-size", "5XB"], "--max-shard-size '5XB'"),
    ("export_hf", [CKPT, "out", "--max-shard-size", "0KB"], "must be positive"),
    ("export_hf", [CKPT, "out", "--dtype", "int8"], "argument --dtype: invalid choice"),
    ("export_hf", ["missing", "out"], "missing: no such run or checkpoint directory"),
    ("export_hf", [CKPT, CKPT], f"OUT_DIR {CKPT}: holds the source"),
    ("export_hf", [CKPT, STEP], f"OUT_DIR {STEP}: is the source"),
    ("export_hf", [CKPT, f"{STEP}/hf"], "lies inside the source"),
    ("export_hf", [CKPT, f"{CKPT}/latest"], "is a file, not a directory"),
    ("export_hf", [CKPT, "fifo-out"], "holds config.json, which is not a regular file"),
    ("reshard_checkpoint", [CKPT, "out", "--granularity", "x"], "argument --granularity: invalid choice"),
    ("reshard_checkpoint", [CKPT, "out", "--set", "parallelism.tp=two"], "parallelism.tp"),
    ("reshard_checkpoint", [CKPT, "out", "--set", "parallelism"], "expected section.field=value"),
    ("reshard_checkpoint", ["missing", "out"], "neither a complete checkpoint"),
    (
        "reshard_checkpoint",
        [CKPT, "out", "--set", "parallelism.tp=3"],
        "model.num_attention_heads (8) must be divisible by parallelism.tp (3)",
    ),
    (
        "reshard_checkpoint",
        [CKPT, "out", "--set", "parallelism.pp=3"],
        "model.num_layers (2) must be at least parallelism.pp (3)",
    ),
    ("reshard_checkpoint", [CKPT, "out", "--set", "parallelism.cp=2"], "offline resharding supports cp = 1"),
    ("reshard_checkpoint", [CKPT, "out", "--set", "parallelism.ep=2"], "parallelism.ep (2): the model is dense"),
    ("reshard_checkpoint", [CKPT, CKPT, "--set", "parallelism.tp=2"], f"DST {CKPT}: is the source"),
    ("reshard_checkpoint", [STEP, STEP], f"DST {STEP}: is the source"),
    ("reshard_checkpoint", [CKPT, f"{CKPT}/tp2", "--set", "parallelism.tp=2"], "lies inside the source"),
    ("reshard_checkpoint", [STEP, f"{STEP}/tp2"], "lies inside the source"),
    ("reshard_checkpoint", [STEP, CKPT, "--set", "parallelism.tp=2"], f"DST {CKPT}: holds the source"),
    ("reshard_checkpoint", [STEP, ".", "--set", "parallelism.tp=2"], "DST .: holds the source"),
    ("reshard_checkpoint", ["alien", "out"], "alien/step_000001/meta.json: not a nanotrain-checkpoint"),
    ("export_hf", ["alien", "out"], "alien/step_000001/meta.json: not a nanotrain-checkpoint"),
    ("hf_config", ["missing"], "missing"),
    ("inspect_topology", [TINY, "--rank", "8"], "--rank 8 is outside the world of 8 ranks"),
    ("inspect_topology", [TINY, "--rank", "x"], "argument --rank: invalid int value"),
    ("inspect_topology", [TINY, "--set", "parallelism.pp=99"], "parallelism.pp (99)"),
    ("generate", ["missing", "--prompt", "x"], "missing: no such run or checkpoint directory"),
    ("generate", ["alien", "--prompt", "x"], "alien/step_000001/meta.json: not a nanotrain-checkpoint"),
    ("generate", [CKPT, "--prompt", "x", "--step", "7"], "--step 7: no complete checkpoint"),
    ("generate", [CKPT, "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0: must be at least 1"),
    ("generate", [CKPT, "--prompt", "x", "--temperature", "1", "--top-p", "2"], "--top-p 2.0: must be in (0, 1]"),
    ("generate", [CKPT, "--prompt", ""], "--prompt is empty"),
    ("generate", [CKPT, "--prompt", "x" * 65], "longer than model.max_position_embeddings (64)"),
    ("fuzz_config", ["--limit", "-1"], "argument --limit: -1 must be >= 0"),
    ("fuzz_config", ["--subprocess", "x"], "argument --subprocess: 'x' is not an integer"),
]


@pytest.mark.parametrize("script, args, says", BAD, ids=[f"{s}:{' '.join(a)}" for s, a, _ in BAD])
def test_a_wrong_input_is_one_line_before_torch_and_writes_nothing(place, script, args, says):
    assert_refused(place, script, *args, says=says)


def test_a_failure_after_writing_began_removes_what_was_written(tmp_path):
    """``removed_on_failure``, which reshard and export write under: a new directory goes with
    the parents it needed; in an existing one only the new entries go."""
    from nanotrain.config.files import removed_on_failure

    with pytest.raises(KeyboardInterrupt), removed_on_failure(tmp_path / "new" / "out"):
        (tmp_path / "new" / "out" / "step_000001.tmp").mkdir(parents=True)
        raise KeyboardInterrupt
    assert listing(tmp_path) == []
    (tmp_path / "kept").write_text("x")
    with pytest.raises(OSError), removed_on_failure(tmp_path):
        (tmp_path / "step_000001.tmp").mkdir()
        (tmp_path / "step_000001.tmp" / "meta.json").write_text("{}")
        (tmp_path / "model.safetensors.partial").write_text("")
        raise OSError("disk full")
    assert listing(tmp_path) == ["kept"]


def test_reshard_and_export_failing_midway_leave_nothing(place, tmp_path, monkeypatch):
    """A write that fails after the first files are out (a full disk, Ctrl-C) leaves the output
    as it was: reshard's step_N.tmp and the DST it made, export's OUT_DIR, are gone."""
    from nanotrain.checkpoint import reshard, shard_files
    from nanotrain.hf import export as hf_export

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shard_files, "write_optimizer_shards", disk_full)  # after the model shards
    with pytest.raises(OSError, match="No space"):
        reshard.reshard_offline(place / CKPT, tmp_path / "new" / "dst", ["parallelism.tp=2"])
    (tmp_path / "dst").mkdir()
    with pytest.raises(OSError, match="No space"):
        reshard.reshard_offline(place / CKPT, tmp_path / "dst", ["parallelism.tp=2"])
    monkeypatch.setattr(hf_export, "export_tokenizer", disk_full)  # after the weight files
    with pytest.raises(OSError, match="No space"):
        hf_export.export_hf(place / CKPT, tmp_path / "hf")
    assert listing(tmp_path) == ["dst"]
