"""The path-typed fields of the schema (those declared with `doc(path=...)`), found by walking the
dataclasses, so a new path field is checked, and tested, without being listed anywhere else.

`check_path_fields` checks the fields whose kind the config layer can judge alone (directories to
read or create, files). A `data.source` (a path unless 'stdlib' or a hub name) and a
`data.tokenizer` (a path unless 'byte') are checked by the data layer, which knows those words.
"""

from __future__ import annotations

import dataclasses
import typing

from nanotrain.config.loader import ConfigError
from nanotrain.config.paths import CREATE_DIR, DIR, FILE, check_path
from nanotrain.config.schema import Config


def _dataclass_in(hint) -> tuple[type | None, bool]:
    """(the dataclass inside a type hint, whether it is a list of them)."""
    if dataclasses.is_dataclass(hint):
        return hint, False
    args = typing.get_args(hint)
    sub = next((a for a in args if dataclasses.is_dataclass(a)), None)
    return sub, typing.get_origin(hint) is list


def path_fields(cls: type = Config, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted name, kind) of every path field; list entries appear as `data.sources[].source`."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        if "path" in f.metadata:
            out.append((name, f.metadata["path"]))
        sub, many = _dataclass_in(hints[f.name])
        if sub is not None:
            out += path_fields(sub, f"{name}[]." if many else f"{name}.")
    return out


def path_values(obj, prefix: str = "") -> list[tuple[str, str | None, str]]:
    """(name, value, kind) of every path field of a config, with list indices filled in."""
    out = []
    for f in dataclasses.fields(obj):
        name, value = f"{prefix}{f.name}", getattr(obj, f.name)
        if "path" in f.metadata:
            out.append((name, value, f.metadata["path"]))
        elif dataclasses.is_dataclass(value):
            out += path_values(value, f"{name}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if dataclasses.is_dataclass(item):
                    out += path_values(item, f"{name}[{i}].")
    return out


def check_path_fields(config: Config) -> None:
    """Raise ConfigError (one line naming the field) for the first set file/directory field that
    cannot be used: missing, a FIFO, a link loop, an over-long name, a pseudo file system, ..."""
    for name, value, kind in path_values(config):
        if value is not None and kind in (FILE, DIR, CREATE_DIR):
            check_path(name, value, kind, ConfigError)
