"""A case of the generated categories and of the corpus, and the generators of the scripts and
paths categories (yaml11 and unicode: categories.py).

A case names its target (`submit`, or a script whose `main(argv)` is called), its argv, the
config text written to `@cfg@` (tiny_cpu.yaml when empty) and the answer it must get: `expect`
(ok-0 / ok-2 / any: exit 0 or one `error:` line), `names` (words the error line must hold),
`stdout_has` (what an exit-0 answer prints), `value` (a field and the readings it may have once
loaded), `after` (a check of the accepted config that the ranks would run: see runner.AFTER).
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

import yaml

from fuzzing.workspace import TINY, hostile_for

SCRIPTS = ("export_hf", "reshard_checkpoint", "hf_config", "inspect_topology", "fuzz_config", "generate")


@dataclass
class Case:
    category: str
    target: str
    argv: list[str]
    label: str
    config: str = ""
    expect: str = "any"
    names: list[str] = field(default_factory=list)
    stdout_has: str = ""
    value: dict | None = None  # {"field": "section.name", "text": the YAML text given}
    after: str = ""
    process: bool = False
    fake: dict = field(default_factory=dict)  # command name -> shell body, first on PATH
    env: dict = field(default_factory=dict)  # environment of a process case
    writes: bool = False  # an accepted answer writes its output (export, reshard, --emit): not a fault
    timeout_s: float = 0.0
    edits: tuple = ()  # (section, name, text, key) edits of tiny_cpu.yaml, rendered when run

    def config_text(self) -> str:
        """The config file's text: `config`, else tiny_cpu.yaml with `edits` (rendered only now:
        thousands of cases are generated, a few run)."""
        return self.config or (config_with_all(list(self.edits)) if self.edits else TINY.read_text())


@functools.lru_cache(maxsize=1)
def _tiny_text() -> str:
    return TINY.read_text()


def tiny_raw() -> dict:
    return yaml.safe_load(_tiny_text())


def config_with(section: str, name: str, text: str, key: bool = False) -> tuple:
    """The edit that sets `section.name` (a.b = nested) of tiny_cpu.yaml to the YAML text `text`
    verbatim (or, `key`: adds an extra key `text` to that mapping), for Case.edits."""
    return ((section, name, text, key),)


def config_with_all(edits: list[tuple[str, str, str, bool]]) -> str:
    """tiny_cpu.yaml as block YAML with the (section, name, text, key) edits applied, each text
    verbatim, so that the loader reads it exactly as a user's file would be read."""
    raw = tiny_raw()
    marks = {}
    for i, (section, name, text, key) in enumerate(edits):
        node = raw.setdefault(section, {})
        parts = [p for p in name.split(".") if p]
        for part in parts[:-1] if not key else parts:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        mark = f"__FUZZ{i}__"
        marks[mark] = text
        if key:
            node[mark] = "1"
        else:
            node[parts[-1]] = mark
    out = yaml.safe_dump(raw, sort_keys=False, default_flow_style=False, width=1 << 20, allow_unicode=True)
    for mark, text in marks.items():
        out = out.replace(mark, text)
    return out


def _q(path: str) -> str:
    return json.dumps(path)


def fine(role: str, hostile: str) -> bool:
    """Whether a hostile path is nevertheless a valid value there (either answer is right; a hang,
    a traceback or a write on refusal still is not): a folder, even one holding a FIFO or named
    like a glob, as an output folder; a text file as a corpus."""
    return (role == "out" and hostile in ("dir", "fifo_hf", "glob_ws")) or (role == "data" and hostile == "file")


# Inputs (read) and outputs (written) of every script.
SCRIPT_ARGS = {
    "export_hf": (["@ckpt@", "@out@"], ["in", "out"]),
    "reshard_checkpoint": (["@ckpt@", "@out@", "--set", "parallelism.tp=2"], ["in", "out"]),
    "hf_config": (["@hf@"], ["in"]),
    "inspect_topology": (["@cfg@"], ["in"]),
    "fuzz_config": (["--limit", "1", "--subprocess", "0"], []),
    "generate": (["@ckpt@", "--prompt", "def", "--max-new-tokens", "2"], ["in"]),
}
# (script, extra argv replacing the flags, expect, names)
BAD_FLAGS = [
    ("export_hf", ["--dtype", "float16"], "ok-2", ["--dtype"]),
    ("export_hf", ["--dtype", ""], "ok-2", ["--dtype"]),
    ("export_hf", ["--dtype"], "ok-2", ["--dtype"]),
    ("export_hf", ["--max-shard-size", "0"], "ok-2", ["--max-shard-size"]),
    ("export_hf", ["--max-shard-size", "-1GB"], "ok-2", ["--max-shard-size"]),
    ("export_hf", ["--max-shard-size", "5XB"], "ok-2", ["--max-shard-size"]),
    ("export_hf", ["--max-shard-size", "1e999GB"], "ok-2", ["--max-shard-size"]),
    ("export_hf", ["--max-shard-size", "9" * 40 + "GB"], "any", []),
    ("export_hf", ["--max-shard-size", ""], "ok-2", ["--max-shard-size"]),
    ("reshard_checkpoint", ["--set", "parallelism.tp=3"], "ok-2", ["tp"]),
    ("reshard_checkpoint", ["--set", "parallelism.pp=5"], "ok-2", ["pp"]),
    ("reshard_checkpoint", ["--set", "parallelism.ep=2"], "ok-2", ["ep"]),
    ("reshard_checkpoint", ["--set", "parallelism.dp=0"], "ok-2", ["dp"]),
    ("reshard_checkpoint", ["--set", "parallelism.cp=2"], "ok-2", ["cp"]),
    ("reshard_checkpoint", ["--set", "parallelism.tp=" + "9" * 30], "ok-2", ["tp"]),
    ("reshard_checkpoint", ["--set", "bogus.x=1"], "ok-2", ["bogus"]),
    ("reshard_checkpoint", ["--set", "noequals"], "ok-2", ["--set"]),
    ("reshard_checkpoint", ["--set"], "ok-2", ["--set"]),
    ("reshard_checkpoint", ["--set", "optimizer.zero_stage=3"], "ok-2", ["zero_stage"]),
    ("reshard_checkpoint", ["--granularity", "x"], "ok-2", ["--granularity"]),
    ("inspect_topology", ["--rank", "-1"], "ok-2", ["--rank"]),
    ("inspect_topology", ["--rank", "99"], "ok-2", ["--rank"]),
    ("inspect_topology", ["--rank", str(10**30)], "ok-2", ["--rank"]),
    ("inspect_topology", ["--rank", "x"], "ok-2", ["--rank"]),
    ("inspect_topology", ["--rank"], "ok-2", ["--rank"]),
    ("inspect_topology", ["--set", "parallelism.tp=0"], "ok-2", ["tp"]),
    ("inspect_topology", ["--set", "parallelism"], "ok-2", ["--set"]),
    ("fuzz_config", ["--limit", "-1"], "ok-2", ["--limit"]),
    ("fuzz_config", ["--limit", "x"], "ok-2", ["--limit"]),
    ("fuzz_config", ["--limit", "1e3"], "ok-2", ["--limit"]),
    ("fuzz_config", ["--limit", ""], "ok-2", ["--limit"]),
    ("fuzz_config", ["--subprocess", "-1"], "ok-2", ["--subprocess"]),
    ("fuzz_config", ["--seed", "x"], "ok-2", ["--seed"]),
    ("fuzz_config", ["--limit"], "ok-2", ["--limit"]),
    ("fuzz_config", ["--category", "nope"], "ok-2", ["--category"]),
    ("generate", ["--prompt", ""], "ok-2", ["--prompt"]),
    ("generate", ["--prompt"], "ok-2", ["--prompt"]),
    ("generate", ["--prompt", "x", "--max-new-tokens", "0"], "ok-2", ["--max-new-tokens"]),
    ("generate", ["--prompt", "x", "--max-new-tokens", "1e3"], "ok-2", ["--max-new-tokens"]),
    ("generate", ["--prompt", "x", "--temperature", "-0.5"], "ok-2", ["--temperature"]),
    ("generate", ["--prompt", "x", "--temperature", "inf"], "ok-2", ["--temperature"]),
    ("generate", ["--prompt", "x", "--temperature", "1", "--top-p", "0"], "ok-2", ["--top-p"]),
    ("generate", ["--prompt", "x", "--temperature", "1", "--top-p", "nan"], "ok-2", ["--top-p"]),
    ("generate", ["--prompt", "x", "--temperature", "1", "--top-k", "-3"], "ok-2", ["--top-k"]),
    ("generate", ["--prompt", "x", "--top-k", "3"], "ok-2", ["--top-k"]),
    ("generate", ["--prompt", "x", "--step", "99"], "ok-2", ["--step"]),
    ("generate", ["--prompt", "x", "--step", "x"], "ok-2", ["--step"]),
    ("generate", ["--prompt", "x", "--temperature", "1", "--seed", str(2**63)], "ok-2", ["--seed"]),
    ("generate", ["--prompt", "x", "--temperature", "1e-320", "--seed", "1"], "ok-0", []),
    ("generate", ["--prompt", "x" * 4096], "ok-2", ["--prompt"]),
    ("generate", ["--prompt", "x", "--device", "cuda:x"], "ok-2", ["--device"]),
]


def script_cases() -> list[Case]:
    """Every script with arguments missing, extra, unknown, bad values, hostile paths, SRC = DST."""
    out = []
    for script, (base, kinds) in SCRIPT_ARGS.items():
        npos = len(kinds)
        variants = [
            ("missing-all", [], "ok-2" if npos else "any"),
            ("extra", base[:npos] + ["extra"] + base[npos:], "ok-2"),
            ("unknown-flag", base + ["--bogus"], "ok-2"),
            ("unknown-flag", base + ["--bogus=1"], "ok-2"),
            ("unknown-flag", base + ["-x"], "ok-2"),
            ("empty-arg", [""] + base[1:], "ok-2" if npos else "any"),
            ("help", ["--help"], "ok-0"),
        ]
        if npos > 1:
            variants.append(("missing-one", base[:1], "ok-2"))
        for kind, argv, expect in variants:
            out.append(Case("scripts", script, argv, f"{script} {kind}", expect=expect))
        for i, role in enumerate(kinds):
            for name, what in hostile_for(role).items():
                argv = list(base)
                argv[i] = f"@{name}@"
                out.append(
                    Case(
                        "scripts",
                        script,
                        argv,
                        f"{script} arg {i + 1} ({role}) = {what}",
                        expect="any" if fine(role, name) else "ok-2",
                    )
                )
    for script, flags, expect, names in BAD_FLAGS:
        base, kinds = SCRIPT_ARGS[script]
        bounded = script == "fuzz_config" and "--limit" not in flags  # never a whole run if accepted
        argv = base[: len(kinds)] + flags + (["--limit", "1"] if bounded else [])
        out.append(Case("scripts", script, argv, f"{script} {' '.join(flags)[:60]}", expect=expect, names=names))
    for script, argv in (
        ("export_hf", ["@ckpt@", "@ckpt@"]),
        ("export_hf", ["@step@", "@step@"]),
        ("export_hf", ["@ckpt@", "@step@"]),
        ("reshard_checkpoint", ["@ckpt@", "@ckpt@", "--set", "parallelism.tp=2"]),
        ("reshard_checkpoint", ["@step@", "@ckpt@", "--set", "parallelism.tp=2"]),
        ("reshard_checkpoint", ["@step@", "@step@", "--set", "parallelism.tp=2"]),
    ):
        out.append(Case("scripts", script, argv, f"{script} SRC = DST ({argv[0]} {argv[1]})", expect="ok-2"))
    return out


# Path-typed config fields: (section, field, role). Roles: "in" (read), "data" (read; a plain text
# file is a corpus too), "out" (a folder written into), "name" (a name component).
PATH_FIELDS = [
    ("data", "source", "data"),
    ("data", "tokenizer", "in"),
    ("data", "sources", "data"),
    ("data", "validation", "data"),
    ("data", "cache_dir", "out"),
    ("checkpoints", "path", "out"),
    ("checkpoints", "init_from_hf", "in"),
    ("logging", "dir", "out"),
    ("logging", "run_name", "name"),
]
# Command-line path arguments of submit.py: argv with @P@ standing for the path.
CLI_PATH_ARGS = {
    "config": ["@P@", "--dry-run"],
    "--status": ["--status", "@P@"],
    "--resume": ["--resume", "@P@"],
    "--emit": ["@cfg@", "--emit", "@P@"],
}


def _path_yaml(section: str, name: str, path: str) -> tuple[str, str]:
    """(field name as written, YAML text) for a path in a path field (mapping fields nest it)."""
    if name == "sources":
        return name, f"[{{name: a, source: {_q(path)}, weight: 1}}]"
    if name == "validation":
        return name, f"{{source: {_q(path)}}}"
    return name, _q(path)


def path_cases() -> list[Case]:
    """Every path field (in the file and by --set) and every submit.py path argument given every
    hostile path; a folder is a fine value for a field that names an output folder."""
    out = []
    for section, name, role in PATH_FIELDS:
        for hostile, what in hostile_for(role).items():
            field_name, text = _path_yaml(section, name, f"@{hostile}@")
            expect = "any" if fine(role, hostile) else "ok-2"
            out.append(
                Case(
                    "paths",
                    "submit",
                    ["@cfg@", "--dry-run"],
                    f"{section}.{name} = {what} [file]",
                    edits=config_with(section, field_name, text),
                    expect=expect,
                )
            )
            out.append(
                Case(
                    "paths",
                    "submit",
                    ["@cfg@", "--dry-run", "--set", f"{section}.{field_name}={text}"],
                    f"{section}.{name} = {what} [set]",
                    expect=expect,
                )
            )
    for arg, argv in CLI_PATH_ARGS.items():
        for hostile, what in hostile_for("out" if arg == "--emit" else "in").items():
            role = "out" if arg == "--emit" else "in"
            out.append(
                Case(
                    "paths",
                    "submit",
                    [a.replace("@P@", f"@{hostile}@") for a in argv],
                    f"submit.py {arg} {what}",
                    expect="any" if fine(role, hostile) else "ok-2",
                    writes=arg == "--emit",
                )
            )
    return out
