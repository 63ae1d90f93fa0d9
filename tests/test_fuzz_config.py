"""scripts/fuzz_config.py on a small seeded sample (the full run, ~16,000 mutations, is by hand):
every mutated `--dry-run` exits 0 or with one `error:` line and 2, never a traceback, in < 2 s."""
from __future__ import annotations

import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import fuzz_config  # noqa: E402


def test_every_field_and_kind_is_mutated():
    todo = fuzz_config.mutations(sorted((ROOT / "configs").glob("*.yaml")))
    assert len(todo) >= 1000
    kinds = {m.kind for m in todo}
    assert {"wrong-type", "null", "non-finite", "huge", "negative", "zero-empty", "unicode", "shell", "alias",
            "duplicate-field", "duplicate-section"} <= kinds
    fields = {(m.section, m.field) for m in todo}
    for section, cls in fuzz_config.sections().items():
        for name in cls.__dataclass_fields__:
            assert (section, name) in fields


def test_small_sample_keeps_the_contract():
    report = fuzz_config.fuzz(limit=50, subprocess_sample=2, seed=17)
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
