"""The temporary folder of a check's runs: the base config (the first job's settings), the
environment a run gets (``datasets`` made unimportable under --cpu-smoke, as on the GPU
machine), the fork server of --cpu-smoke and the stdlib token cache the check writes where
``datasets`` is missing."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

from .limits import CPU_MODEL, GPU_MODEL, ROOT, SINGLE_RANK_VARS, SMOKE_CACHE_DOCS


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
