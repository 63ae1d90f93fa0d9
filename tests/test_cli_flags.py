"""Every pair of `submit.py` flags, taken from the parser itself (a new flag is covered without
editing this file): either some mode of flags.py's table accepts the pair, or the command line
holding just that pair is refused in one `error:` line naming both, exit 2, before any config is
read (the config given does not exist, so reading it would be another error)."""

from __future__ import annotations

import itertools

import pytest

from nanotrain.commands import flags
from nanotrain.commands.cli import build_parser, main
from nanotrain.config.cli_args import non_negative_int

PARSER = build_parser()
ACTIONS = [a for a in PARSER._actions if a.dest != "help"]


def argv_of(action, tmp_path) -> list[str]:
    """A value the parser takes for this argument (paths that do not exist: never read)."""
    if action.nargs == 0:
        return [action.option_strings[0]]
    if action.type in (int, float, non_negative_int):
        value = "1"
    elif action.dest == "set":
        value = "training.steps=1"
    elif action.dest == "sweep":
        value = "optimizer.lr=1e-3,3e-3"
    elif action.choices:
        value = list(action.choices)[0]
    else:
        value = str(tmp_path / f"no_{action.dest}")
    return [*action.option_strings[:1], value]


def test_every_flag_is_in_the_table():
    known = {m.flag for m in flags.MODES} | {f for m in flags.MODES for f in (*m.targets, *m.accepts)}
    assert {flags.flag_name(a) for a in ACTIONS} == known


@pytest.mark.parametrize("a, b", list(itertools.combinations(ACTIONS, 2)), ids=lambda action: flags.flag_name(action))
def test_every_pair_is_accepted_or_refused_naming_both(a, b, tmp_path, capsys):
    name_a, name_b = flags.flag_name(a), flags.flag_name(b)
    if flags.together(name_a, name_b):
        mode = next(m for m in flags.MODES if m.holds((name_a, name_b)))
        flags.check_flags([mode.flag, name_a, name_b])  # a full command line with this pair passes
        return
    first, second = sorted((a, b), key=lambda action: bool(action.option_strings))  # the positional first
    argv = argv_of(first, tmp_path) + argv_of(second, tmp_path)
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    assert name_a in lines[0] and name_b in lines[0], lines[0]


@pytest.mark.parametrize(
    "argv, line",
    [
        (["--gpus", "8", "c.yaml"], "error: --gpus only applies to --plan: add --plan"),
        (
            ["--status", "d", "--set", "a.b=1"],
            "error: --status takes a run directory and shows where it stands; it cannot be combined with --set",
        ),
        (
            ["--resume", "d", "--rank", "0", "--rehearse"],
            "error: --rehearse runs a config's ranks here; it cannot be combined with --resume",
        ),
        (
            ["c.yaml", "--resume", "d", "--dry-run"],
            "error: --resume takes a run directory instead of a config; it cannot be combined with CONFIG",
        ),
        (
            ["c.yaml", "--emit", "d", "--local"],
            "error: --emit writes a SLURM script; it cannot be combined with --local",
        ),
    ],
)
def test_wording(argv, line, capsys):
    assert main(argv) == 2
    assert capsys.readouterr().err.strip().startswith(line)


def test_triples_need_one_mode():
    """Pairwise fine is not enough: --dry-run and --local go with --resume, --emit does not go with
    --local, and so on; a mode must hold the whole command line."""
    flags.check_flags(["--resume", "--dry-run", "--local", "--set"])
    flags.check_flags([flags.CONFIG, "--prepare-data", "--local", "--set"])
    with pytest.raises(ValueError, match="--emit writes a SLURM script; it cannot be combined with --local"):
        flags.check_flags(["--resume", "--emit", "--local"])


@pytest.mark.parametrize(
    "given, mode",
    [
        ([], flags.Mode.RUN),
        ([flags.CONFIG, "--set"], flags.Mode.RUN),
        ([flags.CONFIG, "--local"], flags.Mode.LOCAL),
        (["--resume", "--local"], flags.Mode.RESUME),
        (["--resume", "--dry-run", "--local"], flags.Mode.DRY_RUN),
        (["--emit", "--resume"], flags.Mode.EMIT),
        ([flags.CONFIG, "--prepare-data", "--local"], flags.Mode.PREPARE_DATA),
        (["--status"], flags.Mode.STATUS),
        ([flags.CONFIG, "--plan", "--gpus"], flags.Mode.PLAN),
        ([flags.CONFIG, "--rehearse", "--rank"], flags.Mode.REHEARSE),
    ],
)
def test_the_mode_is_the_first_row_that_holds_the_command(given, mode):
    assert flags.check_flags(given) is mode
