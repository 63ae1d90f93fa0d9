#!/usr/bin/env python3
"""Thin entry point: `python submit.py CONFIG [--dry-run] [--emit DIR] [--local] [--set k=v ...]`."""

import sys

from nanotrain.commands.entry import main  # standard library only: stop signals are held first

if __name__ == "__main__":
    sys.exit(main())
