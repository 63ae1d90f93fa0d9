"""The values of the yaml11 and unicode categories, the config fields they go into, and the
oracle that says what a value that was accepted must have been read as.

yaml11: scalars that YAML 1.1 (PyYAML's resolver) and YAML 1.2 read differently, or that a user
means otherwise than YAML 1.1 reads them. Each has the readings a user may mean; a config that
loads must hold one of them in the field (a string field the text itself), never the other
reading: `010` is 10 or refused, never 8; `1:30:00` in a SLURM time field is 90 minutes, in any
other integer field refused, never 5400; `no` in a string field is "no", never False or "False".

unicode: one character of each category that can hide in a "printable" line (C0 and C1 controls,
line and paragraph separators, lone surrogates, bidi embeddings/overrides/isolates, zero-width
and other format characters, private use, unassigned code points, combining marks, full-width
digits, no-break spaces), put into string values, keys and `--set` paths and values.
"""

from __future__ import annotations

import dataclasses
import typing

from nanotrain.config.loader import sections

# text -> {"num": a number it means, "bool": a boolean it means, "none": it means null,
#          "time": minutes in a SLURM time field}. The string itself is always a reading.
YAML11: dict[str, dict] = {
    "1:30:00": {"time": 90},
    "1:30": {"time": 2},
    "0:05": {"time": 1},
    "1-00:00:00": {"time": 1440},
    "010": {"num": 10, "time": 10},
    "0777": {"num": 777, "time": 777},
    "-010": {"num": -10},
    "0o10": {"num": 8, "time": 8},
    "0x1F": {"num": 31, "time": 31},
    "0b11": {"num": 3, "time": 3},
    "1_000": {"num": 1000, "time": 1000},
    "+1": {"num": 1, "time": 1},
    ".5": {"num": 0.5},
    "1e3": {"num": 1000, "time": 1000},
    "1.5e3": {"num": 1500},
    "1E3": {"num": 1000, "time": 1000},
    "yes": {"bool": True},
    "no": {"bool": False},
    "on": {"bool": True},
    "off": {"bool": False},
    "y": {"bool": True},
    "n": {"bool": False},
    "Yes": {"bool": True},
    "NO": {"bool": False},
    "TRUE": {"bool": True},
    "~": {"none": True},
    "Null": {"none": True},
    "2026-12-01": {},
    "2026-12-01 10:00:00": {},
    "=": {},
    "<<": {},
}

# (category, character). Lone surrogates cannot be written to a UTF-8 file: there they are the
# bytes a broken file holds; in argv they are what Python makes of undecodable bytes.
UNICODE: list[tuple[str, str]] = [
    ("Cc-C0", "\x1b"),
    ("Cc-C0", "\x07"),
    ("Cc-C0", "\x0b"),
    ("Cc-C1", "\x85"),
    ("Cc-C1", "\x9b"),
    ("Cc-C1", "\x80"),
    ("Zl", "\u2028"),
    ("Zp", "\u2029"),
    ("Cs", "\udc80"),
    ("Cs", "\ud800"),
    ("bidi", "\u202a"),
    ("bidi", "\u202b"),
    ("bidi", "\u202c"),
    ("bidi", "\u202d"),
    ("bidi", "\u202e"),
    ("bidi", "\u2066"),
    ("bidi", "\u2067"),
    ("bidi", "\u2068"),
    ("bidi", "\u2069"),
    ("Cf", "\u200b"),
    ("Cf", "\ufeff"),
    ("Cf", "\u00ad"),
    ("Cf", "\u2060"),
    ("Co", "\ue000"),
    ("Co", "\U000f0000"),
    ("Cn", "\u0378"),
    ("Cn", "\U000e0080"),
    ("Mn", "e\u0301"),
    ("Mn", "\u0336"),
    ("Nd-fullwidth", "\uff11\uff12"),
    ("Zs-nbsp", "\u00a0"),
    ("Zs-nbsp", "\u202f"),
    ("Zs", "\u3000"),
]


def _base(hint) -> object:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def scalar_fields() -> dict[tuple[str, str], object]:
    """(section, field) -> type hint of every scalar field of the schema, nested dataclass
    fields as `field.sub` (slurm.prepare.time, model.moe.*); list/dict/dataclass fields left out."""
    out = {}
    for name, cls in sections().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            hint = _base(hints[f.name])
            if dataclasses.is_dataclass(hint):
                sub = typing.get_type_hints(hint)
                for g in dataclasses.fields(hint):
                    inner = _base(sub[g.name])
                    if typing.get_origin(inner) not in (list, dict, tuple):
                        out[(name, f"{f.name}.{g.name}")] = (inner, g.metadata)
            elif typing.get_origin(hint) not in (list, dict, tuple):
                out[(name, f.name)] = (hint, f.metadata)
    return out


def string_fields() -> list[tuple[str, str]]:
    """Scalar fields a string is a valid value of (str, or a choice of strings)."""
    return [
        k
        for k, (hint, _) in scalar_fields().items()
        if hint is str
        or (typing.get_origin(hint) is typing.Literal and all(isinstance(a, str) for a in typing.get_args(hint)))
    ]


def is_time(meta) -> bool:
    return meta.get("parse") == "slurm_time"


def reading_problem(text: str, value, meta, means: dict | None = None) -> str:
    """'' when `value` (what a loaded config holds for a field given `text`) is a reading a user
    may mean (`means`, default YAML11[text]); else what is wrong with it."""
    means = YAML11.get(text, {}) if means is None else means
    if isinstance(value, str):
        return "" if value == text else f"read as the string {value!r}"
    if isinstance(value, bool):
        return "" if means.get("bool") is value else f"read as {value}"
    if value is None:
        return "" if means.get("none") else "read as null"
    if isinstance(value, (int, float)):
        want = means.get("time") if is_time(meta) else means.get("num")
        return "" if want is not None and value == want else f"read as {value!r}"
    return ""


def get_value(config, section: str, name: str):
    node = getattr(config, section)
    for part in name.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node
