#!/usr/bin/env python
"""Rewrite a nanotrain checkpoint for another topology, offline (one process, no GPUs).

    python scripts/reshard_checkpoint.py SRC DST --set parallelism.tp=4 [--set parallelism.dp=2 ...]

SRC: a checkpoint directory (``.../checkpoints/step_000120``) or a checkpoints root (its ``latest``).
DST: a checkpoints root apart from SRC (not SRC, not inside it, not holding it); ``DST/step_000120``
and ``DST/latest`` are written with the same atomic commit as a training run's save. ``--set`` takes
the config overrides of ``submit.py``, applied to the config stored in the checkpoint
(parallelism.*, optimizer.zero_stage); the target is validated as a launch would validate it.
A wrong input is one ``error:`` line and exit status 2, before anything is written.

Not required for resuming: ``load_checkpoint`` reshards online when the topology changed. This is
for preparing a checkpoint once (e.g. for a different cluster) and for inspecting the result.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.checkpoint.layout import CheckpointError  # noqa: E402
from nanotrain.checkpoint.offline_checks import plan_reshard  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``; module doc); returns 0, or 2 for a wrong
    argument or input (one ``error:`` line on stderr, nothing written), 130 on Ctrl-C."""
    return answer(lambda: _main(argv), CheckpointError, OSError)


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", help="checkpoint directory, or a checkpoints root")
    parser.add_argument("dst", help="checkpoints root to write into (apart from SRC)")
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override, e.g. parallelism.tp=4 (repeatable)",
    )
    parser.add_argument(
        "--granularity", choices=("rank", "param"), default="rank", help="one file per rank (default) or per parameter"
    )
    args = parser.parse_args(argv)
    plan_reshard(args.src, args.dst, args.overrides)  # every check that needs no torch, first
    # Imported only now: the tensor code costs seconds of torch import, which a wrong argument
    # must not wait for (reshard_offline repeats the checks above: they read meta.json only).
    from nanotrain.checkpoint.reshard import reshard_offline

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(reshard_offline(args.src, args.dst, args.overrides, args.granularity))
    return 0


if __name__ == "__main__":
    sys.exit(main())
