"""The "config" category of scripts/fuzz_config.py: one field of a shipped config replaced by a
hostile value, in the file or as `--set`, or the document broken around it (a duplicated field or
section, a section that is a scalar or a list, an unknown key).

The mutations are generated from the schema (`nanotrain.config.loader.sections`), so a new field
is fuzzed the day it lands, and rendered as YAML text rather than dumped, so that aliases, tags
and duplicates reach the loader as a user would type them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

from nanotrain.config.loader import sections

_BOMB = (
    "[&a [l, l, l, l, l, l, l, l, l], "
    + ", ".join(f"&{b} [{', '.join([f'*{a}'] * 9)}]" for a, b in zip("abcdefgh", "bcdefghi"))
    + "]"
)

# (kind, YAML text of the value). The text is placed verbatim after `field: `.
VALUES: list[tuple[str, str]] = [
    ("wrong-type", '"two"'),
    ("wrong-type", "true"),
    ("wrong-type", "[1, 2]"),
    ("wrong-type", "{a: 1}"),
    ("wrong-type", "3.5"),
    ("wrong-type", "!!binary aGVsbG8="),
    ("wrong-type", "2026-12-01"),
    ("wrong-type", "[[1, [2, [3]]]]"),
    ("wrong-type", "{dp: {tp: {pp: 1}}}"),
    ("null", "null"),
    ("null", "~"),
    ("null", ""),
    ("non-finite", ".nan"),
    ("non-finite", ".inf"),
    ("non-finite", "-.inf"),
    ("non-finite", '"nan"'),
    ("non-finite", '"-inf"'),
    ("non-finite", "1e999"),
    ("non-finite", "[.nan, .inf]"),
    ("huge", "9223372036854775808"),
    ("huge", "1" + "0" * 29),
    ("huge", "1" + "0" * 40),
    ("huge", "1.0e+300"),
    ("huge", "9007199254740993"),
    ("huge", "1048577"),
    ("huge", '"' + "x" * 5000 + '"'),
    ("huge", "[" + "1, " * 20000 + "1]"),
    ("huge", '"' + "y" * 300 + '"'),
    ("negative", "-1"),
    ("negative", "-0.0"),
    ("negative", "-1.0e-9"),
    ("negative", "-9999999999"),
    ("zero-empty", "0"),
    ("zero-empty", "0.0"),
    ("zero-empty", '""'),
    ("zero-empty", "[]"),
    ("zero-empty", "{}"),
    ("zero-empty", "4.9e-324"),
    ("zero-empty", '" "'),
    ("unicode", '"ünïcødé"'),
    ("unicode", '"日本語"'),
    ("unicode", '"\\u202eevil"'),
    ("unicode", '"🙂"'),
    ("unicode", '"nul\\0byte"'),
    ("unicode", '"tab\\tchar"'),
    ("unicode", '"line\\nbreak"'),
    ("unicode", '"\\udc80"'),
    ("unicode", "\ufeffbom"),
    ("shell", '"$(rm -rf /)"'),
    ("shell", '"`id`"'),
    ("shell", '"; echo pwned"'),
    ("shell", '"a|b&&c>d"'),
    ("shell", '"\'\\""'),
    ("shell", '"--wrap=hostname"'),
    ("shell", '"../../etc/passwd"'),
    ("shell", '"/"'),
    ("shell", '"*"'),
    ("shell", '"~root"'),
    ("shell", '"%j%t"'),
    ("alias", _BOMB),
    ("alias", "&r [*r]"),
    ("alias", "&m {x: *m}"),
    ("alias", "*undefined"),
    ("alias", "&fair 2"),
    ("alias", "!!python/object/apply:os.system [id]"),
]
DOC_KINDS = ("duplicate-field", "duplicate-section", "section-scalar", "section-list", "unknown-key")


@dataclass
class Mutation:
    config: str  # shipped config name
    section: str
    field: str  # "" for document-level mutations
    kind: str
    text: str  # the value's YAML text ("" for document kinds)
    via: str  # "file" | "set"

    def label(self) -> str:
        where = f"{self.section}.{self.field}" if self.field else self.section
        shown = self.text if len(self.text) <= 40 else self.text[:37] + "..."
        return f"{self.config} {where} [{self.kind}/{self.via}] {shown!r}"


def field_paths(raw: dict) -> list[tuple[str, str]]:
    """Every (section, field) of the schema, plus entries of the mapping fields the file sets."""
    out = []
    for name, cls in sections().items():
        for f in cls.__dataclass_fields__.values():
            out.append((name, f.name))
        for key, value in (raw.get(name) or {}).items():
            if isinstance(value, dict):
                out += [(name, f"{key}.{sub}") for sub in value]
    return out


def mutations(config_paths: list[Path]) -> list[Mutation]:
    out = []
    for path in config_paths:
        raw = yaml.safe_load(path.read_text())
        for section, name in field_paths(raw):
            for kind, text in VALUES:
                for via in ("file", "set"):
                    if via == "set" and text.startswith(("&", "*", "!!", "\ufeff")):
                        continue  # anchors/tags in --set are covered by the file variant
                    out.append(Mutation(path.stem, section, name, kind, text, via))
            for kind in ("duplicate-field", "unknown-key"):
                out.append(Mutation(path.stem, section, name, kind, "", "file"))
        for section in sections():
            for kind in ("duplicate-section", "section-scalar", "section-list"):
                out.append(Mutation(path.stem, section, "", kind, "", "file"))
    return out


def _flow(value) -> str:
    return yaml.safe_dump(value, default_flow_style=True, width=1 << 30).strip().removesuffix("...").strip()


def render(raw: dict, m: Mutation) -> str:
    """The shipped config as YAML text with mutation `m` applied (text-level, so that aliases,
    tags and duplicates survive)."""
    lines = []
    fields = m.field.split(".")
    done = False
    for section, body in raw.items():
        if section == m.section and m.kind == "section-scalar":
            lines.append(f"{section}: 5")
            continue
        if section == m.section and m.kind == "section-list":
            lines.append(f"{section}: [1, 2]")
            continue
        lines.append(f"{section}:")
        for key, value in (body or {}).items():
            if section == m.section and key == fields[0] and m.via == "file" and m.kind in dict(VALUES):
                if len(fields) == 2 and isinstance(value, dict):
                    inner = {k: _flow(v) for k, v in value.items()}
                    inner[fields[1]] = m.text
                    lines.append(f"  {key}: {{{', '.join(f'{k}: {v}' for k, v in inner.items())}}}")
                else:
                    lines.append(f"  {key}: {m.text}")
                done = True
                continue
            lines.append(f"  {key}: {_flow(value)}")
            if section == m.section and key == fields[0] and m.kind == "duplicate-field":
                lines.append(f"  {key}: {_flow(value)}")
                done = True
        if section == m.section and not done and m.field and m.via == "file" and m.kind in dict(VALUES):
            lines.append(f"  {m.field.replace('.', ': {', 1)}: {m.text}" + ("}" if "." in m.field else ""))
        if section == m.section and m.kind == "duplicate-field" and not done:
            lines += [f"  {fields[0]}: null", f"  {fields[0]}: null"]
        if section == m.section and m.kind == "unknown-key":
            lines.append(f"  {fields[0]}_x: 1")
    if m.section not in raw and m.via == "file" and m.field and m.kind in dict(VALUES):
        lines += [f"{m.section}:", f"  {m.field}: {m.text}"]
    if m.kind == "duplicate-section":
        lines += [f"{m.section}:", "  {}: null".format(next(iter(sections()[m.section].__dataclass_fields__)))]
    return "\n".join(lines) + "\n"
