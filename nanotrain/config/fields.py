"""How a config field is declared: its range (``bounded``), its description (``doc``), SLURM times,
and the limits every integer field shares.

The schema (``schema.py``, ``schema_model.py``, ``schema_slurm.py``) declares each field once with
these; the loader reads the metadata they attach (ranges, descriptions, path kinds, the fix a
refusal names), so parsing, validation and the config reference all come from the declaration.
"""

from __future__ import annotations

from dataclasses import field

# Integers without their own maximum stop here: beyond 2**53 floats (the memory estimate, the
# plan) are no longer exact, and a YAML integer of any size would otherwise be taken.
MAX_INT = 2**53
# The most ranks one job may have (the largest clusters have ~10^5 accelerators); keeps every
# plan and rank-grid listing of --dry-run within a fraction of a second.
MAX_WORLD = 2**20
# The deepest model accepted. Trained decoders have ~100-200 layers (research ones up to ~500):
# 1024 is beyond them all, and keeps what is computed per layer (the exact pipeline stage split,
# about layers**2 / stages of work per layout, for --dry-run and each layout --plan tries) within
# a fraction of a second; a typo (9007199254740991) is refused instead of computed.
MAX_LAYERS = 1024
# Path kinds of `doc(path=...)` beyond those of config/paths.py, each checked by the layer that
# knows it: a data source is a file, a directory or a glob unless it is 'stdlib' or a hub name,
# a tokenizer a file unless 'byte' (data); a Hugging Face directory is read only on a first start
# (hf.directory, from commands.preflight), so a resumed run does not need it any more.
DATA_SOURCE, TOKENIZER, HF_DIR = "data source", "tokenizer", "hf dir"
# The smallest normal float32: a smaller epsilon added to a float32 tensor is lost (0 or a
# denormal), so it no longer keeps a division by a zero second moment away from 0/0.
FLOAT32_TINY = 2.0**-126


def bounded(default, lo=None, hi=None, doc: str = "", above: bool = False, parse: str | None = None, why: str = ""):
    """A field with an inclusive numeric range (`above`: the minimum itself is excluded), checked
    by the loader with the field's name. Floats must also be finite (the loader refuses NaN/inf).
    `parse` names a loader hook that reads the value instead of its type hint. `why` is added to
    the error of a value out of range: what the value would do in the ranks, and the fix."""
    return field(
        default=default, metadata={"min": lo, "max": hi, "min_exclusive": above, "doc": doc, "parse": parse, "why": why}
    )


def slurm_time(default: int, doc: str):
    """Integer minutes that may also be given as a SLURM time string ("1:30:00", "1-00:00:00");
    at least a minute, at most a year."""
    return bounded(default, 1, 525600, doc=doc, parse="slurm_time")


def doc(default, text: str, path: str | None = None, why: str = ""):
    """A plain field with a one-line description; `list`/`dict` defaults become factories.
    `path` marks a path-typed field with what it must be (a kind of `paths.py`, or DATA_SOURCE /
    TOKENIZER, whose keywords and hub names are not paths): every such field gets the path
    checker, and a test enumerates them from here. `why` follows the loader's error for a value
    that is not one of a `Literal`'s choices: the fix."""
    meta = {"doc": text} if path is None else {"doc": text, "path": path}
    if why:
        meta["why"] = why
    if default in (list, dict):
        return field(default_factory=default, metadata=meta)
    return field(default=default, metadata=meta)
