"""A local Hugging Face model directory, read and checked without torch.

``submit.py`` calls ``check_hf_dir`` before anything is submitted (``checkpoints.init_from_hf``),
so every problem a rank would otherwise meet minutes later in the queue — a missing directory,
another family than ``model.family`` or one nanotrain does not import, a ``model`` section that
differs from config.json, a tensor missing or of another shape, bias terms the family has not —
is one ``error:`` line each, exit 2. The family's mapping (``models/family.py``) says which
tensors it needs; an MoE directory may hold the experts one tensor per expert (what
``save_pretrained`` writes) or as transformers 5.x's fused stacks (``HFDir.fused``). Only config.json and the
safetensors headers are read (a few KB), never the weights. Single-file (``model.safetensors``)
and index-sharded (``model.safetensors.index.json`` + ``model-0000k-of-0000n.safetensors``)
directories are both understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from nanotrain.checkpoint.layout import CheckpointMismatch, read_safetensors_header
from nanotrain.config import ModelArgs
from nanotrain.config.paths import DIR, FILE, check_path
from nanotrain.models.family import ModelFamily, family_of, family_of_hf, supported_families

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "BF16", "F16", "F64"}


class HFError(CheckpointMismatch, ValueError):
    """A user error about the HF directory: ``submit.py`` prints a ValueError as ``error:`` lines
    (exit 2) before a launch, a rank a CheckpointMismatch (exit 2) if it gets that far."""


@dataclass
class HFDir:
    path: Path
    config: dict
    tensors: dict[str, dict] = field(default_factory=dict)  # name -> {"file", "dtype", "shape"}
    fused: bool = False  # experts stored as fused stacks (set by check_hf_dir)

    @property
    def vocab_size(self) -> int:
        return int(self.config["vocab_size"])


FIELD = "checkpoints.init_from_hf"


def _where(path: Path) -> str:
    return f"{FIELD}: {path}"


def open_hf_dir(path: str | Path) -> HFDir:
    """config.json and the tensor directory of the safetensors files (headers only; no torch).

    Raises:
        HFError: not a directory, no readable or valid config.json, neither model.safetensors
            nor an index (PyTorch .bin files are named), a listed file missing, or a file that is
            not safetensors.
    """
    path = Path(path).expanduser()
    check_path(
        FIELD,
        path,
        DIR,
        HFError,
        missing=f"{_where(path)} is not a directory: point it at a local Hugging Face model "
        "directory (config.json + *.safetensors)",
    )
    # Every file is checked before it is opened: a FIFO named config.json would block the read.
    check_path(
        FIELD,
        path / "config.json",
        FILE,
        HFError,
        missing=f"{_where(path)} has no readable config.json: not a Hugging Face model directory",
    )
    try:
        config = json.loads((path / "config.json").read_text())
    except OSError:
        raise HFError(f"{_where(path)} has no readable config.json: not a Hugging Face model directory") from None
    except ValueError as e:
        raise HFError(f"{_where(path)}/config.json is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise HFError(f"{_where(path)}/config.json is not a JSON object")
    out = HFDir(path, config)
    if (path / INDEX).is_file():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (ValueError, KeyError, TypeError):
            raise HFError(f"{_where(path)}/{INDEX} has no weight_map") from None
        files = sorted(set(weight_map.values()))
    elif (path / SINGLE).is_file():
        files = [SINGLE]
    else:
        found = sorted(p.name for p in path.glob("*.bin"))
        hint = " (it has PyTorch .bin files: re-save with safe_serialization=True)" if found else ""
        raise HFError(f"{_where(path)} has neither {SINGLE} nor {INDEX}{hint}")
    for rel in files:
        check_path(FIELD, path / rel, FILE, HFError, missing=f"{_where(path)}: {INDEX} names {rel}, which is missing")
        for name, rec in read_safetensors_header(path / rel, HFError)[1].items():
            if name != "__metadata__":
                out.tensors[name] = {"file": rel, "dtype": rec["dtype"], "shape": tuple(rec["shape"])}
    return out


def hf_family(hf: HFDir, path: str | Path | None = None) -> ModelFamily:
    """The family of the directory's config.json. Raises HFError naming the supported families
    when nanotrain imports none of this ``model_type``."""
    found = family_of_hf(hf.config)
    if found is None:
        archs = hf.config.get("architectures") or []
        raise HFError(
            f"{_where(hf.path if path is None else Path(path))} holds model_type {hf.config.get('model_type')!r} "
            f"(architectures {archs}): nanotrain imports {supported_families()}"
        )
    return found


def check_hf_dir(path: str | Path, args: ModelArgs) -> HFDir:
    """The directory, if nanotrain's model ``args`` can start from it (checked before a launch
    and again by ``load_hf_weights``).

    Raises:
        HFError: as ``open_hf_dir``, or another family than ``model.family`` (both named, with
            the fix), an unsupported model_type or config value, config fields that differ from
            ``args``, bias tensors the family has not, tensors missing or of another shape; the
            message names every problem, joined by ``; `` on one line (the CLI prints it after
            ``error:``).
    """
    hf = open_hf_dir(path)
    where = _where(hf.path)
    found, family = hf_family(hf), family_of(args)
    if found.name != family.name:
        raise HFError(
            f"{where} holds a {found.name} model ({found.hf.ARCHITECTURE}) but model.family is {family.name}: "
            f"set model.family: {found.name} (python scripts/hf_config.py {hf.path} prints the whole section)"
        )
    mapping = family.hf
    problems = [f"{where}: {p}" for p in mapping.unsupported(hf.config)]
    if problems:  # another architecture: its fields and tensors mean something else
        raise HFError("; ".join(problems))
    problems += mapping.mismatches(args, hf.config)
    if problems:
        raise HFError("; ".join(problems))
    expected = mapping.hf_shapes(args, hf.vocab_size)
    if args.moe is not None and any(n not in hf.tensors for n in expected):
        fused = mapping.hf_shapes(args, hf.vocab_size, fused=True)
        if all(n in hf.tensors for n in fused):
            expected, hf.fused = fused, True
    biases = sorted(n for n in hf.tensors if n.endswith(".bias") and n not in expected)
    if biases:
        problems.append(
            f"{where}: bias tensors present ({', '.join(biases[:3])}{', ...' if len(biases) > 3 else ''}): "
            f"nanotrain's {family.name} model has no such bias terms"
        )
    missing = [n for n in expected if n not in hf.tensors]
    if missing:
        problems.append(
            f"{where}: tensor{'s' if len(missing) > 1 else ''} missing: "
            f"{', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''}"
        )
    for name, shape in expected.items():
        rec = hf.tensors.get(name)
        if rec is None:
            continue
        if tuple(rec["shape"]) != shape:
            problems.append(f"{where}: {name} has shape {list(rec['shape'])}, the model needs {list(shape)}")
        elif rec["dtype"] not in FLOAT_DTYPES:
            problems.append(f"{where}: {name} is {rec['dtype']} (quantized?); only float tensors can be imported")
    if problems:
        raise HFError("; ".join(problems))
    return hf
