"""``submit.py``'s command line called in-process (``nanotrain.commands.cli.main``), its output captured."""

from __future__ import annotations

from nanotrain.commands.cli import main


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of ``main(argv)``; ``capsys`` is pytest's fixture."""
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err
