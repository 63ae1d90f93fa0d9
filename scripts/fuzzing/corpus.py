"""The fixed corpus (corpus.yaml) as cases: every example of the issue that asked for this
fuzzer's categories, with the answer each must get."""

from __future__ import annotations

from pathlib import Path

import yaml

from fuzzing.cases import Case

CORPUS = Path(__file__).with_name("corpus.yaml")
KEYS = {
    "id",
    "target",
    "argv",
    "set",
    "expect",
    "names",
    "stdout_has",
    "value",
    "after",
    "process",
    "fake",
    "env",
    "timeout_s",
}


def corpus_cases(path: Path = CORPUS) -> list[Case]:
    """The corpus entries as Case objects (category "corpus"); raises ValueError for an entry
    with an unknown key or no target/argv, so that a typo cannot silently drop a check."""
    out = []
    for entry in yaml.safe_load(path.read_text()):
        unknown = set(entry) - KEYS
        if unknown or not {"id", "target", "argv"} <= set(entry):
            raise ValueError(
                f"{path.name}: entry {entry.get('id')!r}: unknown keys {sorted(unknown)} or no id/target/argv"
            )
        edits = [(k.split(".", 1)[0], k.split(".", 1)[1], str(v), False) for k, v in (entry.get("set") or {}).items()]
        out.append(
            Case(
                "corpus",
                entry["target"],
                [str(a) for a in entry["argv"]],
                entry["id"],
                edits=tuple(edits),
                expect=entry.get("expect", "any"),
                names=entry.get("names", []),
                stdout_has=entry.get("stdout_has", ""),
                value=entry.get("value"),
                after=entry.get("after", ""),
                process=entry.get("process", False),
                fake=entry.get("fake", {}),
                env={k: str(v) for k, v in (entry.get("env") or {}).items()},
                timeout_s=float(entry.get("timeout_s", 0)),
            )
        )
    return out
