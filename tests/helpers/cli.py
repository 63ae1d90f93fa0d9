"""``submit.py``'s command line called in-process (``nanotrain.commands.cli.main``), its output captured."""

from __future__ import annotations

from nanotrain.commands.cli import main


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of ``main(argv)``; ``capsys`` is pytest's fixture."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def dry_run_error_line(config, sets, tmp_path, capsys) -> str:
    """The one ``error:`` line (exit 2) of ``submit.py CONFIG --dry-run`` with the ``--set``
    assignments ``sets`` (asserted: exactly one line, nothing else on stderr)."""
    argv = [config, "--dry-run", "--set", f"logging.dir={tmp_path}"]
    for s in sets:
        argv += ["--set", s]
    code, _, err = run_cli(argv, capsys)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]
