"""The command's first lines (`submit.py`, the `nanotrain` console script): hold stop signals.

A stop signal (SIGUSR1/2, SIGTERM) during start-up would kill a launch:
importing the CLI takes a good part of a second (submitit, YAML), a local run's ranks take
seconds to import torch. So the signals are blocked before anything is imported; they stay
pending until a local run's ranks exist (`local.run_local` unblocks after it installed its
forwarding handlers, and the ranks inherit the mask until their own handler exists), or until
any other command is done. While the command checks, writes or submits, the CLI lets SIGTERM
through to end it with one line (`stopping.py`; a pending one at once), and holds it again
before a local run starts its ranks. The CLI is imported inside `main` on purpose: after the block.
"""

from __future__ import annotations

from nanotrain.runtime.preemption import block_stop_signals, unblock_stop_signals


def main(argv: list[str] | None = None) -> int:
    """``submit.py``'s and the ``nanotrain`` console script's entry: ``cli.main(argv)`` with the
    stop signals held from before its import (module doc); returns its exit status."""
    block_stop_signals()
    try:
        from nanotrain.commands.cli import main as cli_main

        return cli_main(argv)
    finally:
        unblock_stop_signals()
