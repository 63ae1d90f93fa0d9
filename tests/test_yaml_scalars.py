"""Config values read as a user means them: YAML 1.2 numbers (no sexagesimal, no 1.1 octal),
SLURM time strings for the time limits, and no control/bidi/line-separator characters in strings."""

from __future__ import annotations

from pathlib import Path

import pytest

from nanotrain.commands.cli import main
from nanotrain.config.loader import ConfigError, load_config


@pytest.mark.parametrize(
    "given, minutes",
    [
        ("1:30:00", 90),
        ("1-00:00:00", 1440),
        ("90", 90),
        ("30:01", 31),
        ("2-3", 3060),
        ("1-02:03", 1563),
        ('"45"', 45),
        ("0:00:01", 1),
    ],
)
def test_slurm_time_strings_become_minutes(given, minutes):
    config = load_config(None, [f"slurm.time={given}", f"slurm.prepare.time={given}"])
    assert config.slurm.time == minutes and config.slurm.prepare.time == minutes


@pytest.mark.parametrize("given", ["1:2:3:4", "1h", "abc", "1-", "1.5"])
def test_bad_time_is_one_line_naming_the_field_and_forms(given):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"slurm.prepare.time={given}"])
    message = str(info.value)
    assert message.startswith("slurm.prepare.time:") and "D-HH:MM:SS" in message and "\n" not in message


def test_time_range_still_checked():
    with pytest.raises(ConfigError, match=r"slurm.time: 0 is below the minimum 1"):
        load_config(None, ["slurm.time=0:00"])
    with pytest.raises(ConfigError, match=r"slurm.time: 527040 is above the maximum 525600"):
        load_config(None, ["slurm.time=366-00:00:00"])


def test_leading_zero_is_decimal_in_set_and_file(tmp_path):
    assert load_config(None, ["parallelism.dp=010"]).parallelism.dp == 10
    path = tmp_path / "c.yaml"
    path.write_text("parallelism:\n  dp: 010\nslurm:\n  time: 1:30:00\n")
    config = load_config(path)
    assert config.parallelism.dp == 10 and config.slurm.time == 90
    assert load_config(None, ["parallelism.dp=0x10"]).parallelism.dp == 16
    assert load_config(None, ["parallelism.dp=0o10"]).parallelism.dp == 8


@pytest.mark.parametrize("written", ["010", "0x1F", "0o17", "+1", "1e3", ".5", "1.50"])
def test_a_number_in_a_string_field_keeps_its_text(written, tmp_path):
    """YAML reads these as numbers; a string field must hold what the user wrote, not str(number)."""
    assert load_config(None, [f"slurm.partition={written}"]).slurm.partition == written
    path = tmp_path / "c.yaml"
    path.write_text(f"slurm:\n  partition: {written}\n  env:\n    NCCL_X: {written}\n")
    config = load_config(path)
    assert config.slurm.partition == written and config.slurm.env["NCCL_X"] == written


def test_an_error_line_escapes_what_a_terminal_would_not_show():
    from nanotrain.config.cli_args import one_line

    assert one_line("a\u200bb\nc\x9bd") == "a\\u200bb; c\\x9bd"


def test_float_exponent_without_dot():
    assert load_config(None, ["optimizer.lr=3e-4"]).optimizer.lr == pytest.approx(3e-4)


@pytest.mark.parametrize("given", ["0b11", "1_000", "1:30"])
def test_yaml11_only_integers_are_refused(given):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"parallelism.dp={given}"])
    assert str(info.value).startswith("parallelism.dp: expected an integer") and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "char", ["\x85", "\x9b", "\u202e", "\u2066", "\u200f", "\u061c", "\u2028", "\u2029", "\u200b", "\ufeff", "\xad"]
)  # the last three: format (Cf), invisible
@pytest.mark.parametrize("field", ["logging.run_name", "slurm.partition"])
def test_unicode_controls_refused_with_field_and_escape(field, char, tmp_path):
    path = tmp_path / "c.yaml"
    section, key = field.split(".")
    path.write_text(f'{section}:\n  {key}: "ab{char.encode("unicode_escape").decode()}cd"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert message.startswith(f"{field}: contains '\\") and "at position 2" in message
    assert char not in message


def test_unknown_key_is_echoed_escaped():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["logging.x\u202eevil=1"])
    assert "\u202e" not in str(info.value) and "\\u202e" in str(info.value)
    path_value = {"logging": {"bad\x85key": 1}}
    from nanotrain.config.loader import config_from_dict

    with pytest.raises(ConfigError) as info:
        config_from_dict(path_value)
    assert "\x85" not in str(info.value) and "\\x85" in str(info.value)


def test_sbatch_values_refuse_bidi(capsys):
    assert main(["configs/tiny_cpu.yaml", "--dry-run", "--set", 'slurm.env={A: "x\u202ey"}']) == 2
    assert "slurm.env" in capsys.readouterr().err


def test_shipped_config_dry_run_still_passes(capsys):
    assert main(["configs/tiny_cpu.yaml", "--dry-run", "--set", "slurm.time=1:30:00"]) == 0
    assert "error" not in capsys.readouterr().err


def test_validate_names_refuses_bidi_in_a_config_built_in_code():
    from nanotrain.config.schema import Config
    from nanotrain.config.validate import validate_names

    config = Config()
    config.slurm.setup = ["module load x\u2066y"]
    with pytest.raises(ConfigError) as info:
        validate_names(config)
    assert str(info.value).startswith("slurm.setup[0]:") and "'\\u2066' at position 13" in str(info.value)


@pytest.mark.parametrize(
    "argv",
    [
        ["configs/tiny_cpu.yaml", "--emit", ""],
        ["configs/tiny_cpu.yaml", "--emit", " "],
        ["--status", ""],
        ["--resume", ""],
        [""],
    ],
)
def test_an_empty_path_argument_is_refused_before_anything(argv, capsys, monkeypatch):
    """`--emit $UNSET` once fell through to a real submission."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "empty path" in err
