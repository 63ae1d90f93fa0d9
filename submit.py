#!/usr/bin/env python3
"""Thin entry point: `python submit.py CONFIG [--dry-run] [--emit DIR] [--local] [--set k=v ...]`."""
import sys

from nanotrain.launch.preemption import block_stop_signals, unblock_stop_signals  # standard library only

if __name__ == "__main__":
    # A stop signal (SIGUSR1/2, SIGTERM) during start-up must not kill a launch: it stays pending
    # until a local run's ranks exist (then they get it), or until the command is done.
    block_stop_signals()
    from nanotrain.launch.cli import main

    try:
        status = main()
    finally:
        unblock_stop_signals()
    sys.exit(status)
