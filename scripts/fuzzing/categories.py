"""The yaml11 and unicode categories as cases (values and oracle: values.py)."""

from __future__ import annotations

from fuzzing.cases import Case, config_with
from fuzzing.values import UNICODE, YAML11, scalar_fields, string_fields

# Mapping fields whose entries are strings: a YAML 1.1 reading must not turn "no" into False there.
STRING_ENTRIES = [("slurm", "env.NCCL_FUZZ"), ("slurm", "sbatch_extra.mail-type")]
INT_FIELDS_FOR_DIGITS = [("parallelism", "dp"), ("training", "train_steps"), ("slurm", "time")]


def yaml11_cases() -> list[Case]:
    """Every YAML 1.1 scalar in every scalar field (and string entries of mapping fields), in the
    file and by --set; plus `<<` and `=` as keys of every section."""
    out = []
    targets = list(scalar_fields()) + STRING_ENTRIES
    for section, name in targets:
        for text in YAML11:
            where = f"{section}.{name}"
            value = {"field": where, "text": text}
            out.append(
                Case(
                    "yaml11",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{where}: {text} [file]",
                    edits=config_with(section, name, text),
                    value=value,
                )
            )
            out.append(
                Case(
                    "yaml11",
                    "submit",
                    ["@cfg@", "--dry-run", "--set", f"{where}={text}"],
                    f"{where}={text} [set]",
                    value=value,
                )
            )
    for section in {s for s, _ in targets}:
        for key in ("<<", "="):
            out.append(
                Case(
                    "yaml11",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{section} key {key} [file]",
                    edits=config_with(section, "", key, key=True),
                    expect="ok-2",
                )
            )
    return out


def _escaped(text: str) -> str:
    """`text` as a YAML double-quoted scalar with every non-ASCII or control character escaped."""
    out = []
    for c in text:
        if c.isascii() and c.isprintable() and c not in '"\\':
            out.append(c)
        elif ord(c) > 0xFFFF:
            out.append(f"\\U{ord(c):08x}")
        else:
            out.append(f"\\u{ord(c):04x}")
    return '"' + "".join(out) + '"'


def unicode_cases() -> list[Case]:
    """Each character in every string field (escaped in the file, raw in the file, raw in --set),
    in an unknown key of every section and in a --set path, in a key of slurm.env, and full-width
    digits in integer fields."""
    out = []
    fields = string_fields() + STRING_ENTRIES
    sections = sorted({s for s, _ in scalar_fields()})
    for cat, ch in UNICODE:
        value = f"a{ch}b"
        shown = ascii(ch)
        for section, name in fields:
            where = f"{section}.{name}"
            out.append(
                Case(
                    "unicode",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{where} {cat} {shown} [file, escaped]",
                    edits=config_with(section, name, _escaped(value)),
                )
            )
            out.append(
                Case(
                    "unicode",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{where} {cat} {shown} [file, raw]",
                    edits=config_with(section, name, value),
                )
            )
            out.append(
                Case(
                    "unicode",
                    "submit",
                    ["@cfg@", "--dry-run", "--set", f"{where}={value}"],
                    f"{where} {cat} {shown} [set]",
                )
            )
        for section in sections:
            out.append(
                Case(
                    "unicode",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{section} key {cat} {shown} [file]",
                    edits=config_with(section, "", _escaped(value), key=True),
                    expect="ok-2",
                )
            )
            out.append(
                Case(
                    "unicode",
                    "submit",
                    ["@cfg@", "--dry-run", "--set", f"{section}.{value}=1"],
                    f"{section} --set path {cat} {shown}",
                    expect="ok-2",
                )
            )
        out.append(
            Case(
                "unicode",
                "submit",
                ["@cfg@", "--dry-run"],
                f"slurm.env key {cat} {shown} [file]",
                edits=config_with("slurm", "env", _escaped("A" + ch), key=True),
            )
        )
        out.append(
            Case(
                "unicode",
                "submit",
                ["@cfg@", "--dry-run", "--set", f"slurm.env.A{ch}=1"],
                f"slurm.env key {cat} {shown} [set]",
            )
        )
        if cat == "Nd-fullwidth":
            for section, name in INT_FIELDS_FOR_DIGITS:
                out.append(
                    Case(
                        "unicode",
                        "submit",
                        ["@cfg@", "--dry-run", "--set", f"{section}.{name}={ch}"],
                        f"{section}.{name} = {shown} [set]",
                        value={"field": f"{section}.{name}", "text": ch, "means": {"num": 12, "time": 12}},
                    )
                )
    return out
