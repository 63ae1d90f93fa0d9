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

from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402
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


def _sub_sections(name: str, cls) -> list:
    """(title, dataclass) of the sub-sections a section holds: `data.sources[]`, `data.validation`."""
    found = []
    for f in dataclasses.fields(cls):
        hint = typing.get_type_hints(cls)[f.name]
        for arg in (hint, *typing.get_args(hint)):
            if dataclasses.is_dataclass(arg):
                list_of = typing.get_origin(hint) is list
                found.append((f"{name}.{f.name}{'[]' if list_of else ''}", arg))
    return found


def reference() -> str:
    lines = []
    todo = []
    for name, cls in sections().items():
        todo += [(name, cls), *_sub_sections(name, cls)]
    for name, cls in todo:
        hints = typing.get_type_hints(cls)
        lines += [f"**`{name}`**", "", "| field | type | default | meaning |", "|---|---|---|---|"]
        for f in dataclasses.fields(cls):
            meta = f.metadata
            bounds = []
            if meta.get("min") is not None:
                bounds.append(f"{'>' if meta.get('min_exclusive') else '>='} {meta['min']}")
            if meta.get("max") is not None:
                bounds.append(f"<= {meta['max']}")
            meaning = "; ".join(filter(None, [meta.get("doc", ""), ", ".join(bounds)]))
            lines.append(f"| `{f.name}` | {type_name(hints[f.name])} | {default_of(f)} | {meaning} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    """No arguments (a stray one is refused in one `error:` line, exit 2, not ignored)."""

    def body() -> int:
        ArgParser(description=__doc__.split("\n\n")[0]).parse_args(argv)
        sys.stdout.write(reference())
        return 0

    return answer(body)


if __name__ == "__main__":
    sys.exit(main())
