"""SLURM's time strings, as `sbatch --time` takes them, in whole minutes.

Accepted: "MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM", "D-HH:MM:SS"; seconds round up to a whole
minute (as sbatch does). Fields opt in with schema metadata `parse: "slurm_time"`.
"""

from __future__ import annotations

import re

FORMS = '"MM", "MM:SS", "HH:MM:SS", "D-HH", "D-HH:MM" or "D-HH:MM:SS"'
_NUM = r"(\d{1,9})"
_PATTERNS = [
    (re.compile(rf"{_NUM}"), ("m",)),
    (re.compile(rf"{_NUM}:{_NUM}"), ("m", "s")),
    (re.compile(rf"{_NUM}:{_NUM}:{_NUM}"), ("h", "m", "s")),
    (re.compile(rf"{_NUM}-{_NUM}"), ("d", "h")),
    (re.compile(rf"{_NUM}-{_NUM}:{_NUM}"), ("d", "h", "m")),
    (re.compile(rf"{_NUM}-{_NUM}:{_NUM}:{_NUM}"), ("d", "h", "m", "s")),
]
_SECONDS = {"d": 86400, "h": 3600, "m": 60, "s": 1}


def minutes(value: object) -> int:
    """Minutes of an int or a SLURM time string; raises ValueError for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip()
        for pattern, units in _PATTERNS:
            match = pattern.fullmatch(text)
            if match:
                seconds = sum(int(g) * _SECONDS[u] for g, u in zip(match.groups(), units))
                return -(-seconds // 60)
    raise ValueError(FORMS)
