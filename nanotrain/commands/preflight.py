"""`submit.py`'s last checks before it queues a job or starts local ranks.

Without them, each of these would be found only inside the ranks (after the run directory was
rewritten and, on SLURM, after the job waited in the queue), or not at all:

* the run's recorded SLURM job is still pending or running (`--resume` put a second job beside
  a queued one), or a live process owns the run / checkpoint directory (`runtime/ownership.py`);
* the checkpoint the run would resume from holds another model shape (`--resume --set
  model.hidden_size=...`) or belongs to another run (`checkpoints.path` pointing into another
  run directory), unless `checkpoints.allow_foreign`.

A dry run makes the checkpoint checks too (it must say what a launch would refuse) but not the
ownership ones: printing a plan next to a live run is harmless.
"""

from __future__ import annotations

from pathlib import Path

from nanotrain.checkpoint import layout
from nanotrain.checkpoint.layout import model_differences
from nanotrain.config import Config, ConfigError, config_to_dict
from nanotrain.hf.directory import check_hf_dir
from nanotrain.runtime import ownership, rundir


def _recorded_job(run_dir: Path) -> str | None:
    try:
        record = rundir.read_launch_record(run_dir)
    except (OSError, ValueError):
        return None  # an unreadable launch.json is reported by --status / --resume themselves
    return str(record["job_id"]) if isinstance(record, dict) and record.get("job_id") else None


def check_resume_target(config: Config, run_dir: Path) -> None:
    """The newest readable checkpoint this run would resume from must be this run's and fit its
    model (the ranks check again, with every file verified; this only reads meta.json)."""
    if not config.checkpoints.resume:
        return
    root = Path(config.checkpoints.path)
    for cand in layout.load_candidates(root):
        try:
            meta = layout.read_meta(cand)
        except (layout.CheckpointError, ValueError):
            continue  # damaged: the ranks fall back past it (and move it aside)
        saved_id, run_id_file = meta.get("run_id"), Path(run_dir) / ownership.RUN_ID
        mine = run_id_file.read_text().strip() if run_id_file.is_file() else None
        if saved_id and saved_id != mine and not config.checkpoints.allow_foreign:
            where = (meta.get("config") or {}).get("logging") or {}
            raise ConfigError(
                f"checkpoints.path: {cand} belongs to another run ({where.get('dir')}/"
                f"{where.get('run_name')}, run id {saved_id}); point checkpoints.path elsewhere, "
                "or set checkpoints.allow_foreign=true to start from it on purpose"
            )
        diff = model_differences(meta.get("config"), config_to_dict(config))
        if diff:
            raise ConfigError(
                f"model: this run would resume from {cand}, whose model differs in {', '.join(diff)}; "
                "a run keeps its model shape: drop those --set model.* overrides, or start a new "
                "run (another logging.run_name) to train another model"
            )
        return


def check_init_from_hf(config: Config) -> None:
    """``checkpoints.init_from_hf`` on a first start: the HF directory must fit the ``model``
    section (config.json and the safetensors headers; one ``error:`` line per problem). A run
    that already has a complete checkpoint resumes from it and does not read the HF directory."""
    path = config.checkpoints.init_from_hf
    if path is None or (config.checkpoints.resume and layout.load_candidates(Path(config.checkpoints.path))):
        return
    check_hf_dir(path, config.model)


def before_launch(config: Config, run_dir: Path, launching: bool) -> list[str]:
    """Raise ConfigError / OwnershipError (ValueErrors: one `error:` line, exit 2); return notes
    worth a warning (a stale lock the task will take over)."""
    notes = []
    if launching:
        notes = ownership.check_before_launch(run_dir, Path(config.checkpoints.path), _recorded_job(run_dir))
    check_resume_target(config, run_dir)
    check_init_from_hf(config)
    return notes
