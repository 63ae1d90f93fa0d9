"""The command-line promise of every nanotrain entry point (``submit.py`` and ``scripts/*.py``):
a wrong argument is answered with ONE line on stderr starting ``error:``, exit status 2, never
argparse's multi-line usage dump, another prefix, another status or a traceback.

Standard library and ``nanotrain.config`` only (no torch), so that a script parses and checks
its command line in a fraction of a second, before it imports anything heavy.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

from nanotrain.config.loader import ConfigError
from nanotrain.config.text import escaped

EXIT_USER_ERROR = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for Ctrl-C


class ArgParser(argparse.ArgumentParser):
    """argparse, but a bad command line raises ``ConfigError`` (one line, ``(see --help)``)
    instead of printing the usage and exiting; ``--help`` still prints and exits 0."""

    def error(self, message: str):
        raise ConfigError(f"{message} (see --help)")


def one_line(message: object) -> str:
    """``message`` as a single printable line: a multi-line one (several problems) joined with
    ``; ``, and any character a terminal would not show as itself (a control, a format or
    private-use character, a lone surrogate: what a user's value may have carried into the
    message) written as its escape, ``\\u200b``."""
    return "; ".join(escaped(part.strip()) for part in str(message).splitlines() if part.strip())


def refuse(message: object) -> int:
    """Print ``error: MESSAGE`` (one line) on stderr; returns the exit status 2 to return."""
    print(f"error: {one_line(message)}", file=sys.stderr)
    return EXIT_USER_ERROR


def answer(main: Callable[[], int], *errors: type[BaseException]) -> int:
    """Run ``main()``; a ``ConfigError`` (which a bad command line raises) or one of ``errors``
    (the script's user errors, e.g. ``CheckpointError``) becomes one ``error:`` line and exit 2;
    Ctrl-C is one ``interrupted`` line and exit 130, not a traceback (whatever ``main`` was
    writing, it removes itself as the interrupt passes: see ``files.removed_on_failure``)."""
    try:
        return main()
    except (ConfigError, *errors) as exc:
        return refuse(exc)
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def non_negative_int(text: str) -> int:
    """argparse ``type=`` for a count: an integer >= 0 (its refusal is a one-line parser error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value
