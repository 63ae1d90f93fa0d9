#!/usr/bin/env python3
"""Print the config reference (every section and field, type, default, meaning) as Markdown.

Generated from nanotrain/config/schema.py so the README can never drift from the code: the test
suite checks that the README carries exactly this output.
"""
from __future__ import annotations

import dataclasses
import sys
import typing
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.config.loader import sections  # noqa: E402


def type_name(hint) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Union:
        return " or ".join(type_name(a) for a in args if a is not type(None)) + " or null"
    if origin is typing.Literal:
        return " \\| ".join(repr(a) if not isinstance(a, str) else a for a in args)
    if origin in (list, tuple, dict):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    return getattr(hint, "__name__", str(hint))


def default_of(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        value = f.default_factory()  # type: ignore[misc]
    else:
        value = f.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return f"`{list(value) if isinstance(value, tuple) else value}`"


def _sub_section(hint):
    """The dataclass of a sub-section field (``model.moe: Optional[MoEArgs]``), else None."""
    return next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)


def _table(name: str, cls) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = [f"**`{name}`**", "", "| field | type | default | meaning |", "|---|---|---|---|"]
    subs = []
    for f in dataclasses.fields(cls):
        meta = f.metadata
        bounds = []
        if meta.get("min") is not None:
            bounds.append(f"{'>' if meta.get('min_exclusive') else '>='} {meta['min']}")
        if meta.get("max") is not None:
            bounds.append(f"<= {meta['max']}")
        meaning = "; ".join(filter(None, [meta.get("doc", ""), ", ".join(bounds)]))
        sub = _sub_section(hints[f.name])
        kind = f"section `{name}.{f.name}`" + (" or null" if sub is not hints[f.name] else "") if sub else \
            type_name(hints[f.name])
        lines.append(f"| `{f.name}` | {kind} | {default_of(f)} | {meaning} |")
        if sub is not None:
            subs.append((f"{name}.{f.name}", sub))
    lines.append("")
    for sub_name, sub in subs:
        lines += _table(sub_name, sub)
    return lines


def reference() -> str:
    lines = []
    for name, cls in sections().items():
        lines += _table(name, cls)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
