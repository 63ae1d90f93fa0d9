"""What the offline tools (``scripts/reshard_checkpoint.py``, ``scripts/export_hf.py``,
``scripts/generate.py``) check before they read a tensor or write a byte: the source is a
checkpoint (its meta.json, sha256 checked), the output does not overlap it, the target topology
is one the model can be cut into (the config validator's own layout rules and messages) and the
arguments make sense.

Standard library, yaml and ``nanotrain.config`` only (no torch): a script refuses a wrong input
in a fraction of a second, before it imports the tensor code, and refuses it before anything is
written, so a refusal leaves the file system as it was.
"""

from __future__ import annotations

import stat
from dataclasses import dataclass
from pathlib import Path

import yaml

from nanotrain.checkpoint import layout
from nanotrain.checkpoint.layout import CheckpointError
from nanotrain.config import Config, ConfigError, config_from_dict
from nanotrain.config.loader import apply_override, check_fields
from nanotrain.config.paths import CREATE_DIR, DIR, check_path
from nanotrain.config.validate import validate_layout
from nanotrain.models.family import family_of

DTYPES = ("float32", "bfloat16")  # export's --dtype choices, named as format.DTYPES names torch dtypes
DEFAULT_MAX_SHARD = 5 * 10**9


def parse_size(text: str) -> int:
    """``5GB``, ``500MB``, ``20KB``, ``123`` (bytes) -> bytes (decimal units, as transformers).
    Raises ValueError for anything else (a ``float`` spelling of nan or inf included)."""
    t = text.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if t.endswith(unit):
            number = float(t[: -len(unit)])
            if number != number or number in (float("inf"), float("-inf")):
                raise ValueError(text)
            return int(number * mult)
    return int(t)


def shard_size(text: str) -> int:
    """``--max-shard-size`` -> a positive byte count; raises ConfigError naming the flag."""
    try:
        size = parse_size(text)
    except ValueError:
        raise ConfigError(f"--max-shard-size {text!r}: give a size like 5GB, 500MB or 20KB") from None
    if size <= 0:
        raise ConfigError(f"--max-shard-size {text!r}: must be positive, e.g. 5GB")
    return size


def resolve_checkpoint(src: str | Path) -> Path:
    """A checkpoint directory (holding COMPLETE), or a checkpoints root (its latest complete one)."""
    src = Path(src)
    if (src / layout.COMPLETE).is_file():
        return src
    candidates = layout.load_candidates(src)
    if not candidates:
        raise CheckpointError(f"{src}: neither a complete checkpoint nor a directory holding one")
    return candidates[0]


def source_checkpoint(src: str | Path) -> Path:
    """A checkpoint directory, a checkpoints root, or a run directory (its ``checkpoints.path``)
    -> the checkpoint to read (the newest complete one). Raises CheckpointError."""
    src = Path(src)
    if not src.exists():
        raise CheckpointError(f"{src}: no such run or checkpoint directory")
    if (src / layout.COMPLETE).is_file() or layout.complete_checkpoints(src):
        return resolve_checkpoint(src)
    root = src / "checkpoints"
    if (src / "config.yaml").is_file():
        try:
            saved = yaml.safe_load((src / "config.yaml").read_text())
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            raise CheckpointError(f"{src / 'config.yaml'}: unreadable ({type(exc).__name__})") from None
        path = ((saved if isinstance(saved, dict) else {}).get("checkpoints") or {}).get("path")
        root = Path(path) if isinstance(path, str) and path else root
    if layout.complete_checkpoints(root):
        return resolve_checkpoint(root)
    raise CheckpointError(f"{src}: no complete checkpoint in it (looked in {root})")


def check_plain_entries(out: str | Path, flag: str) -> None:
    """Refuse an existing output directory holding a FIFO, socket or device: the export writes
    its files by name (config.json, tokenizer.json, ...), and opening a FIFO to write blocks until
    some reader comes, so the command would hang with files half written."""
    out = Path(out)
    if not out.is_dir():
        return
    for entry in out.iterdir():
        try:
            mode = entry.stat().st_mode
        except OSError:  # a broken or looping link: replaced by a file of that name, never opened
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            raise CheckpointError(
                f"{flag} {out}: holds {entry.name}, which is not a regular file (a FIFO, "
                "socket or device): remove it or write to another directory"
            )


def check_apart(reads: list[Path], out: str | Path, flag: str) -> None:
    """Refuse an output that is, lies inside, or holds any of the directories read: writing
    there would rewrite the source in place (or make a root whose ``latest`` moves under it)."""
    target = Path(out).resolve()
    for read in reads:
        source = Path(read).resolve()
        if target == source:
            raise CheckpointError(f"{flag} {out}: is the source {read}; write to a new directory")
        if source in target.parents:
            raise CheckpointError(f"{flag} {out}: lies inside the source {read}; write to a directory outside it")
        if target in source.parents:
            raise CheckpointError(f"{flag} {out}: holds the source {read}; write to a directory beside it")


@dataclass(frozen=True)
class ReshardPlan:
    """A checked offline reshard: the checkpoint to read, its meta.json and the target config."""

    checkpoint: Path
    meta: dict
    config: Config


def plan_reshard(src: str | Path, dst_root: str | Path, overrides: list[str] = ()) -> ReshardPlan:
    """The checkpoint ``src`` names, and the config of the target topology: the checkpoint's
    stored config with ``overrides`` (``parallelism.tp=4``...) applied, its fields checked and its
    layout validated with the launch's own rules (``validate_layout``: tp dividing the heads, pp
    within the layers, ep only for a MoE model...; the batch rules are the resuming run's).
    Raises ConfigError (the validator's own line) or CheckpointError; reads only meta.json."""
    check_path(
        "SRC", src, DIR, CheckpointError, missing=f"{src}: neither a complete checkpoint nor a directory holding one"
    )
    check_path("DST", dst_root, CREATE_DIR, CheckpointError)
    ckpt = resolve_checkpoint(src)
    check_apart([Path(src), ckpt], dst_root, "DST")
    meta = layout.read_meta(ckpt)
    if not isinstance(meta.get("config"), dict) or not meta["config"]:
        raise CheckpointError(
            f"{ckpt}: meta.json holds no config (saved without `config=`), so the "
            "model cannot be rebuilt at a new topology"
        )
    raw = dict(meta["config"])
    for assignment in overrides:
        apply_override(raw, assignment)
    config = config_from_dict(raw)
    check_fields(config)
    validate_layout(config)
    if config.parallelism.cp != 1:
        raise ConfigError(
            f"parallelism.cp ({config.parallelism.cp}): offline resharding supports cp = 1; "
            "resume with cp > 1 instead (the loader reshards online)"
        )
    return ReshardPlan(ckpt, meta, config)


def plan_export(src: str | Path, out_dir: str | Path, dtype: str) -> tuple[Path, dict]:
    """(checkpoint, meta.json) to export from ``src`` into ``out_dir``: a checkpoint with its config
    stored, whose model its family's config.json can describe (``Mapping.inexpressible``: e.g. an
    MoE model only as mixtral or qwen3_moe, q/k/v biases only as qwen2), and an output apart from
    it. Raises CheckpointError; reads only meta.json."""
    if dtype not in DTYPES:
        raise CheckpointError(f"--dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    check_path("SRC", src, DIR, CheckpointError, missing=f"{src}: no such run or checkpoint directory")
    check_path("OUT_DIR", out_dir, CREATE_DIR, CheckpointError)
    ckpt = source_checkpoint(src)
    check_plain_entries(out_dir, "OUT_DIR")
    check_apart([ckpt], out_dir, "OUT_DIR")
    meta = layout.read_meta(ckpt)
    config = meta.get("config") or {}
    if not isinstance(config, dict) or not config.get("model"):
        raise CheckpointError(f"{ckpt}: meta.json holds no config, so the model's shape is unknown")
    try:
        args = config_from_dict({"model": config["model"]}).model
    except ConfigError as exc:
        raise CheckpointError(f"{ckpt}: meta.json's model section does not read ({exc})") from None
    family = family_of(args)
    problems = family.hf.inexpressible(args)
    if problems:
        raise CheckpointError(
            f"{ckpt}: model.family {family.name} ({family.hf.ARCHITECTURE}) cannot describe this model: "
            + "; ".join(problems)
        )
    return ckpt, meta


def step_checkpoint(src: str | Path, step: int) -> Path:
    """Checkpoint ``step_<step>`` beside the one ``src`` names (``source_checkpoint``: a run, a
    checkpoints root or a checkpoint directory); raises CheckpointError listing the saved steps."""
    root = source_checkpoint(src).parent
    found = dict(layout.complete_checkpoints(root))
    if step not in found:
        saved = ", ".join(str(s) for s in sorted(found))
        raise CheckpointError(f"--step {step}: no complete checkpoint of that step in {root}; saved steps: {saved}")
    return found[step]


def plan_generate(src: str | Path, step: int | None = None) -> tuple[Path, dict]:
    """(checkpoint, meta.json) that ``scripts/generate.py`` decodes from: step ``step`` of the
    run, root or checkpoint ``src`` (None: the latest complete one), holding a readable model
    section. Raises CheckpointError; reads only meta.json."""
    check_path("RUN_DIR", src, DIR, CheckpointError, missing=f"{src}: no such run or checkpoint directory")
    ckpt = source_checkpoint(src) if step is None else step_checkpoint(src, step)
    meta = layout.read_meta(ckpt)
    config = meta.get("config") or {}
    if not isinstance(config, dict) or not config.get("model"):
        raise CheckpointError(f"{ckpt}: meta.json holds no config, so the model's shape is unknown")
    try:
        config_from_dict({"model": config["model"]})
    except ConfigError as exc:
        raise CheckpointError(f"{ckpt}: meta.json's model section does not read ({exc})") from None
    return ckpt, meta
