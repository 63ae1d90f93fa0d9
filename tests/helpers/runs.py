"""CLI runs of the tiny config (`submit.py configs/tiny_cpu.yaml --local`), and the reference runs
several test files compare against, made once per test session (``SharedRuns``).

Every run here uses the same settings — ``STEPS`` steps, a loss logged every step, no interval
checkpoints, a short warm-up so that the loss visibly falls — and one of ``TOPOLOGIES``, which all
keep the global batch (dp x micro-batches x micro-batch size = 16 samples). So the uninterrupted
(1,1,1), (2,2,2) and (cp2, tp2, pp2) runs serve test_trainer_cli (same losses at every layout),
test_resume_local (bit-exact resume) and test_resume_reshard (resume at other layouts) alike, and
one preempted (2,2,2) run is copied by every test that resumes it.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from safetensors.numpy import load_file
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from nanotrain.config import load_config
from nanotrain.data.build import prepare_dataset

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
STEPS = 15
SETTINGS = [
    f"training.train_steps={STEPS}",
    "logging.log_interval=1",
    "checkpoints.interval=0",
    "optimizer.warmup_steps=3",
]
TOPOLOGIES = {
    "1-1-1": ["parallelism.dp=1", "parallelism.tp=1", "parallelism.pp=1", "training.batch_accumulation_per_replica=8"],
    "2-2-2": [],
    # context parallel, sequence-parallel tp, ZeRO-1 over dp x cp: the optimizer shards sit on cp ranks
    "cp2-tp2-pp2-zero1": [
        "parallelism.dp=1",
        "parallelism.cp=2",
        "parallelism.tp_mode=REDUCE_SCATTER",
        "optimizer.zero_stage=1",
        "training.batch_accumulation_per_replica=8",
    ],
}


def cli(*args: str) -> list[str]:
    return [sys.executable, str(ROOT / "submit.py"), *args]


def set_args(items) -> list[str]:
    """``--set ITEM`` for each ``section.field=value`` item."""
    return [arg for item in items for arg in ("--set", item)]


def overrides(logs: Path, name: str, topology: str) -> list[str]:
    items = [f"logging.dir={logs}", f"logging.run_name={name}", *SETTINGS, *TOPOLOGIES[topology]]
    return set_args(items)


def warm_data_cache(logs: Path) -> None:
    """Tokenise the tiny config's data into the run's cache now (the product's own builder):
    with a collective timeout of seconds, rank 0 tokenising at start-up on a loaded machine
    would otherwise time out the others' start-up barrier before training begins."""
    t = load_config(str(TINY)).training
    prepare_dataset(
        load_config(str(TINY)).data, seq_len=t.sequence_length, cache_dir=str(logs / ".cache" / "data"), vocab_size=256
    )


def tb_losses(run_dir: Path) -> list[tuple[int, float]]:
    events = EventAccumulator(str(run_dir / "tb"))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars("train/loss")]


def resumes(log: str) -> list[tuple[int, int | None]]:
    """(step resumed at, first step the resumed process then logged; None if none) for every
    "resumed from ... at step S (...)" line of a run's console log, in order. A process that
    loaded step S trains step S + 1 next; one that started over would log step 1: real evidence
    of a resume, where the printed label is only the product's claim."""
    found, pending = [], None
    for line in log.splitlines():
        loaded = re.search(r"resumed from \S+ at step (\d+) \(", line)
        if loaded:
            if pending is not None:
                found.append((pending, None))
            pending = int(loaded.group(1))
            continue
        stepped = re.match(r"step (\d+)/\d+ ", line)
        if stepped and pending is not None:
            found.append((pending, int(stepped.group(1))))
            pending = None
    if pending is not None:
        found.append((pending, None))
    return found


def tb_first_steps(run_dir: Path) -> list[int]:
    """The first `train/loss` step of each process that wrote `<run_dir>/tb` (one event file
    each), oldest first. A process that resumed a checkpoint of step S logs S + 1 first, one that
    started over logs 1: evidence of a resume where no step lines reach the log (SLURM jobs)."""

    def started(path: Path) -> tuple[int, str]:  # events.out.tfevents.<unix time>.<host>.<pid>...
        return int(path.name.split(".")[3]), path.name

    firsts = []
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*"), key=started):
        events = EventAccumulator(str(path))
        events.Reload()
        if "train/loss" in events.Tags()["scalars"]:
            firsts.append(events.Scalars("train/loss")[0].step)
    return firsts


def final_weights(run_dir: Path) -> dict:
    latest = run_dir / "checkpoints" / "latest"
    step_dir = latest.resolve() if latest.is_symlink() else run_dir / "checkpoints" / latest.read_text().strip()
    tensors = {}
    for path in sorted((step_dir / "model").rglob("*.safetensors")):
        for key, value in load_file(str(path)).items():
            tensors[f"{path.relative_to(step_dir)}:{key}"] = value
    return tensors


def preempt_when_past(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float) -> None:
    """Send SIGUSR2 to `submit.py --local` once the run has logged `step`."""
    deadline = time.monotonic() + timeout
    progress = run_dir / "progress.json"
    while time.monotonic() < deadline and proc.poll() is None:
        if progress.is_file() and json.loads(progress.read_text())["step"] >= step:
            proc.send_signal(signal.SIGUSR2)
            return
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"run never reached step {step} (exit {proc.poll()})")


def train(logs: Path, name: str, topology: str) -> Path:
    """An uninterrupted run; returns its run directory."""
    proc = subprocess.run(
        cli(str(TINY), "--local", *overrides(logs, name, topology)), capture_output=True, text=True, timeout=400
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return logs / name


def run_until_preempted(logs: Path, name: str, topology: str) -> int:
    """A local run that gets SIGUSR2 past step 5: it saves and exits 0; returns the saved step."""
    run_dir = logs / name
    proc = subprocess.Popen(
        cli(str(TINY), "--local", *overrides(logs, name, topology)),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        preempt_when_past(proc, run_dir, 5, timeout=300)
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert "preempted at step" in out and f"--resume {run_dir}" in out, out[-3000:]
    stopped = json.loads((run_dir / "progress.json").read_text())["step"]
    assert 5 <= stopped < STEPS
    return stopped


class SharedRuns:
    """The reference runs of a test session, each made on first use (see the module doc).
    Tests only read them; a test that resumes one works on its own copy."""

    def __init__(self, root: Path):
        self.root = root
        self._straight: dict[str, Path] = {}
        self._preempted: dict[str, tuple[Path, int]] = {}

    def straight(self, topology: str) -> Path:
        """The uninterrupted run at ``topology``."""
        if topology not in self._straight:
            self._straight[topology] = train(self.root, f"straight-{topology}", topology)
        return self._straight[topology]

    def preempted_copy(self, topology: str, dest: Path) -> tuple[Path, int]:
        """A copy, at ``dest``, of the run at ``topology`` preempted past step 5 (it saved and
        stopped); returns (its run directory, the step it stopped at)."""
        if topology not in self._preempted:
            name = f"preempted-{topology}"
            self._preempted[topology] = (self.root / name, run_until_preempted(self.root, name, topology))
        source, stopped = self._preempted[topology]
        shutil.copytree(source, dest)
        return dest, stopped
