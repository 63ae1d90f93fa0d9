#!/usr/bin/env python
"""Rewrite a nanotrain checkpoint for another topology, offline (one process, no GPUs).

    python scripts/reshard_checkpoint.py SRC DST --set parallelism.tp=4 [--set parallelism.dp=2 ...]

SRC: a checkpoint directory (``.../checkpoints/step_000120``) or a checkpoints root (its ``latest``).
DST: a checkpoints root; ``DST/step_000120`` and ``DST/latest`` are written with the same atomic
commit as a training run's save. ``--set`` takes the config overrides of ``submit.py``, applied to
the config stored in the checkpoint (parallelism.*, optimizer.zero_stage).

Not required for resuming: ``load_checkpoint`` reshards online when the topology changed. This is
for preparing a checkpoint once (e.g. for a different cluster) and for inspecting the result.
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint import CheckpointError  # noqa: E402
from nanotrain.checkpoint.reshard import reshard_offline  # noqa: E402
from nanotrain.config import ConfigError  # noqa: E402
from nanotrain.config.paths import CREATE_DIR, DIR, check_path  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory, or a checkpoints root")
    parser.add_argument("dst", help="checkpoints root to write into")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. parallelism.tp=4 (repeatable)")
    parser.add_argument("--granularity", choices=("rank", "param"), default="rank",
                        help="one file per rank (default) or per parameter")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        check_path("SRC", args.src, DIR, CheckpointError)
        check_path("DST", args.dst, CREATE_DIR, CheckpointError)
        out = reshard_offline(args.src, args.dst, args.overrides, args.granularity)
    except (CheckpointError, ConfigError) as e:
        print(f"error: {e}", file=sys.stderr)  # submit.py's promise: one error: line, exit 2
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
