"""`submit.py CONFIG --prepare-data [--local]`: tokenise every source into the cache, as its own step.

Why a step of its own: a training job that tokenises on global rank 0 keeps every other GPU of
the allocation waiting; a corpus of real size takes hours. `--prepare-data` fills the same
memory-mapped cache a training job reads (`data/dataset.py`), with `data.num_workers` processes:
locally with a progress bar, or on SLURM as one CPU-only task (`slurm.prepare`: partition,
cpus, time) submitted through submitit like training. Its run directory (`<run dir>-prepare`)
has the usual `config.yaml`, `launch.json` and `job/` logs, so `--status` works on it, and
`prepared.json` when it is done. Two preparations of one source at once (two nodes sharing a
filesystem) both finish with one valid cache: each writes `tokens.bin` then `meta.json` by an
atomic rename of a complete file, and the two files are the same bytes.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from nanotrain.config import Config, load_config
from nanotrain.data import TokenDataset, default_cache_dir
from nanotrain.data.check import all_source_args, eval_source_args
from nanotrain.launch import sbatch
from nanotrain.runtime import rundir

PREPARED_FILE = "prepared.json"


def prepare_sources(config: Config, progress: bool, out=None) -> list[dict]:
    """Tokenise (or find) every training and validation source; one summary line each."""
    out = out or sys.stdout
    results = []
    for where, args in all_source_args(config.data) + eval_source_args(config):
        started = time.perf_counter()
        ds = TokenDataset.build(
            args,
            seq_len=config.training.sequence_length,
            cache_dir=default_cache_dir(config),
            vocab_size=config.model.vocab_size,
            progress=progress,
        )
        took = time.perf_counter() - started
        result = {
            "source": args.source,
            "entry": where,
            "path": ds.path,
            "documents": ds.num_documents,
            "tokens": ds.num_tokens,
            "seconds": took,
            "from_cache": ds.from_cache,
            "workers": max(1, args.num_workers),
        }
        results.append(result)
        if ds.from_cache:
            print(
                f"{where}: {args.source}: already prepared ({ds.num_tokens:,} tokens) in {ds.path}",
                file=out,
                flush=True,
            )
        else:
            print(
                f"{where}: {args.source}: {ds.num_documents:,} documents, {ds.num_tokens:,} tokens in "
                f"{took:.1f}s ({ds.num_tokens / max(took, 1e-9):,.0f} tokens/s, {result['workers']} "
                f"worker(s)) -> {ds.path}",
                file=out,
                flush=True,
            )
    return results


class PrepareTask:
    """The submitit callable of the SLURM preparation job (pickled by reference)."""

    def __call__(self, config_path: str) -> list[dict]:
        config = load_config(config_path)
        results = prepare_sources(config, progress=False)
        run_dir = Path(config_path).parent
        (run_dir / PREPARED_FILE).write_text(json.dumps(results, indent=1) + "\n")
        return results


def prepare_dir(run_dir: Path) -> Path:
    """The preparation job's own run directory, beside the training run's."""
    return run_dir.with_name(run_dir.name + "-prepare")


def prepare_locally(config: Config) -> int:
    prepare_sources(config, progress=sys.stderr.isatty() or os.environ.get("NANOTRAIN_PROGRESS") == "1")
    print(f"data ready in {default_cache_dir(config)}: training jobs of this config will find it", flush=True)
    return 0


def executor_parameters(config: Config) -> dict:
    """One CPU-only task on one node: the `slurm.prepare` resources, the training job's setup."""
    p = config.slurm.prepare
    name = f"{config.logging.run_name}-prepare"
    return sbatch.side_job_parameters(config, name, p, [f"export OMP_NUM_THREADS={p.cpus}"])


def submit_prepare(config: Config, run_dir: Path) -> int:
    """Submit the CPU job; `--status <run dir>-prepare` follows it."""
    from nanotrain.launch.submission import submit

    job_dir = prepare_dir(run_dir)
    config_path = rundir.write_run_dir(config, job_dir)
    job = submit(
        sbatch.job_folder(job_dir),
        0,
        executor_parameters(config),
        PrepareTask(),
        str(config_path),
        what="the preparation job",
    )
    rundir.write_launch_record(
        job_dir, mode=rundir.Launcher.SLURM, job_id=job.job_id, argv=sys.argv[1:], kind="prepare"
    )
    print(f"submitted data preparation job {job.job_id} (1 CPU task, {config.slurm.prepare.cpus} cpus)")
    print(f"status: python submit.py --status {job_dir}")
    print(f"stdout: {job.paths.stdout}")
    return 0


def prepared_line(run_dir: Path) -> str | None:
    """`--status` of a preparation run: what it prepared, or None when it is not one."""
    record = rundir.read_launch_record(run_dir) if (run_dir / rundir.LAUNCH_FILE).is_file() else {}
    if record.get("kind") != "prepare":
        return None
    done = run_dir / PREPARED_FILE
    if not done.is_file():
        return "data: not prepared yet (the job is queued or running; see job/ logs)"
    results = json.loads(done.read_text())
    tokens = sum(r["tokens"] for r in results)
    return f"data: prepared {len(results)} source(s), {tokens:,} tokens"
