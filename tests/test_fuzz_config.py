"""scripts/fuzz_config.py: its fixed corpus in full, 20 seeded cases of each generated category and
a small sample of the config mutations (the full run, ~26,000 cases, is by hand): every answer is
exit 0 or one `error:` line and exit 2, never a traceback or a hang, nothing written, < 2 CPU s,
and what each corpus case says it must be (refused naming the field, or accepted meaning what the
user meant). Also: every category generates every field, argument and hostile kind it claims."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import sys
import typing
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import fuzz_config  # noqa: E402
from fuzzing import cases, categories, corpus, harness, runner, suite, values  # noqa: E402
from fuzzing.workspace import hostile_for  # noqa: E402


def test_every_field_and_kind_is_mutated():
    todo = fuzz_config.mutations(sorted((ROOT / "configs").glob("*.yaml")))
    assert len(todo) >= 1000
    kinds = {m.kind for m in todo}
    assert {
        "wrong-type",
        "null",
        "non-finite",
        "huge",
        "negative",
        "zero-empty",
        "unicode",
        "shell",
        "alias",
        "duplicate-field",
        "duplicate-section",
    } <= kinds
    fields = {(m.section, m.field) for m in todo}
    for section, cls in fuzz_config.sections().items():
        for name in cls.__dataclass_fields__:
            assert (section, name) in fields


def test_small_sample_keeps_the_contract():
    report = fuzz_config.fuzz(limit=50, subprocess_sample=2, seed=17, categories=("config",), corpus=False)
    out = io.StringIO()
    fuzz_config.print_report(report, out)
    assert report["mutations"] == 50 and report["subprocess_runs"] == 2
    assert report["failures"] == [], out.getvalue()
    assert sum(report["counts"].values()) == 52
    assert "tracebacks: 0, slow: 0, contract broken: 0" in out.getvalue()


def test_a_bomb_and_a_duplicate_render_as_intended():
    raw = {"parallelism": {"dp": 2}, "slurm": {"env": {"A": "1"}}}
    bomb = fuzz_config.Mutation("x", "parallelism", "dp", "alias", fuzz_config._BOMB, "file")
    assert "&i [*h" in fuzz_config.render(raw, bomb)
    dup = fuzz_config.render(raw, fuzz_config.Mutation("x", "parallelism", "dp", "duplicate-field", "", "file"))
    assert dup.count("  dp: 2") == 2
    sub = fuzz_config.render(raw, fuzz_config.Mutation("x", "slurm", "env.A", "shell", '"$(id)"', "file"))
    assert 'env: {A: "$(id)"}' in sub


def test_verdict_flags_what_breaks_the_contract():
    ok = fuzz_config.Outcome(code=2, stderr="error: x: bad\n", cpu_s=0.1, wall_s=0.1)
    assert fuzz_config.verdict(ok) == "ok-2"
    assert fuzz_config.verdict(fuzz_config.Outcome(2, "error: a\nerror: b\n", 0.1, 0.1)) == "bad-output"
    assert fuzz_config.verdict(fuzz_config.Outcome(1, "error: a\n", 0.1, 0.1)) == "bad-output"
    assert fuzz_config.verdict(fuzz_config.Outcome(0, "", 2.5, 2.5)) == "slow"
    assert fuzz_config.verdict(fuzz_config.Outcome(None, "", 0.1, 0.1, crash="Traceback ...")) == "traceback"
    assert fuzz_config.verdict(fuzz_config.Outcome(0, "", 0.1, 0.1, wrote=["logs"])) == "wrote-files"


def test_an_escaping_exception_is_caught_as_a_traceback(tmp_path, monkeypatch):
    def broken(_argv):
        raise TypeError("boom")

    monkeypatch.setattr(fuzz_config, "cli_main", broken)
    outcome = fuzz_config.run_in_process(["x.yaml", "--dry-run"], tmp_path)
    assert fuzz_config.verdict(outcome) == "traceback" and "TypeError: boom" in outcome.crash


# ----------------------------------------------------------------------------- corpus and categories
ISSUE_EXAMPLES = {  # every example of wrong input the hardening issue names, by corpus id
    "emit-empty",
    "init-from-hf-fifo-config-json",
    "hf-config-fifo-config-json",
    "recursive-glob-of-root",
    "num-layers-2-53",
    "sbatch-never-answers",
    "slurm-time-sexagesimal-set",
    "slurm-time-sexagesimal-file",
    "dp-leading-zero-set",
    "dp-leading-zero-file",
    "collective-timeout-1e300",
    "optimizer-warmup-equals-train-steps",
    "optimizer-eps-zero",
    "stdlib-too-small-for-one-batch",
    "run-name-256-byte-component",
    "checkpoints-path-symlink-loop",
    "logging-dir-proc",
    "export-bad-dtype",
    "reshard-bad-granularity",
    "hf-config-no-argument",
    "inspect-topology-rank-outside",
    "fuzz-config-negative-limit",
    "reshard-tp-not-dividing-heads",
    "reshard-pp-above-layers",
    "reshard-src-is-dst",
    "export-src-is-dst",
    "reshard-ep-dense-model",
    "status-with-resume",
    "status-with-set",
    "status-with-dry-run",
    "c1-control-in-partition",
    "bidi-override-in-run-name",
    "line-separator-in-setup",
}


def test_corpus_holds_every_example_of_the_issue():
    todo = corpus.corpus_cases()
    ids = {c.label for c in todo}
    assert ISSUE_EXAMPLES <= ids, sorted(ISSUE_EXAMPLES - ids)
    assert {c.target for c in todo} == {"submit", *cases.SCRIPTS}
    refused = [c for c in todo if c.expect == "ok-2"]
    assert all(c.names for c in refused if c.target == "submit" and "@cfg@" in c.argv), [
        c.label for c in refused if not c.names and c.target == "submit" and "@cfg@" in c.argv
    ]
    assert suite.select(tuple(suite.CATEGORIES), limit=1)[: len(todo)] == todo  # the corpus runs first


def test_corpus_keeps_its_answers():
    report = suite.run_suite(categories=(), corpus=True)
    assert report["cases"] == len(corpus.corpus_cases())
    assert report["failures"] == [], "\n".join(report["failures"])


def test_twenty_seeded_cases_of_each_new_category_keep_the_contract():
    report = suite.run_suite(categories=tuple(suite.CATEGORIES), limit=20, seed=25, corpus=False)
    per = {name: sum(n for k, n in report["counts"].items() if k.split()[0] == name) for name in suite.CATEGORIES}
    assert per == {name: 20 for name in suite.CATEGORIES}
    assert report["failures"] == [], "\n".join(report["failures"])


def _path_like_fields() -> set[tuple[str, str]]:
    """String fields of the schema whose description says they name a file, folder or glob
    (fields of the list/mapping sections data.sources and data.validation count as theirs)."""
    from nanotrain.config.schema import SourceArgs, ValidationArgs

    word = re.compile(r"\b(path|dir|director(y|ies)|files?|glob|folder)\b")
    out = set()
    owners = [(s, c, None) for s, c in fuzz_config.sections().items()]
    owners += [("data", SourceArgs, "sources"), ("data", ValidationArgs, "validation")]
    for section, cls, holder in owners:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (str, typing.Optional[str]) and word.search(f.metadata.get("doc", "")):
                out.add((section, holder or f.name))
    return out


def test_every_path_field_and_argument_gets_every_hostile_path():
    fields = {(s, n) for s, n, _ in cases.PATH_FIELDS}
    assert _path_like_fields() <= fields
    labels = {c.label for c in cases.path_cases()}
    for section, name, role in cases.PATH_FIELDS:
        for what in hostile_for(role).values():
            assert {f"{section}.{name} = {what} [file]", f"{section}.{name} = {what} [set]"} <= labels
    for arg in ("config", "--status", "--resume", "--emit"):
        role = "out" if arg == "--emit" else "in"
        assert all(f"submit.py {arg} {what}" in labels for what in hostile_for(role).values())
    for role in ("in", "out"):
        assert {"fifo", "loop", "long", "proc_file", "proc_dir", "sys_new", "broken", "dir", "unreadable"} <= set(
            hostile_for(role)
        )


def test_every_script_and_its_arguments_are_mutated():
    todo = cases.script_cases()
    assert {c.target for c in todo} == set(cases.SCRIPTS)
    labels = {c.label for c in todo}
    for script, (_, roles) in cases.SCRIPT_ARGS.items():
        assert {f"{script} missing-all", f"{script} extra", f"{script} unknown-flag", f"{script} help"} <= labels
        for i, role in enumerate(roles):
            assert all(f"{script} arg {i + 1} ({role}) = {what}" in labels for what in hostile_for(role).values())
    assert {s for s, *_ in cases.BAD_FLAGS} == set(cases.SCRIPTS) - {"hf_config"}  # hf_config has no flag
    assert sum("SRC = DST" in label for label in labels) == 6


def test_every_yaml11_scalar_goes_into_every_field_and_every_unicode_category_everywhere():
    y = {c.label for c in categories.yaml11_cases()}
    for section, name in values.scalar_fields():
        assert all({f"{section}.{name}: {t} [file]", f"{section}.{name}={t} [set]"} <= y for t in values.YAML11)
    assert {
        "1:30:00",
        "010",
        "0o10",
        "0x1F",
        "0b11",
        "1_000",
        "yes",
        "no",
        "on",
        "off",
        "y",
        "n",
        ".5",
        "1e3",
        "+1",
        "~",
        "2026-12-01",
        "=",
        "<<",
    } <= set(values.YAML11)
    u = categories.unicode_cases()
    assert {cat.split("-")[0] for cat, _ in values.UNICODE} >= {
        "Cc",
        "Zl",
        "Zp",
        "Cs",
        "bidi",
        "Cf",
        "Co",
        "Cn",
        "Mn",
        "Nd",
        "Zs",
    }
    for cat, ch in values.UNICODE:
        mine = [c.label for c in u if f" {cat} {ascii(ch)}" in c.label]
        for form in ("[file, escaped]", "[file, raw]", "[set]", "key", "--set path"):
            assert any(form in label for label in mine), (cat, form)
    named = {"\x85", "\u2028", "\u2029", "\u202e", "\u2066", "\u200b", "\ufeff", "\xa0"}  # NEL, Zl, Zp, bidi, Cf, NBSP
    assert named <= {ch for _, ch in values.UNICODE}


def test_the_hang_guard_fires_inside_a_blocking_open(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    outcome = harness.run_main(lambda _argv: len(open(fifo).read()), [], [tmp_path], hang_s=0.3)
    assert harness.verdict(outcome) == "hang" and outcome.wall_s < 5


def test_strict_verdict_and_expectations_catch_what_passes_as_one_line():
    bidi = harness.Outcome(2, "error: a\u202eb\n", 0.1, 0.1)
    assert harness.verdict(bidi) == "ok-2" and harness.verdict(bidi, strict=True) == "unprintable-error"
    assert harness.verdict(harness.Outcome(2, "error: a\x85b\n", 0.1, 0.1)) == "bad-output"  # NEL breaks the line
    case = cases.Case("corpus", "submit", [], "x", expect="ok-2", names=["--emit"])
    ok0, ok2 = harness.Outcome(0, "", 0.1, 0.1, stdout="fine\n"), harness.Outcome(2, "error: x: bad\n", 0.1, 0.1)
    assert runner.expectation(case, ok0, "ok-0", "", [])[0] == "accepted"
    assert runner.expectation(case, ok2, "ok-2", "", [])[0] == "unnamed"
    loose = dataclasses.replace(case, expect="any", names=[])
    assert (
        runner.expectation(loose, harness.Outcome(0, "", 0.1, 0.1, stdout="p=a\u2028b"), "ok-0", "", [])[0]
        == "unsafe-output"
    )


def test_the_yaml11_oracle_knows_what_a_user_means():
    time_meta = {"parse": "slurm_time"}
    assert values.reading_problem("010", 10, {}) == "" and values.reading_problem("010", 8, {}) != ""
    assert values.reading_problem("1:30:00", 90, time_meta) == ""
    assert values.reading_problem("1:30:00", 5400, {}) != "" and values.reading_problem("1:30:00", 90, {}) != ""
    assert values.reading_problem("no", "no", {}) == "" and values.reading_problem("no", "False", {}) != ""
    assert values.reading_problem("0o10", 8, {}) == "" and values.reading_problem("1e3", 1000.0, {}) == ""
