"""YAML -> typed `Config`, with `--set section.field=value` overrides.

Why not dacite/pydantic: we want every error to be one line that names the field and says how to
fix it (closest valid key for typos); numbers are read as YAML 1.2 (see `strict_yaml`).
The type hints of `schema.py` are the only source of truth; this module interprets them.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml

from nanotrain.config import slurm_time, strict_yaml
from nanotrain.config import text as config_text
from nanotrain.config.paths import FILE, check_path
from nanotrain.config.schema import MAX_INT, Config

MAX_STRING = 4096  # the longest path Linux takes; no config string needs more


class ConfigError(ValueError):
    """A user error in a config file or override: the message is one line naming the field and the
    fix, ready to print after ``error:`` (the commands exit 2 on it)."""


def _shown(key: Any) -> str:
    """A user's key, bounded and with non-printable characters escaped, for an error message."""
    text = str(key)
    return config_text.escaped(text if len(text) <= 60 else text[:57] + "...")


def _closest(name: str, valid) -> str:
    if len(name) > 60:  # difflib is quadratic; nothing that long is a typo of a field name
        return f"; valid keys: {', '.join(valid)}"
    match = difflib.get_close_matches(name, list(valid), n=1, cutoff=0.5)
    return f"; did you mean '{match[0]}'?" if match else f"; valid keys: {', '.join(valid)}"


def _describe(value: Any) -> str:
    """A short, bounded description: an error path must never build the repr of a huge value."""
    if isinstance(value, (list, tuple)):
        return f"a list of {len(value)} item(s)"
    if isinstance(value, dict):
        return f"a mapping of {len(value)} key(s)"
    if isinstance(value, str) and len(value) > 60:
        return f"{value[:57] + '...'!r} (str of {len(value)} characters)"
    return f"{value!r} ({type(value).__name__})"


def _parse_value(where: str, hint: Any, value: Any, why: str = "") -> Any:
    """Convert one YAML value to `hint`, or raise ConfigError naming `where` (`why`, the field's
    fix, follows the error of a value that is not one of a `Literal`'s choices)."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:  # Optional[X]
        if value is None:
            return None
        inner = [a for a in args if a is not type(None)]
        return _parse_value(where, inner[0], value, why)
    if value is None:
        raise ConfigError(f"{where}: must be set (null is not allowed here)")
    if hint is str and isinstance(value, (int, float)) and not isinstance(value, bool):
        return _check_string(where, strict_yaml.written(value))  # `010` stays '010', never '10'
    value = strict_yaml.plain(value)
    if dataclasses.is_dataclass(hint):  # a sub-section: model.moe, data.sources[i], data.validation
        return _build_section(where, hint, value)
    if origin is Literal:
        for option in args:
            if value == option and type(value) is type(option):
                return option
            if isinstance(value, str) and isinstance(option, str) and value.lower() == option.lower():
                return option
        choices = ", ".join(repr(a) for a in args)
        return _fail(f"{where}: {_describe(value)} is not one of {choices}{': ' + why if why else ''}")
    if hint is bool:
        if isinstance(value, bool):
            return value
        return _fail(f"{where}: expected true or false, got {_describe(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        return _fail(f"{where}: expected an integer, got {_describe(value)}")
    if hint is float:
        return _parse_float(where, value)
    if hint is str:
        if isinstance(value, (str, int, float)) and not isinstance(value, bool):
            return _check_string(where, str(value))
        return _fail(f"{where}: expected a string, got {_describe(value)}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            return _fail(f"{where}: expected a list of {len(args)} values, got {_describe(value)}")
        return tuple(_parse_value(f"{where}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if origin is list:
        if not isinstance(value, list):
            return _fail(f"{where}: expected a list, got {_describe(value)}")
        return [_parse_value(f"{where}[{i}]", args[0], v) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            return _fail(f"{where}: expected a mapping of key: value, got {_describe(value)}")
        return {
            _check_string(f"{where} key", strict_yaml.written(k)): _parse_value(f"{where}.{k}", args[1], v)
            for k, v in value.items()
        }
    raise TypeError(f"unsupported config type {hint!r} for {where}")  # a bug in schema.py


def _fail(message: str):
    raise ConfigError(message)


def _parse_float(where: str, value: Any) -> float:
    """A finite float. NaN and infinity are refused here, for every float field at once: a range
    check cannot catch NaN (every comparison with it is false), and either trains to `loss nan`."""
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:  # an integer beyond 1.8e308
            return _fail(f"{where}: {_describe(value)} is too large for a number")
    elif isinstance(value, str):  # e.g. a quoted "3e-4"
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        return _fail(f"{where}: expected a number, got {_describe(value)}")
    if not math.isfinite(number):
        return _fail(f"{where}: {number} is not a finite number: give a real value such as the default")
    return number


def _check_string(where: str, text: str) -> str:
    """Strings end up in paths, sbatch lines and shell: one printable line of sane length."""
    if len(text) > MAX_STRING:
        return _fail(f"{where}: a string of {len(text):,} characters; at most {MAX_STRING} are accepted")
    problem = config_text.problem(text)
    if problem:
        return _fail(f"{where}: {problem}")
    return text


def _check_range(where: str, meta: typing.Mapping, value: Any) -> None:
    """Inclusive `min`/`max` (`min_exclusive` makes the minimum strict); integers without a
    `max` are bounded by `MAX_INT`, beyond which the arithmetic of a plan stops being exact.
    Written as `not (value >= lo)` so that a NaN could never pass (it is refused earlier too).
    The field's `why`, when it has one, follows the bound: what the value would do, and the fix."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return
    lo, hi = meta.get("min"), meta.get("max")
    why = f": {meta['why']}" if meta.get("why") else ""
    if hi is None and isinstance(value, int):
        hi = MAX_INT
    if lo is not None and meta.get("min_exclusive") and not value > lo:
        raise ConfigError(f"{where}: {value} must be above {lo} (the minimum, itself excluded){why}")
    if lo is not None and not value >= lo:
        raise ConfigError(f"{where}: {value} is below the minimum {lo}{why}")
    if hi is not None and not value <= hi:
        raise ConfigError(f"{where}: {value} is above the maximum {hi}")


def _parse_slurm_time(where: str, value: Any) -> int:
    try:
        return slurm_time.minutes(value)
    except ValueError:
        return _fail(
            f"{where}: {_describe(value)} is not a time limit: give minutes or a SLURM time {slurm_time.FORMS}"
        )


# Fields whose schema metadata names a "parse" hook are read by it instead of by their type hint.
_PARSE_HOOKS = {"slurm_time": _parse_slurm_time}


def _build_section(section: str, cls: type, raw: Any):
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: expected a mapping of fields, got {_describe(raw)}")
    section_name = section.rsplit(".", 1)[-1]
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(
                f"{section}.{_shown(key)}: unknown key in section '{section_name}'{_closest(str(key), fields)}"
            )
        where = f"{section}.{key}"
        hook = _PARSE_HOOKS.get(fields[key].metadata.get("parse"))
        why = fields[key].metadata.get("why", "")
        parsed = hook(where, value) if hook else _parse_value(where, hints[key], value, why)
        _check_range(where, fields[key].metadata, parsed)
        kwargs[key] = parsed
    return cls(**kwargs)


def check_fields(config: Config) -> None:
    """The per-field checks again, on a `Config` that may not come from YAML (built in code, or
    changed after loading): every float finite, every number in its range, sub-sections too."""
    for name in sections():
        _check_object(name, getattr(config, name))


def _check_object(prefix: str, section) -> None:
    for f in dataclasses.fields(section):
        where, value = f"{prefix}.{f.name}", getattr(section, f.name)
        if dataclasses.is_dataclass(value):
            _check_object(where, value)
            continue
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            for i, item in enumerate(value):
                _check_object(f"{where}[{i}]", item)
            continue
        for i, item in enumerate(value if isinstance(value, tuple) else (value,)):
            if isinstance(item, float) and not math.isfinite(item):
                at = f"{where}[{i}]" if isinstance(value, tuple) else where
                raise ConfigError(f"{at}: {item} is not a finite number: give a real value such as the default")
        _check_range(where, f.metadata, value)


def sections() -> dict[str, type]:
    """Section name -> dataclass, in the order of `Config`."""
    hints = typing.get_type_hints(Config)
    return {f.name: hints[f.name] for f in dataclasses.fields(Config)}


def config_from_dict(raw: Any) -> Config:
    """A typed ``Config`` from a plain mapping of sections (parsed YAML, ``config_to_dict``'s output).

    Args:
        raw: ``{section: {field: value}}``; None is the defaults. Missing fields take their defaults.

    Raises:
        ConfigError: not a mapping, an unknown section or key (with the closest valid one), a value
            of the wrong type, not finite or out of its field's range.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections at the top level, got {_describe(raw)}")
    known = sections()
    for key in raw:
        if key not in known:
            raise ConfigError(f"{_shown(key)}: unknown section{_closest(str(key), known)}")
    return Config(**{name: _build_section(name, cls, raw.get(name)) for name, cls in known.items()})


def config_to_dict(config: Config) -> dict:
    """Plain YAML-safe dict (tuples become lists), the inverse of `config_from_dict`."""

    def plain(value):
        if isinstance(value, tuple):
            return [plain(v) for v in value]
        if isinstance(value, list):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return {k: plain(v) for k, v in value.items()}
        return value

    return plain(dataclasses.asdict(config))


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `section.field[.key]=value` to the raw dict; the value is parsed as YAML."""
    path, sep, text = assignment.partition("=")
    if not sep or not path:
        raise ConfigError(f"--set {assignment!r}: expected section.field=value, e.g. training.train_steps=200")
    keys = path.strip().split(".")
    shown = config_text.escaped(path)
    known = sections()
    if len(keys) < 2:
        raise ConfigError(f"--set {assignment!r}: expected section.field=value, e.g. parallelism.tp=2")
    if keys[0] not in known:
        raise ConfigError(f"--set {shown}: unknown section '{config_text.escaped(keys[0])}'{_closest(keys[0], known)}")
    field_names = [f.name for f in dataclasses.fields(known[keys[0]])]
    if keys[1] not in field_names:
        raise ConfigError(f"--set {shown}: unknown key in section '{keys[0]}'{_closest(keys[1], field_names)}")
    hint = typing.get_type_hints(known[keys[0]])[keys[1]]
    sub = next((a for a in (hint, *typing.get_args(hint)) if dataclasses.is_dataclass(a)), None)  # model.moe
    if sub is not None and len(keys) == 3:
        sub_names = [f.name for f in dataclasses.fields(sub)]
        if keys[2] not in sub_names:
            raise ConfigError(f"--set {shown}: unknown key in '{keys[0]}.{keys[1]}'{_closest(keys[2], sub_names)}")
    nested = typing.get_origin(hint) is dict or sub is not None
    if len(keys) > 3 or (len(keys) == 3 and not nested):
        raise ConfigError(f"--set {shown}: '{keys[0]}.{keys[1]}' has no sub-keys")
    try:
        value = strict_yaml.load(text) if text.strip() else None
    except yaml.YAMLError as exc:
        raise ConfigError(
            f"--set {shown}: the value is not valid YAML ({strict_yaml.error_line(exc, text)[1]})"
        ) from None
    node = raw.setdefault(keys[0], {})
    if node is None:
        node = raw[keys[0]] = {}
    if not isinstance(node, dict):
        raise ConfigError(f"{keys[0]}: expected a mapping of fields, got {_describe(node)}")
    for key in keys[1:-1]:
        child = node.get(key)
        child = dict(child) if isinstance(child, dict) else {}
        node[key] = child
        node = child
    node[keys[-1]] = value


def read_yaml(path: str | Path) -> dict:
    """The YAML document of a config file; every way a file can be wrong is one ConfigError
    that names the file (and the line, for YAML problems)."""
    check_path(
        "config file",
        path,
        FILE,
        ConfigError,  # a FIFO is never opened
        missing=f"config file {str(path)!r} not found: pass the path of a YAML file, e.g. configs/tiny_cpu.yaml",
    )
    path = Path(path)
    try:
        with open(path, "rb") as f:
            data = f.read(strict_yaml.MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{path}: cannot read the config file ({exc.strerror or exc}): check its permissions"
        ) from None
    if len(data) > strict_yaml.MAX_BYTES:
        raise ConfigError(
            f"{path}: larger than {strict_yaml.MAX_BYTES // 1024} KB; a config is a few KB "
            "of YAML (is this the right file?)"
        )
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not a UTF-8 text file (byte 0x{data[exc.start]:02x} at offset "
            f"{exc.start}): a config is a YAML text file (is this the right file?)"
        ) from None
    try:
        raw = strict_yaml.load(text)
    except yaml.YAMLError as exc:
        line, problem = strict_yaml.error_line(exc, text)
        at = f" at line {line}" if line is not None else ""
        raise ConfigError(f"{path}: invalid YAML{at}: {problem}") from None
    return {} if raw is None else raw


def load_config(path: str | Path | None, overrides: typing.Iterable[str] = ()) -> Config:
    """Read a YAML config, apply ``--set`` overrides, and parse it with types.

    Per-field types and ranges are checked here; the rules that relate fields to each other, the
    world size and SLURM are ``validate``'s.

    Args:
        path: the YAML file, or None to start from the defaults.
        overrides: ``section.field[.key]=value`` strings, applied in order; values are YAML.

    Returns:
        The parsed ``Config``.

    Raises:
        ConfigError: the file is missing, unreadable, not UTF-8, too large or not a plain YAML
            document (duplicate keys, aliases beyond the budget, too deep), an override is
            malformed or names an unknown key, or any value is refused (``config_from_dict``).
    """
    raw = read_yaml(path) if path is not None else {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level, got {_describe(raw)}")
    for assignment in overrides:
        apply_override(raw, assignment)
    return config_from_dict(raw)


def dump_config(config: Config, path: str | Path) -> None:
    """Write ``config`` as YAML to ``path`` (the run directory's ``config.yaml``, which every task
    reads back with ``load_config``), fields in schema order."""
    Path(path).write_text(yaml.safe_dump(config_to_dict(config), sort_keys=False))
