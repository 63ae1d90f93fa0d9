"""The stages of benchmarks/gpu_check.sh, under one time budget; ``--cpu-smoke`` runs the same
stages on CPU (tiny model, gloo), so that CI proves their logic where no GPU is lent.

    benchmarks/gpu_check.sh                                   # how it is run (finds Python, wheels)
    python benchmarks/gpu_trainer_check.py --out DIR [--start EPOCH] [--budget S] [--steps S]
    python benchmarks/gpu_trainer_check.py --out DIR --cpu-smoke

The budget (``--budget``, GPU_CHECK_BUDGET, 290 s) counts from ``--start`` (the shell script's
start); each stage gets min(its cap, what is left), every subprocess a timeout, after which its
whole process tree is killed (rc 124: the local launcher's ranks run in sessions of their own, so
a process-group kill alone would leave them holding GPUs). ``DIR/gpu_check.json`` is rewritten
after every stage; logs go to ``DIR/gpu_check/``; run directories and checkpoints stay in a
temporary folder. Exit 0 only when every stage that ran passed (skipped and unavailable pass).

1. versions: Python, torch, CUDA, cuDNN, NCCL, the GPUs, ``nvidia-smi -L``, the packages the
   trainer imports. In a subprocess: this driver never creates a CUDA context, which would hold
   memory on GPU 0 beside the runs it measures.
2. gpu-tests: ``pytest -m gpu tests/test_gpu.py`` (skipped by --cpu-smoke: every test needs CUDA).
3. trainer: ``python -m nanotrain.runtime.task`` at world size 1 (the module run as ``__main__``
   by runpy, in a process that reads the CUDA allocator's peaks when it ends), the first job's
   settings (bf16, ZeRO-1, fused AdamW, tp_mode ALL_REDUCE, its env) on a 0.18 B Llama, sequence 2048, the
   stdlib corpus, a constant learning rate after warm-up (so a run extended by a resume follows
   the uninterrupted one step for step):
   * ``uninterrupted``: 3S steps;
   * ``first``: S steps, a sync save at S; ``resumed``: the same run directory with
     ``checkpoints.resume`` to 2S (model, fused AdamW / ZeRO-1 state, scheduler and RNG loaded),
     async saves every S/2 steps (the first one's copies overlap the next step); ``resumed-async``:
     from that async save at 2S to 3S. Steps S+1..3S must give the uninterrupted run's losses: the
     max |difference| is reported; not bit-identical passes only as "within nondeterminism", when
     two fresh runs (``first`` and ``uninterrupted``, steps 1..S) differ too and the resumed
     difference is at most 10 times theirs;
   * ``compiled``: ``training.compile: true`` (decoder layers compiled, forward and backward), 3
     steps: losses finite and within 2% of eager. Skipped by --cpu-smoke: inductor takes ~55 s for
     the tiny model on the CI machine's CPU, past the 20 s this smoke may spend on it;
   * memory of the uninterrupted run: ``max_memory_allocated``, ``max_memory_reserved``, the
     device-wide peak (``mem_get_info``, sampled every 0.25 s: context, NCCL, allocator reserve)
     beside the --dry-run estimate.
   The GPU machine has no ``datasets`` (its wheels are 66 MB, pyarrow alone 55 MB), which the
   trainer needs only to tokenise a corpus that has no cache yet: this stage writes the stdlib
   corpus's byte-tokenised cache itself (``write_token_cache``: the files, ids, separators and
   meta.json nanotrain's own tokenisation writes; --cpu-smoke checks them byte for byte, and runs
   the trainer with ``datasets`` made unimportable, as on the GPU machine).
4. multi-gpu: with >= 4 GPUs tp2 x pp2 1f1b, with 2-3 pp2 1f1b, through ``submit.py --local``: an
   uninterrupted run of 2S steps, S steps with a save, ``submit.py --resume`` to 2S, the same loss
   check. Skipped on one GPU (NCCL refuses two ranks on one device) and by --cpu-smoke (4 ranks
   cost ~20 s on 2 cores: the layout's config is validated instead).
5. flight-recorder: one process (NCCL on GPU 0; gloo under --cpu-smoke) with nanotrain's
   flight-recorder settings (``runtime/hang.py:nccl_debug_env``, the installed torch's variable
   names) all-reduces through ``parallel/collectives.py``, then the hang watchdog writes its
   report: the settings must point into the run's ``hang/`` directory, the report must name the
   last collective and embed torch's record of it (``nccl:all_reduce``), and torch's own dump
   file must be beside it (``hang/nccl_trace_rank_0``, for ``torchfrtrace``). On a GPU, NCCL's
   own dump is also triggered through its debug pipe and looked for there (reported).
6. rehearsal: ``submit.py CONFIG --rehearse --rank 0 --steps 3S --json`` on stage 3's config:
   rehearsed peak total / the uninterrupted run's ``max_memory_allocated``; "unavailable" while
   submit.py has no --rehearse. Skipped by --cpu-smoke (it starts a fresh interpreter for each
   rehearsed rank: 6-20 s on 2 cores) unless GPU_CHECK_SMOKE_REHEARSE=1.
7. masked-attention: ``masked_attention.py --gpu-check``: compiled FlexAttention forward and
   backward (``model.attention_kernel: flex``) on the GPU against the CPU reference (SDPA under
   the materialised document mask, float64), the whole window and a cp2 rank's zig-zag queries;
   then tokens/s and peak memory of causal, sdpa_mask and flex at S = 8192 (bf16); fails when flex
   differs (relative 1e-4) or its peak exceeds 1.1 x causal's. Skipped with less than 45 s of the
   budget left (GPU_CHECK_BUDGET=380 leaves it room); --cpu-smoke runs its logic on the CPU with
   eager FlexAttention, forward only.
8. bench: ``gpu_train_bench.py`` (the ~1.1 B model's tokens/s and MFU) only with GPU_CHECK_BENCH=1
   (GPU_CHECK_COMPILE=1: also compiled, in what is left); --cpu-smoke runs its own smoke.

Under --cpu-smoke the Python runs fork from one process that imported torch and nanotrain once
(nanotrain's fork server, as a local CPU job's ranks do): ~3 CPU seconds less each. On a GPU
every run is a fresh interpreter.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
THIS = str(Path(__file__).resolve())
PY = sys.executable

BUDGET_S = 290.0  # under 5 minutes: a rerun fits a 15-minute lease with the machine's start-ups
CAPS_S = {
    "versions": 30,
    "gpu-tests": 75,
    "trainer": 150,
    "multi-gpu": 120,
    "flight-recorder": 30,
    "rehearsal": 30,
    "masked-attention": 90,
    "bench": 150,
}
MASKED_MIN_S = 45.0  # less left than this for the masked-attention stage: skipped (two flex compiles)
RUN_CAP_S = 60.0  # one trainer run (the compiled one: COMPILE_CAP_S)
COMPILE_CAP_S = 90.0
MIN_STAGE_S = 5.0  # less left than this: the stage is skipped, not started
PASSING = ("passed", "skipped", "unavailable")
NOISE_FACTOR = 10.0  # a resumed loss may differ by this times two fresh runs' difference (nondeterminism)
COMPILE_STEPS = 3
COMPILE_REL_TOL = 0.02
SMOKE_CACHE_DOCS = 50  # --cpu-smoke: documents tokenised both ways and compared byte for byte

GPU_MODEL = dict(
    vocab_size=256,
    hidden_size=1024,
    intermediate_size=4096,
    num_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=2048,
    dtype="bfloat16",
)  # 0.18 B parameters
CPU_MODEL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    dtype="bfloat16",
)
REQUIRED = ("torch", "numpy", "yaml", "safetensors", "tensorboard", "submitit", "cloudpickle", "pytest")
OPTIONAL = ("datasets", "transformers")
SINGLE_RANK_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


class Stopped(Exception):
    """SIGTERM or SIGINT reached the check (the caller's timeout): the summary so far is kept."""


# ---------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    return kids


def _descendants(pid: int) -> set[int]:
    kids, found, todo = _children(), set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` (started with its own session), its group and every process it started:
    a local run's ranks (and the fork server) run in sessions of their own, which a group kill
    misses. The group is stopped first, so that nothing starts between the listing and the kill."""
    pids = _descendants(proc.pid)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        pids |= _descendants(proc.pid)
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    proc.wait()


class Check:
    """The budget, the subprocesses and the summary of one check."""

    def __init__(self, out: Path, start: float, budget: float, smoke: bool):
        self.out, self.start, self.budget, self.smoke = out, start, budget, smoke
        self.logs = out / "gpu_check"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.summary: dict = {
            "mode": "cpu-smoke" if smoke else "gpu",
            "budget_s": budget,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(start)),
            "stages": [],
        }
        self.facts: dict = {}  # what a later stage needs from an earlier one (GPU count, the reference memory)
        self.ws: Workspace | None = None

    def left(self) -> float:
        return self.budget - (time.time() - self.start)

    def stage(self, name: str, fn) -> dict:
        limit = min(CAPS_S[name], self.left())
        entry: dict = {"name": name, "cap_s": CAPS_S[name], "limit_s": round(max(0.0, limit))}
        print(f"== {name} (up to {max(0.0, limit):.0f} s)", flush=True)
        t0 = time.monotonic()
        stopped = None
        if limit < MIN_STAGE_S:
            entry.update(
                status="timeout",
                rc=124,
                note=f"not started: {max(0.0, self.left()):.0f} s left of the {self.budget:.0f} s budget",
            )
        else:
            try:
                entry.update(fn(self, time.monotonic() + limit))
            except Stopped as exc:
                entry.update(status="timeout", rc=124, note="the check was stopped during this stage")
                stopped = exc
            except Exception as exc:  # noqa: BLE001 - one stage's bug must not lose the others' results
                entry.update(status="failed", note=f"{type(exc).__name__}: {exc}"[:500])
        entry["wall_s"] = round(time.monotonic() - t0, 1)
        self.summary["stages"].append(entry)
        self.write()
        print(f"   {entry['status']}: {entry.get('note', '')}", flush=True)
        if stopped is not None:
            raise stopped
        return entry

    def write(self) -> None:
        self.summary["elapsed_s"] = round(time.time() - self.start, 1)
        self.summary["ok"] = all(s["status"] in PASSING for s in self.summary["stages"])
        self.summary["complete"] = len(self.summary["stages"]) == len(STAGES)
        path = self.out / "gpu_check.json"
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.summary, indent=1) + "\n")
        os.replace(tmp, path)

    def run(
        self,
        cmd: list[str],
        name: str,
        deadline: float,
        cap: float = math.inf,
        env: dict | None = None,
        fork: bool = False,
    ) -> dict:
        """``cmd`` in a session of its own, output to ``logs/NAME.log``, killed with everything it
        started at min(deadline, now + cap): rc 124. ``fork`` (with ``env``, --cpu-smoke only):
        forked from the workspace's fork server instead of started afresh."""
        timeout = max(1.0, min(cap, deadline - time.monotonic()))
        log = self.logs / f"{name}.log"
        t0 = time.monotonic()
        with open(log, "w") as fh:
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            if fork and self.smoke:
                proc = self.ws.fork(cmd, env, fh.fileno())
            else:
                proc = subprocess.Popen(
                    cmd,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    cwd=ROOT,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_tree(proc)
                rc = 124
                fh.write(f"\n[gpu check] killed after {timeout:.0f} s (rc 124)\n")
            except Stopped:
                kill_tree(proc)
                raise
        return {"rc": rc, "wall_s": round(time.monotonic() - t0, 1), "log": str(log.relative_to(self.out))}

    def log_text(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def stop(self, signum, _frame) -> None:
        raise Stopped(signal.Signals(signum).name)


def last_json(text: str) -> dict | None:
    for line in reversed(text.splitlines()):
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except ValueError:
                continue
            if isinstance(value, dict):
                return value
    return None


# ---------------------------------------------------------------------------- the trainer's runs
def base_config(logs: Path, smoke: bool) -> dict:
    return {
        # configs/3d_16gpu.yaml's settings where the check can keep them (its env included)
        "parallelism": {"tp_mode": "ALL_REDUCE", "tp_linear_async_communication": False},
        "model": dict(CPU_MODEL if smoke else GPU_MODEL),
        "training": {
            "train_steps": 1,
            "sequence_length": 64 if smoke else 2048,
            "micro_batch_size": 2 if smoke else 4,
            "batch_accumulation_per_replica": 2,
            "seed": 42,
        },
        # constant after warm-up: the learning rates do not depend on train_steps, so a run
        # extended by a resume follows the uninterrupted one step for step
        "optimizer": {
            "lr": 4e-4,
            "weight_decay": 0.1,
            "betas": [0.9, 0.95],
            "clip_grad": 1.0,
            "warmup_steps": 2,
            "lr_decay_style": "constant",
            "zero_stage": 1,
        },
        "data": {"source": "stdlib", "tokenizer": "byte"},
        "checkpoints": {"interval": 0, "resume": True},
        "logging": {"dir": str(logs), "log_interval": 1, "tensorboard": True},
        "slurm": {"env": {"CUDA_DEVICE_MAX_CONNECTIONS": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}},
    }


class Workspace:
    """The temporary folder of the trainer's runs: configs, run directories, the token cache."""

    def __init__(self, tmp: Path, smoke: bool, steps: int):
        self.tmp, self.smoke, self.steps = tmp, smoke, steps
        self.logs = tmp / "logs"
        self.base = base_config(self.logs, smoke)
        self.port = 29600 + os.getpid() % 300
        env = {k: v for k, v in os.environ.items() if k not in SINGLE_RANK_VARS}
        paths = [str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
        if smoke:  # as on the GPU machine: no `datasets` for the trainer
            shim = tmp / "no-datasets" / "datasets"
            shim.mkdir(parents=True)
            (shim / "__init__.py").write_text(
                'raise ImportError("datasets: not installed on the GPU machine '
                '(made unimportable by gpu_trainer_check.py --cpu-smoke)")\n'
            )
            paths.insert(0, str(shim.parent))
        self.env = dict(env, PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1")
        if smoke:  # CPU even where a GPU is visible: a forked run must never initialise CUDA
            self.env["CUDA_VISIBLE_DEVICES"] = ""
        self.cache: dict | None = None
        self._server, self._forks = None, 0

    def fork(self, cmd: list[str], env: dict, out_fd: int):
        """--cpu-smoke: ``cmd`` (this Python, a module or a script) forked from one process that
        imported torch and nanotrain once — nanotrain's own way of starting CPU ranks
        (``launch/forkserver.py``), which saves ~3 CPU seconds of imports a run. On a GPU every
        run is a fresh interpreter (CUDA does not support a fork after its initialisation)."""
        from nanotrain.launch.forkserver import ForkServer, python_target

        if self._server is None:
            self._server = ForkServer(self.env)
        self._forks += 1
        return self._server.start(self._forks, python_target(cmd), env, out_fd)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()

    def config(self, name: str, items: dict) -> Path:
        """The base config with ``items`` ({"section.field": value}) as ``NAME.yaml``."""
        import copy

        import yaml

        raw = copy.deepcopy(self.base)
        for key, value in items.items():
            section, field = key.split(".")
            raw.setdefault(section, {})[field] = value
        path = self.tmp / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def single_rank_env(self) -> dict:
        self.port += 1
        return dict(
            self.env,
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(self.port),
        )

    def token_cache(self) -> dict:
        """Where ``datasets`` is missing (the GPU machine; always under --cpu-smoke), write the
        stdlib cache the trainer would otherwise tokenise; once per check."""
        if self.cache is None:
            if self.smoke or importlib.util.find_spec("datasets") is None:
                t0 = time.monotonic()
                self.cache = write_token_cache(self.config("data", {}))
                self.cache["how"] = "written by the check (no datasets for the trainer)"
                self.cache["seconds"] = round(time.monotonic() - t0, 1)
                if self.smoke and importlib.util.find_spec("datasets") is not None:  # this driver has it
                    self.cache["same_as_nanotrain"] = token_cache_matches(self.config("data", {}), self.tmp)
            else:
                self.cache = {"how": "tokenised by the first run (datasets present)"}
        return self.cache


def write_token_cache(config_path: Path, cache_dir: str | None = None, max_documents: int | None = None) -> dict:
    """The stdlib corpus's token cache as ``nanotrain.data.dataset`` writes it, without `datasets`:
    every file read as UTF-8 (bad bytes replaced), its ids and the separator, empty files
    skipped, in the corpus's order; the meta.json that marks it complete, written last."""
    import numpy as np

    from nanotrain.config import load_config
    from nanotrain.config.atomic_files import atomic_write
    from nanotrain.data.dataset import cache_location, default_cache_dir, write_cache_meta
    from nanotrain.data.sources import STDLIB, resolve_source
    from nanotrain.data.tokenizer import load_tokenizer, token_dtype

    config = load_config(str(config_path))
    d = config.data
    tokenizer = load_tokenizer(d.tokenizer, config.model.vocab_size)
    source = resolve_source(d.source)
    if source.kind != STDLIB:
        raise ValueError(f"write_token_cache: only the stdlib corpus, not {d.source!r}")
    path, key = cache_location(source, tokenizer, d, cache_dir or default_cache_dir(config), max_documents)
    meta_path = os.path.join(path, "meta.json")
    if os.path.exists(meta_path):
        return {"path": path, "written": False}
    files = source.files[:max_documents] if max_documents is not None else source.files
    dtype = token_dtype(tokenizer.vocab_size)
    sep = np.array([tokenizer.separator_id], dtype)
    counts = {"tokens": 0, "docs": 0}

    def write(fh) -> None:
        for name in files:
            with open(name, "rb") as src:
                ids = tokenizer.encode_batch([src.read().decode("utf-8", errors="replace")])[0]
            if len(ids):
                fh.write(np.append(ids.astype(dtype), sep).tobytes())
                counts["tokens"] += len(ids) + 1
                counts["docs"] += 1

    os.makedirs(path, exist_ok=True)
    atomic_write(os.path.join(path, "tokens.bin"), write)
    write_cache_meta(path, source, d.text_column, tokenizer, dtype, counts, max_documents, key)
    return {"path": path, "written": True, "tokens": counts["tokens"], "documents": counts["docs"]}


def token_cache_matches(config_path: Path, tmp: Path) -> bool:
    """--cpu-smoke: the first SMOKE_CACHE_DOCS documents through nanotrain's own tokenisation
    (with `datasets`) and through ``write_token_cache``: the same tokens.bin and meta.json."""
    from nanotrain.config import load_config
    from nanotrain.data.dataset import TokenDataset

    config = load_config(str(config_path))
    ours = write_token_cache(config_path, str(tmp / "cache-ours"), SMOKE_CACHE_DOCS)["path"]
    theirs = TokenDataset.build(
        config.data,
        seq_len=config.training.sequence_length,
        cache_dir=str(tmp / "cache-nt"),
        vocab_size=config.model.vocab_size,
        max_documents=SMOKE_CACHE_DOCS,
    ).path
    same = all((Path(ours) / f).read_bytes() == (Path(theirs) / f).read_bytes() for f in ("tokens.bin",))
    return same and json.loads((Path(ours) / "meta.json").read_text()) == json.loads(
        (Path(theirs) / "meta.json").read_text()
    )


def tb_losses(run_dir: Path) -> dict[int, float]:
    """train/loss of every step the run directory's TensorBoard events hold (float32, as logged)."""
    if not (run_dir / "tb").is_dir():
        return {}
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tb"), size_guidance={"scalars": 0})
    events.Reload()
    if "train/loss" not in events.Tags().get("scalars", []):
        return {}
    return {e.step: e.value for e in events.Scalars("train/loss")}


def read_run(run_dir: Path, log: str, memory: Path | None = None) -> dict:
    out: dict = {}
    progress = run_dir / "progress.json"
    if progress.is_file():
        p = json.loads(progress.read_text())
        out.update({k: p.get(k) for k in ("step", "loss", "tokens_per_sec", "mfu", "peak_mem_gb")})
    resumed = re.search(r"resumed from \S+ at step (\d+)", log)
    out["resumed_from_step"] = int(resumed.group(1)) if resumed else None
    if memory is not None and memory.is_file():
        out["memory"] = json.loads(memory.read_text())
    out["all_losses"] = tb_losses(run_dir)
    return out


def compare(reference: dict[int, float], got: dict[int, float], steps: range) -> dict:
    missing = [s for s in steps if s not in got or s not in reference]
    diffs = [abs(got[s] - reference[s]) for s in steps if s in got and s in reference]
    worst = None if not diffs else (math.inf if any(math.isnan(d) for d in diffs) else max(diffs))
    return {
        "steps": [steps.start, steps.stop - 1],
        "max_abs_diff": worst,
        "missing_steps": missing,
        "identical": not missing and worst == 0.0,
    }


def resume_verdict(cmp: dict, noise: float | None, resumed_from: int | None, expected_from: int) -> tuple[bool, str]:
    if resumed_from != expected_from:
        return False, f"did not resume from step {expected_from} (resumed from {resumed_from})"
    if cmp["missing_steps"]:
        return False, f"losses missing at steps {cmp['missing_steps']}"
    if cmp["identical"]:
        return True, "identical"
    d = cmp["max_abs_diff"]
    if noise and d <= NOISE_FACTOR * noise:
        return True, (
            f"NOT bit-identical: max |diff| {d:.3g}, within nondeterminism (two fresh runs differ by {noise:.3g})"
        )
    return False, f"max |diff| {d:.3g} (two fresh runs differ by {noise or 0:.3g})"


def leg_summary(r: dict, steps: range | None = None) -> dict:
    """A run's record for the summary: its own steps' losses, not the run directory's all."""
    losses = r.pop("all_losses", {})
    if steps is not None:
        r["losses"] = [[s, losses[s]] for s in steps if s in losses]
    return r


def train(check: Check, name: str, run_name: str, items: dict, deadline: float, cap: float = RUN_CAP_S) -> dict:
    ws = check.ws
    cfg = ws.config(name, {"logging.run_name": run_name, **items})
    memory = ws.tmp / f"{name}.memory.json"
    log = f"trainer-{name}"
    result = {
        "name": name,
        "train_steps": items["training.train_steps"],
        "config": str(cfg),
        **check.run(
            [PY, THIS, "--task", str(cfg), "--memory-out", str(memory)],
            log,
            deadline,
            cap,
            ws.single_rank_env(),
            fork=True,
        ),
    }
    result.update(read_run(ws.logs / run_name, check.log_text(log), memory))
    result["ok"] = result["rc"] == 0 and result.get("step") == result["train_steps"]
    return result


def stage_trainer(check: Check, deadline: float) -> dict:
    ws = check.ws
    S = ws.steps
    out: dict = {"steps_S": S, "token_cache": ws.token_cache()}
    legs = [
        ("uninterrupted", "uninterrupted", {"training.train_steps": 3 * S}),
        ("first", "resume", {"training.train_steps": S, "checkpoints.interval": S}),
        (
            "resumed",
            "resume",
            {"training.train_steps": 2 * S, "checkpoints.interval": max(1, S // 2), "checkpoints.async_save": True},
        ),
        ("resumed-async", "resume", {"training.train_steps": 3 * S}),
        ("compiled", "compiled", {"training.train_steps": COMPILE_STEPS, "training.compile": True}),
    ]
    runs: dict[str, dict] = {}
    problems, timed_out = [], False
    for name, run_name, items in legs:
        if name == "compiled" and ws.smoke:
            out["compile"] = {
                "status": "skipped",
                "note": "cpu-smoke: inductor takes ~55 s for the tiny model on the CI machine's CPU (> 20 s)",
            }
            continue
        needs = {"resumed": "first", "resumed-async": "resumed"}.get(name)
        if needs and not runs.get(needs, {}).get("ok"):
            problems.append(f"{name}: not run ({needs} did not pass)")
            continue
        if deadline - time.monotonic() < MIN_STAGE_S:
            problems.append(f"{name}: no time left")
            timed_out = True
            continue
        cap = COMPILE_CAP_S if name == "compiled" else RUN_CAP_S
        r = runs[name] = train(check, name, run_name, items, deadline, cap)
        print(f"   {name}: rc {r['rc']}, step {r.get('step')}, loss {r.get('loss')}, {r['wall_s']} s", flush=True)
        if not r["ok"]:
            timed_out |= r["rc"] == 124
            problems.append(f"{name}: rc {r['rc']}, step {r.get('step')} of {r['train_steps']} (log {r['log']})")
        if name in ("uninterrupted", "resumed-async", "compiled"):  # checkpoints: gigabytes
            shutil.rmtree(ws.logs / run_name, ignore_errors=True)

    ref = runs.get("uninterrupted", {}).get("all_losses", {})
    if runs.get("uninterrupted", {}).get("ok"):
        u = runs["uninterrupted"]
        check.facts["reference_memory"] = u.get("memory", {})
        out["memory"] = memory_report(u, Path(u["config"]))
    noise = None
    if ref and runs.get("first", {}).get("ok"):
        fresh = compare(ref, runs["first"]["all_losses"], range(1, S + 1))
        out["fresh_runs"] = fresh  # two runs from scratch: what differs here is nondeterminism
        noise = fresh["max_abs_diff"]
    for key, name, steps, start in (
        ("resume_sync", "resumed", range(S + 1, 2 * S + 1), S),
        ("resume_async", "resumed-async", range(2 * S + 1, 3 * S + 1), 2 * S),
    ):
        if ref and runs.get(name, {}).get("ok"):
            cmp = compare(ref, runs[name]["all_losses"], steps)
            ok, cmp["verdict"] = resume_verdict(cmp, noise, runs[name]["resumed_from_step"], start)
            out[key] = cmp
            if not ok:
                problems.append(f"{key}: {cmp['verdict']}")
    if ref and runs.get("compiled", {}).get("ok"):
        got = runs["compiled"]["all_losses"]
        steps = range(1, COMPILE_STEPS + 1)
        rel = [abs(got[s] - ref[s]) / abs(ref[s]) for s in steps if s in got and s in ref]
        finite = len(rel) == COMPILE_STEPS and all(math.isfinite(got[s]) for s in steps)
        worst = max(rel) if rel and finite else None
        ok = finite and worst <= COMPILE_REL_TOL
        out["compile"] = {
            "status": "passed" if ok else "failed",
            "max_rel_diff_vs_eager": worst,
            "losses": [[s, got.get(s)] for s in steps],
            "eager": [[s, ref.get(s)] for s in steps],
            "wall_s": runs["compiled"]["wall_s"],
            "memory": runs["compiled"].get("memory"),
        }
        if not ok:
            problems.append(f"compile: losses {out['compile']['losses']} vs eager {out['compile']['eager']}")
    spans = {
        "uninterrupted": range(1, 3 * S + 1),
        "first": range(1, S + 1),
        "resumed": range(S + 1, 2 * S + 1),
        "resumed-async": range(2 * S + 1, 3 * S + 1),
        "compiled": range(1, COMPILE_STEPS + 1),
    }
    out["runs"] = [leg_summary(r, spans[name]) for name, r in runs.items()]
    if problems:
        status = "timeout" if timed_out else "failed"
        return {"status": status, "rc": 124 if timed_out else 1, "note": "; ".join(problems), **out}
    notes = [f"resume: sync {out['resume_sync']['verdict']}, async {out['resume_async']['verdict']}"]
    if out.get("compile", {}).get("status") == "passed":
        notes.append(f"compile: max rel diff {out['compile']['max_rel_diff_vs_eager']:.2g}")
    else:
        notes.append("compile: skipped")
    mem = out.get("memory", {})
    if mem.get("max_memory_allocated_gib") is not None:
        notes.append(
            f"peak {mem['max_memory_allocated_gib']} GiB allocated, {mem['max_memory_reserved_gib']} "
            f"reserved, {mem.get('device_used_peak_gib')} on the device "
            f"(estimate {mem['dry_run_estimate_gib']})"
        )
    u = runs["uninterrupted"]
    if u.get("mfu") is not None:
        notes.append(f"{u['tokens_per_sec']:,.0f} tokens/s, MFU {100 * u['mfu']:.1f}%")
    return {"status": "passed", "rc": 0, "note": "; ".join(notes), **out}


def memory_report(run: dict, config_path: Path) -> dict:
    from nanotrain.config import load_config
    from nanotrain.estimate.memory import GB, estimate_memory

    m = run.get("memory", {})

    def gib(key: str) -> float | None:
        return round(m[key] / 2**30, 2) if m.get(key) is not None else None

    report = {
        "dry_run_estimate_gib": round(estimate_memory(load_config(str(config_path))).total / GB, 2),
        "max_memory_allocated_gib": gib("max_memory_allocated"),
        "max_memory_reserved_gib": gib("max_memory_reserved"),
        "device_used_peak_gib": gib("device_used_peak_bytes"),
        "device_total_gib": gib("device_total_bytes"),
        "peak_rss_gib": gib("peak_rss_bytes"),
    }
    if report["max_memory_allocated_gib"]:
        report["estimate_over_allocated"] = round(
            report["dry_run_estimate_gib"] / report["max_memory_allocated_gib"], 3
        )
    return report


def task_with_memory(config: str, memory_out: Path) -> None:
    """``python -m nanotrain.runtime.task CONFIG``, run as ``__main__`` as ``-m`` does, in a
    process that then writes the CUDA allocator's peaks (allocated, reserved) and the highest
    device-wide use ``mem_get_info`` saw (sampled: context, NCCL buffers, the allocator's
    reserve) to ``memory_out`` — numbers the trainer's own metrics do not hold."""
    import resource
    import runpy
    import threading
    import warnings

    import torch

    device = int(os.environ.get("LOCAL_RANK", "0"))
    seen: dict = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.25):
            if torch.cuda.is_initialized():
                free, total = torch.cuda.mem_get_info(device)
                seen["device_used_peak_bytes"] = max(seen.get("device_used_peak_bytes", 0), total - free)
                seen["device_total_bytes"] = total

    if torch.cuda.is_available():
        threading.Thread(target=sample, name="gpu-check-memory", daemon=True).start()
    sys.argv = ["nanotrain.runtime.task", config]
    # forked (--cpu-smoke) from a process that imported the task module already: runpy says so
    warnings.filterwarnings("ignore", "'nanotrain.runtime.task' found in sys.modules", RuntimeWarning)
    try:
        runpy.run_module("nanotrain.runtime.task", run_name="__main__", alter_sys=True)
    finally:
        done.set()
        stats = {"device": "cpu", "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            free, total = torch.cuda.mem_get_info(device)
            stats.update(
                device=torch.cuda.get_device_name(device),
                max_memory_allocated=torch.cuda.max_memory_allocated(device),
                max_memory_reserved=torch.cuda.max_memory_reserved(device),
                device_used_at_exit_bytes=total - free,
                **seen,
            )
            stats["device_used_peak_bytes"] = max(stats.get("device_used_peak_bytes", 0), total - free)
        memory_out.write_text(json.dumps(stats) + "\n")


# ---------------------------------------------------------------------------- the other stages
VERSIONS = r"""
import importlib, importlib.metadata, importlib.util, json, platform, sys
out = {"python": platform.python_version(), "executable": sys.executable, "packages": {}}
for name in sys.argv[1].split(","):
    found = importlib.util.find_spec(name) is not None
    if found and name == "datasets":  # what the trainer would get (--cpu-smoke makes it unimportable)
        try:
            importlib.import_module(name)
        except ImportError:
            found = False
    try:
        out["packages"][name] = importlib.metadata.version({"yaml": "PyYAML"}.get(name, name)) if found else None
    except importlib.metadata.PackageNotFoundError:
        out["packages"][name] = "?"
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(), gpus=[])
    if torch.cuda.is_available():
        out.update(cudnn=torch.backends.cudnn.version(), nccl=".".join(map(str, torch.cuda.nccl.version())))
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            out["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                "sm": f"{p.major}{p.minor}", "sms": p.multi_processor_count})
except Exception as exc:
    out["error"] = f"torch: {exc!r}"
print(json.dumps(out))
"""


def stage_versions(check: Check, deadline: float) -> dict:
    script = check.ws.tmp / "versions.py"
    script.write_text(VERSIONS)
    r = check.run([PY, str(script), ",".join(REQUIRED + OPTIONAL)], "versions", deadline, env=check.ws.env, fork=True)
    info = last_json(check.log_text("versions")) or {}
    smi = "nvidia-smi not found"
    if shutil.which("nvidia-smi"):
        s = check.run(["nvidia-smi", "-L"], "nvidia-smi", deadline, cap=15)
        smi = check.log_text("nvidia-smi").splitlines()[1:] if s["rc"] == 0 else f"nvidia-smi -L: rc {s['rc']}"
    gpus = info.get("gpus") or []
    check.facts["gpus"] = len(gpus)
    missing = [name for name in REQUIRED if not (info.get("packages") or {}).get(name)]
    problems = [f"rc {r['rc']}"] if r["rc"] else []
    problems += [info["error"]] if info.get("error") else []
    problems += [f"missing {', '.join(missing)} (benchmarks/gpu_wheels.sh, then carry .whl/)"] if missing else []
    if not check.smoke and not gpus:
        problems.append("torch sees no CUDA device")
    what = (
        f"python {info.get('python')}, torch {info.get('torch')}, CUDA {info.get('cuda')}, "
        f"NCCL {info.get('nccl')}, {len(gpus)} x {gpus[0]['name'] if gpus else 'no GPU'}"
    )
    if not (info.get("packages") or {}).get("datasets"):
        what += "; no datasets (the check writes the token cache)"
    return {
        "status": "failed" if problems else "passed",
        "rc": r["rc"],
        "note": "; ".join(problems) or what,
        "nvidia_smi": smi,
        **info,
    }


def stage_gpu_tests(check: Check, deadline: float) -> dict:
    if check.smoke:
        return {"status": "skipped", "note": "cpu-smoke: every test in tests/test_gpu.py needs CUDA"}
    xml = check.logs / "gpu_tests.xml"
    r = check.run(
        [PY, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", "-p", "no:cacheprovider", f"--junitxml={xml}"],
        "gpu_tests",
        deadline,
        env=check.ws.env,
    )
    counts = {}
    if xml.is_file():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    ran = counts.get("tests", 0) - counts.get("skipped", 0)
    ok = r["rc"] == 0 and ran > 0
    status = "passed" if ok else ("timeout" if r["rc"] == 124 else "failed")
    note = f"{ran} passed, {counts.get('skipped', 0)} skipped" if ok else f"rc {r['rc']}: {counts} (see {r['log']})"
    return {"status": status, "note": note, **r, **counts}


def stage_multi_gpu(check: Check, deadline: float) -> dict:
    ws, S, gpus = check.ws, check.ws.steps, check.facts.get("gpus", 0)
    four = gpus >= 4 or check.smoke
    layout = {
        "parallelism.dp": 1,
        "parallelism.tp": 2 if four else 1,
        "parallelism.pp": 2,
        "parallelism.pp_engine": "1f1b",
    }
    name = "tp2 x pp2 1f1b" if four else "pp2 1f1b"
    if check.smoke:
        from nanotrain.config import load_config, validate

        validate(load_config(str(ws.config("multi-gpu", layout))))
        return {
            "status": "skipped",
            "layout": name,
            "note": f"cpu-smoke: {name} config validated, not run (4 ranks cost ~20 s on 2 cores)",
        }
    if gpus < 2:
        return {"status": "skipped", "note": f"{gpus} GPU: NCCL refuses two ranks on one device"}
    ws.token_cache()
    legs = [
        (
            "mg-uninterrupted",
            [
                str(
                    ws.config(
                        "mg-uninterrupted",
                        {"logging.run_name": "mg-uninterrupted", "training.train_steps": 2 * S, **layout},
                    )
                ),
                "--local",
            ],
        ),
        (
            "mg-first",
            [
                str(
                    ws.config(
                        "mg-first",
                        {
                            "logging.run_name": "mg-resume",
                            "training.train_steps": S,
                            "checkpoints.interval": S,
                            **layout,
                        },
                    )
                ),
                "--local",
            ],
        ),
        ("mg-resumed", ["--resume", str(ws.logs / "mg-resume"), "--local", "--set", f"training.train_steps={2 * S}"]),
    ]
    runs, problems = {}, []
    for leg, args in legs:
        if runs and not all(r["ok"] for r in runs.values()):
            problems.append(f"{leg}: not run")
            continue
        r = runs[leg] = {"name": leg, **check.run([PY, "submit.py", *args], leg, deadline, RUN_CAP_S, ws.env)}
        run_dir = ws.logs / ("mg-uninterrupted" if leg == "mg-uninterrupted" else "mg-resume")
        r.update(read_run(run_dir, check.log_text(leg)))
        want = 2 * S if leg != "mg-first" else S
        r["ok"] = r["rc"] == 0 and r.get("step") == want
        if not r["ok"]:
            problems.append(f"{leg}: rc {r['rc']}, step {r.get('step')} of {want} (log {r['log']})")
    out: dict = {"layout": name}
    if not problems:
        ref = runs["mg-uninterrupted"]["all_losses"]
        noise = compare(ref, runs["mg-first"]["all_losses"], range(1, S + 1))["max_abs_diff"]
        cmp = compare(ref, runs["mg-resumed"]["all_losses"], range(S + 1, 2 * S + 1))
        ok, cmp["verdict"] = resume_verdict(cmp, noise, runs["mg-resumed"]["resumed_from_step"], S)
        out["resume"] = cmp
        if not ok:
            problems.append(f"resume: {cmp['verdict']}")
    spans = {
        "mg-uninterrupted": range(1, 2 * S + 1),
        "mg-first": range(1, S + 1),
        "mg-resumed": range(S + 1, 2 * S + 1),
    }
    out["runs"] = [leg_summary(r, spans[leg]) for leg, r in runs.items()]
    shutil.rmtree(ws.logs / "mg-uninterrupted", ignore_errors=True)
    shutil.rmtree(ws.logs / "mg-resume", ignore_errors=True)
    if problems:
        timed_out = any(r["rc"] == 124 for r in runs.values())
        return {"status": "timeout" if timed_out else "failed", "note": f"{name}: " + "; ".join(problems), **out}
    return {"status": "passed", "note": f"{name}: resume {out['resume']['verdict']}", **out}


FLIGHT_RECORDER = r"""
import json, os, pickle, sys, time
from pathlib import Path

run, smoke = Path(sys.argv[1]), sys.argv[2] == "1"
from nanotrain.runtime.hang import FR_BUFFER_VARS, FR_FILE_VARS, fr_buffer_var, nccl_debug_env

nccl_debug_env(run)  # as every rank does, before its process groups exist
stem = str(run / "hang" / "pipe_")
PIPE_VARS = ("TORCH_FR_DEBUG_INFO_PIPE_FILE", "TORCH_NCCL_DEBUG_INFO_PIPE_FILE")
if not smoke:  # NCCL's heartbeat monitor dumps when a byte arrives on <stem><rank>.pipe
    for var in PIPE_VARS:
        os.environ.setdefault(var, stem)
import torch
import torch.distributed as dist

from nanotrain.parallel import collectives
from nanotrain.runtime.hang import HangWatchdog

device = torch.device("cpu") if smoke else torch.device("cuda", 0)
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group("gloo" if smoke else "nccl", rank=0, world_size=1)
t = torch.ones(1 << 20, device=device)
for _ in range(3):
    collectives.all_reduce(t, what="all_reduce of the gpu check")
if device.type == "cuda":
    torch.cuda.synchronize(device)
names = FR_BUFFER_VARS + FR_FILE_VARS + ("TORCH_NCCL_DUMP_ON_TIMEOUT",) + PIPE_VARS
out = {"torch": torch.__version__, "backend": dist.get_backend(), "buffer_var": fr_buffer_var(),
       "env": {k: os.environ.get(k) for k in names}}
prefix = os.environ.get(FR_FILE_VARS[0]) or os.environ.get(FR_FILE_VARS[1])
dump = Path(prefix + "0")
if not smoke:  # torch's own dump, written where its variables say (as on an NCCL timeout)
    pipe = Path(stem + "0.pipe")
    seen = {"pipe": None, "file": None, "bytes": 0, "entries": None}
    deadline = time.time() + 5
    while not pipe.exists() and time.time() < deadline:
        time.sleep(0.2)
    if pipe.exists():
        seen["pipe"] = str(pipe)
        fd = os.open(pipe, os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, b"1")
        os.close(fd)
        deadline = time.time() + 8
        while time.time() < deadline and not (dump.exists() and dump.stat().st_size > 0):
            time.sleep(0.2)
        time.sleep(1.0)  # torch writes from a thread of its own: let it finish
        if dump.exists() and dump.stat().st_size > 0:
            seen.update(file=str(dump), bytes=dump.stat().st_size)
            try:
                seen["entries"] = len(pickle.loads(dump.read_bytes())["entries"])
            except Exception as exc:
                seen["entries"] = f"unreadable: {exc!r}"
            dump.rename(dump.with_name(dump.name + ".torch"))
    out["torch_dump"] = seen
path = HangWatchdog(run, 0, 1, 60).report("gpu check: the flight recorder's exercise")
report = json.loads(Path(path).read_text())
fr = report.get("flight_recorder") if isinstance(report.get("flight_recorder"), dict) else {}
entries = fr.get("entries") or []
mine = {"path": str(path), "node": report.get("node"), "host": report.get("host"),
        "collective": report.get("collective"), "entries": len(entries), "entries_total": fr.get("entries_total"),
        "profiling_names": sorted({str(e.get("profiling_name")) for e in entries}), "error": fr.get("error"),
        "file": report.get("flight_recorder_file"), "file_entries": None}
if mine["file"]:
    mine["file_entries"] = len(pickle.loads(Path(mine["file"]).read_bytes())["entries"])
out["report"] = mine
dist.destroy_process_group()
print(json.dumps(out))
"""


def stage_flight_recorder(check: Check, deadline: float) -> dict:
    """The hang report's flight recorder on this machine's torch: nanotrain's variables (the
    installed torch's names) point into the run's hang directory, collectives through
    ``parallel/collectives.py`` are recorded, the watchdog's report embeds them (with rank, node,
    host, group and last collective) and writes torch's own dump file beside it. On a GPU, NCCL's
    own dump is also triggered through its debug pipe and looked for in the hang directory
    (reported; torch's pipe variable differs between versions)."""
    ws = check.ws
    run = ws.tmp / "fr-run"
    script = ws.tmp / "flight_recorder.py"
    script.write_text(FLIGHT_RECORDER)
    r = check.run(
        [PY, str(script), str(run), "1" if check.smoke else "0"],
        "flight_recorder",
        deadline,
        cap=CAPS_S["flight-recorder"],
        env=ws.single_rank_env(),
        fork=True,
    )
    info = last_json(check.log_text("flight_recorder")) or {}
    if r["rc"] == 124:
        return {"status": "timeout", "note": f"no answer in time (see {r['log']})", **r}
    hang = str(run / "hang")
    report = info.get("report") or {}
    expected = f"{'gloo' if check.smoke else 'nccl'}:all_reduce"
    problems = [] if r["rc"] == 0 and info else [f"rc {r['rc']} (see {r['log']})"]
    env = info.get("env") or {}
    for var in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        if info and not (env.get(var) or "").startswith(hang):
            problems.append(f"{var} is {env.get(var)!r}, not in {hang}")
    if info and env.get(info.get("buffer_var", "")) != "2000":
        problems.append(f"{info.get('buffer_var')} is {env.get(info.get('buffer_var', ''))!r}, not 2000")
    if info and expected not in report.get("profiling_names", []):
        problems.append(f"the report's flight recorder has no {expected}: {report.get('profiling_names')}")
    if info and (report.get("collective") or {}).get("name") != "all_reduce of the gpu check":
        problems.append(f"the report's last collective is {report.get('collective')}")
    if info and (not (report.get("file") or "").startswith(hang) or not report.get("file_entries")):
        problems.append(f"no flight-recorder file in {hang}: {report.get('file')}")
    torch_dump = info.get("torch_dump")
    seen = (
        ""
        if torch_dump is None
        else (
            f"; torch's own dump via its debug pipe: {torch_dump['bytes']} bytes, {torch_dump['entries']} entries"
            if torch_dump.get("file")
            else f"; torch's own dump via its debug pipe: not seen (pipe {torch_dump.get('pipe')})"
        )
    )
    note = (
        f"{report.get('entries')} of {report.get('entries_total')} entries in the report ({expected}), "
        f"{report.get('file_entries')} in {report.get('file')}{seen}"
    )
    out = {k: info.get(k) for k in ("torch", "backend", "buffer_var", "env", "report", "torch_dump")}
    if problems:
        return {"status": "failed", "note": "; ".join(problems), **r, **out}
    return {"status": "passed", "note": note, **r, **out}


def stage_rehearsal(check: Check, deadline: float) -> dict:
    ws, steps = check.ws, 3 * check.ws.steps
    if check.smoke and os.environ.get("GPU_CHECK_SMOKE_REHEARSE") != "1":
        return {
            "status": "skipped",
            "note": "cpu-smoke: a fresh interpreter per rehearsed rank costs 6-20 s on 2 "
            "cores (GPU_CHECK_SMOKE_REHEARSE=1 runs it)",
        }
    ws.token_cache()  # submit.py checks the data before anything else
    cfg = ws.config("rehearsal", {"logging.run_name": "rehearsal", "training.train_steps": steps})
    r = check.run(
        [PY, "submit.py", str(cfg), "--rehearse", "--rank", "0", "--steps", str(steps), "--json"],
        "rehearsal",
        deadline,
        env=ws.env,
        fork=True,
    )
    text = check.log_text("rehearsal")
    if r["rc"] == 2 and "unrecognized arguments" in text and "--rehearse" in text:
        return {"status": "unavailable", "note": "submit.py has no --rehearse yet", **r}
    if r["rc"] == 124:
        return {"status": "timeout", "note": f"no answer in time (see {r['log']})", **r}
    result = last_json(text)
    if r["rc"] != 0 or result is None or not result.get("ranks"):
        return {"status": "failed", "note": f"rc {r['rc']}, no JSON with ranks (see {r['log']})", **r}
    rank = result["ranks"][0]
    peak = rank.get("peak_bytes") or rank.get("peak") or {}  # "peak": what --rehearse prints today
    real = check.facts.get("reference_memory", {}).get("max_memory_allocated")
    ratio = round(peak["total"] / real, 3) if real and peak.get("total") else None
    out = {
        "rehearsed_peak_bytes": peak,
        "real_max_memory_allocated": real,
        "rehearsed_over_real": ratio,
        "defects": result.get("defects", []),
        "ok_reported": result.get("ok"),
    }
    note = f"rehearsed peak {peak.get('total', 0) / 2**30:.2f} GiB" + (
        f" = {ratio} x the real max_memory_allocated" if ratio else " (no real CUDA peak to compare)"
    )
    if not result.get("ok"):
        return {"status": "failed", "note": f"rehearsal reports defects: {result.get('defects')}", **r, **out}
    return {"status": "passed", "note": note, **r, **out}


def stage_bench(check: Check, deadline: float) -> dict:
    if not check.smoke and os.environ.get("GPU_CHECK_BENCH") != "1":
        return {"status": "skipped", "note": "opt-in: GPU_CHECK_BENCH=1 (the ~1.1 B model's tokens/s and MFU)"}
    out, notes = {}, []
    variants = [("gpu_bench", [])]
    if not check.smoke and os.environ.get("GPU_CHECK_COMPILE") == "1":
        variants.append(("gpu_bench_compile", ["--compile", "--warmup", "3"]))
    for name, extra in variants:
        if deadline - time.monotonic() < 30:
            notes.append(f"{name}: no time left")
            continue
        result_path = check.logs / f"{name}.json"
        args = (
            ["--cpu-smoke", "--seq", "128", "--micro-batch", "2", "--steps", "2", "--warmup", "1"]
            if check.smoke
            else ["--steps", "8", "--warmup", "2"]
        )
        r = check.run(
            [PY, "benchmarks/gpu_train_bench.py", *args, *extra, "--out", str(result_path)],
            name,
            deadline,
            env=check.ws.env,
            fork=True,
        )
        res = json.loads(result_path.read_text()) if r["rc"] == 0 and result_path.is_file() else None
        out[name] = {**r, "result": res}
        if res is None:
            return {"status": "timeout" if r["rc"] == 124 else "failed", "note": f"{name}: rc {r['rc']}", **out}
        mfu = f"{100 * res['mfu']:.1f}%" if res.get("mfu") is not None else "n/a"
        notes.append(f"{name}: {res['tokens_per_s']:,} tokens/s, MFU {mfu}, micro-batch {res['micro_batch']}")
    return {"status": "passed", "note": "; ".join(notes), **out}


def stage_masked_attention(check: Check, deadline: float) -> dict:
    if deadline - time.monotonic() < MASKED_MIN_S:
        left = deadline - time.monotonic()
        return {"status": "skipped", "note": f"{left:.0f} s left: raise GPU_CHECK_BUDGET (380 leaves it room)"}
    result_path = check.logs / "masked_attention.json"
    mode = "--eager-flex" if check.smoke else "--gpu-check"
    r = check.run([PY, "benchmarks/masked_attention.py", mode, "--out", str(result_path)], "masked-attention", deadline)
    res = json.loads(result_path.read_text()) if result_path.is_file() else None
    if res is None:
        return {"status": "timeout" if r["rc"] == 124 else "failed", "note": f"rc {r['rc']} (see {r['log']})", **r}
    note = f"flex vs the CPU reference: max relative error {res['max_relative_error']:.1e}"
    timings = res.get("s8192_bf16_16x128")
    if timings:
        speeds = ", ".join(f"{k} {v['tokens_per_s']:,}" for k, v in timings.items())
        note += f"; S 8192 bf16 fwd+bwd tokens/s: {speeds}; flex peak {res['flex_peak_over_causal']} x causal's"
    return {"status": "passed" if res["ok"] else "failed", "note": note, **r, "result": res}


STAGES = [
    ("versions", stage_versions),
    ("gpu-tests", stage_gpu_tests),
    ("trainer", stage_trainer),
    ("multi-gpu", stage_multi_gpu),
    ("flight-recorder", stage_flight_recorder),
    ("rehearsal", stage_rehearsal),
    ("masked-attention", stage_masked_attention),
    ("bench", stage_bench),
]


def table(summary: dict) -> str:
    rows = [("stage", "status", "wall s", "limit s", "")]
    rows += [
        (s["name"], s["status"], f"{s['wall_s']:.0f}", str(s["limit_s"]), s.get("note", "")) for s in summary["stages"]
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
    lines.append(
        f"{summary['elapsed_s']:.0f} s of {summary['budget_s']:.0f}: "
        f"{'every stage that ran passed' if summary['ok'] else 'FAILED'}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--task"]:  # one trainer run (stage 3), in its own process
        task = argparse.ArgumentParser()
        task.add_argument("--task", required=True)
        task.add_argument("--memory-out", type=Path, required=True)
        args = task.parse_args(argv)
        task_with_memory(args.task, args.memory_out)
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="gpu_check.json here, logs in OUT/gpu_check/")
    parser.add_argument("--start", type=float, default=time.time(), help="epoch seconds the budget counts from")
    parser.add_argument("--budget", type=float, default=float(os.environ.get("GPU_CHECK_BUDGET", BUDGET_S)))
    parser.add_argument("--steps", type=int, help="S: the trainer runs 3S steps (default 4; --cpu-smoke 2)")
    parser.add_argument("--cpu-smoke", action="store_true", help="tiny model on CPU (gloo): the logic, no GPU")
    opts = parser.parse_args(argv)
    opts.out.mkdir(parents=True, exist_ok=True)
    os.chdir(ROOT)  # what every run sees as its working directory, forked or not
    check = Check(opts.out.resolve(), opts.start, opts.budget, opts.cpu_smoke)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, check.stop)
    status = 0
    with tempfile.TemporaryDirectory(prefix="nanotrain-gpu-check-", ignore_cleanup_errors=True) as tmp:
        check.ws = Workspace(Path(tmp), opts.cpu_smoke, opts.steps or (2 if opts.cpu_smoke else 4))
        try:
            for name, fn in STAGES:
                check.stage(name, fn)
        except Stopped:
            status = 124
        finally:
            check.ws.close()
    check.write()
    print(table(check.summary), flush=True)
    return status or (0 if check.summary["ok"] else 1)


if __name__ == "__main__":
    sys.exit(main())
