"""Huge sizes answer at once: every integer field of model, model.moe, training and parallelism,
at the largest value the schema accepts (2**52 where it has no maximum of its own: divisible by
every small size, so it passes the divisibility checks and reaches the estimates) through
`--dry-run` and `--plan`, and one past that largest value through `--dry-run`. Each answers (a
plan, a dry run, or one `error:` line naming the field, exit 2) within 2 CPU seconds, measured
by getrusage, not by a clock."""

from __future__ import annotations

import dataclasses
import resource
import typing
from pathlib import Path

import pytest

from nanotrain.commands.cli import main
from nanotrain.config import schema

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = (
    ("model", schema.ModelArgs, "tiny_cpu.yaml"),
    ("model.moe", schema.MoEArgs, "moe_16gpu.yaml"),
    ("training", schema.TrainingArgs, "tiny_cpu.yaml"),
    ("parallelism", schema.ParallelismArgs, "tiny_cpu.yaml"),
)


def int_fields():
    for section, cls, config in SECTIONS:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if hints[f.name] in (int, typing.Optional[int]):
                yield f"{section}.{f.name}", f.metadata.get("max"), config


CASES = [
    (name, largest or 2**52, config, mode) for name, largest, config in int_fields() for mode in ("--dry-run", "--plan")
]
CASES += [(name, (largest or schema.MAX_INT) + 1, config, "--dry-run") for name, largest, config in int_fields()]


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


@pytest.mark.parametrize("name, value, config, mode", CASES, ids=[f"{n}={v}{m}" for n, v, _, m in CASES])
def test_huge_sizes_answer_within_two_cpu_seconds(name, value, config, mode, tmp_path, capsys):
    before = _cpu_seconds()
    code = main([str(ROOT / "configs" / config), mode, "--set", f"{name}={value}", "--set", f"logging.dir={tmp_path}"])
    spent = _cpu_seconds() - before
    err = capsys.readouterr().err.strip()
    assert spent < 2.0, f"{name}={value} {mode}: {spent:.2f} CPU s"
    if code != 0:
        assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    if value > (dict((n, hi) for n, hi, _ in int_fields())[name] or schema.MAX_INT):
        assert code == 2 and name in err and "above the maximum" in err, err
