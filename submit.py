#!/usr/bin/env python3
"""Thin entry point: `python submit.py CONFIG [--dry-run] [--emit DIR] [--local] [--set k=v ...]`."""
import sys

from nanotrain.launch.cli import main

if __name__ == "__main__":
    sys.exit(main())
