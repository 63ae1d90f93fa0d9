"""A strict YAML reader for configs and `--set` values: plain documents only.

Why not `yaml.safe_load`: PyYAML accepts aliases, and a 371-byte "billion laughs" document
expands to billions of values as soon as anything walks it (an error message's repr included);
it keeps the last of two duplicate keys without a word (a duplicated section silently
drops the first one); and it recurses without limit into nested flow collections (a
RecursionError, not a YAMLError). A config needs none of that. This loader refuses all of it
while *composing* (before any Python object exists), each time with the line it was found on, as
a `yaml.MarkedYAMLError` so that callers report it like any other YAML error. Aliases stay allowed
while the document they expand to is config-sized (`<<: *defaults` is a fair use).

Numbers follow YAML 1.2's core schema, not PyYAML's YAML 1.1: `1:30:00` stays the string it looks
like (1.1 reads sexagesimal 5400), `010` is ten (1.1: octal 8), `0o17`/`0x1f` are octal/hex,
`1_000` and `0b101` stay strings, and `3e-4` is a float (1.1 wants `3.0e-4`).
"""

from __future__ import annotations

import re

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError
from yaml.events import AliasEvent, CollectionStartEvent
from yaml.nodes import MappingNode, ScalarNode, SequenceNode

from nanotrain.config.text import escaped

MAX_VALUES = 10_000  # values after expanding aliases; shipped configs hold about 120
MAX_DEPTH = 32  # nesting; a config is 3 deep
MAX_INT_DIGITS = 30  # larger integers only arrive by mistake (and 4300+ digits crash int())
MAX_BYTES = 1 << 20  # a config is a few KB


class WrittenInt(int):
    """An integer whose YAML text is not its decimal form (`010`, `0x1F`, `+1`): a string field
    given it keeps the text as written (`slurm.partition: 010` is the partition '010', not '10')."""

    written: str


class WrittenFloat(float):
    """A float whose YAML text is not how Python prints it (`1e3`, `.5`): as WrittenInt."""

    written: str


def _keeping_text(value, text: str):
    """`value`, remembering `text` when str(value) would not give it back."""
    if str(value) == text:
        return value
    kept = (WrittenInt if isinstance(value, int) else WrittenFloat)(value)
    kept.written = text
    return kept


def plain(value):
    """A number as its base type (what every field but a string one gets), anything else as is."""
    if isinstance(value, WrittenInt):
        return int(value)
    if isinstance(value, WrittenFloat):
        return float(value)
    return value


def written(value) -> str:
    """The text a scalar was written as in YAML."""
    return getattr(value, "written", None) or str(value)


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that counts values (aliases by what they expand to), bounds nesting, and
    refuses duplicate keys and absurdly long integers."""

    def __init__(self, stream):
        super().__init__(stream)
        self._values = 0
        self._depth = 0
        self._open_anchors: set[str] = set()
        self._sizes: dict[int, int] = {}

    def _count(self, n: int, mark, what: str) -> None:
        self._values += n
        if self._values > MAX_VALUES:
            raise ComposerError(
                None,
                None,
                f"{what} makes the document larger than {MAX_VALUES:,} values "
                "(a config needs a few hundred): write the values out instead of "
                "expanding aliases",
                mark,
            )

    def _size(self, node) -> int:
        """Values in `node` with aliases expanded (memoized: aliased nodes are shared)."""
        key = id(node)
        if key not in self._sizes:
            if isinstance(node, SequenceNode):
                self._sizes[key] = 1 + sum(self._size(n) for n in node.value)
            elif isinstance(node, MappingNode):
                self._sizes[key] = 1 + sum(self._size(k) + self._size(v) for k, v in node.value)
            else:
                self._sizes[key] = 1
        return self._sizes[key]

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, AliasEvent):
            if event.anchor in self._open_anchors:
                raise ComposerError(
                    None,
                    None,
                    f"alias *{event.anchor} refers to a value that contains "
                    "it (a recursive document): write the values out",
                    event.start_mark,
                )
            if event.anchor in self.anchors:
                self._count(self._size(self.anchors[event.anchor]), event.start_mark, f"alias *{event.anchor}")
            return super().compose_node(parent, index)  # PyYAML reports an undefined alias
        self._count(1, event.start_mark, "this value")
        anchor = event.anchor if isinstance(event, CollectionStartEvent) else None
        self._depth += 1
        if self._depth > MAX_DEPTH:
            raise ComposerError(
                None,
                None,
                f"values nested more than {MAX_DEPTH} levels deep (a config is 3 levels deep)",
                event.start_mark,
            )
        if anchor is not None:
            self._open_anchors.add(anchor)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(anchor)

    def construct_mapping(self, node, deep=False):
        """Refuse a key given twice in one mapping (PyYAML would keep the last one silently).
        Keys merged in with `<<:` may be overridden: that is what a merge is for."""
        if isinstance(node, MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=False)
                try:
                    first = seen.get(key)
                except TypeError:  # unhashable: PyYAML reports it below
                    continue
                seen.setdefault(key, key_node.start_mark.line)
                if first is not None:
                    shown = escaped(str(key) if len(str(key)) <= 40 else str(key)[:37] + "...")
                    raise ConstructorError(
                        None,
                        None,
                        f"duplicate key '{shown}' (first given at line {first + 1}): keep only one",
                        key_node.start_mark,
                    )
        return super().construct_mapping(node, deep=deep)

    def construct_yaml_int(self, node):
        digits = sum(ch.isdigit() for ch in str(node.value))
        if digits > MAX_INT_DIGITS:
            raise ConstructorError(
                None, None, f"an integer of {digits} digits is far beyond any config value", node.start_mark
            )
        source = text = str(node.value)
        sign = -1 if text.startswith("-") else 1
        text = text.lstrip("+-")
        if text.startswith("0o"):
            return _keeping_text(sign * int(text[2:], 8), source)
        if text.startswith("0x"):
            return _keeping_text(sign * int(text[2:], 16), source)
        return _keeping_text(sign * int(text, 10), source)  # "010" is ten, as in YAML 1.2

    def construct_yaml_float(self, node):
        return _keeping_text(super().construct_yaml_float(node), str(node.value))


_INT, _FLOAT = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
# StrictLoader's own copy of the implicit resolvers, without YAML 1.1's int and float rules;
# SafeLoader and the global yaml state stay as they are.
StrictLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT, _FLOAT)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
# YAML 1.2 core schema; int before float, since a plain integer matches both.
StrictLoader.add_implicit_resolver(_INT, re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789"))
StrictLoader.add_implicit_resolver(
    _FLOAT,
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?"
        r"|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
StrictLoader.add_constructor(_INT, StrictLoader.construct_yaml_int)
StrictLoader.add_constructor(_FLOAT, StrictLoader.construct_yaml_float)


def load(text: str):
    """Parse one YAML document with `StrictLoader` (raises `yaml.YAMLError`)."""
    loader = StrictLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def error_line(exc: yaml.YAMLError, text: str) -> tuple[int | None, str]:
    """(1-based line, one-line problem) of any PyYAML error, including the reader's own
    (a control character) whose `str()` spans several lines."""
    if isinstance(exc, yaml.reader.ReaderError):
        line = text.count("\n", 0, max(0, exc.position)) + 1
        char = exc.character if isinstance(exc.character, int) else ord(exc.character)
        return line, f"character #x{char:04x} is not allowed ({exc.reason})"
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    return (mark.line + 1 if mark is not None else None), " ".join(str(problem).split())
