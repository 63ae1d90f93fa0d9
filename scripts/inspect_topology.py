#!/usr/bin/env python3
"""Print every process group of a config's rank grid, without launching a single process.

    python scripts/inspect_topology.py configs/3d_16gpu.yaml
    python scripts/inspect_topology.py configs/3d_16gpu.yaml --rank 5      # one rank's view
    python scripts/inspect_topology.py configs/tiny_cpu.yaml --set parallelism.tp=4 --set parallelism.dp=1

This is the "validate your setup" step of nanotron's README done offline: the grid is pure
arithmetic (nanotrain.parallel.grid), identical to what ParallelContext builds at run time.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nanotrain.config import ConfigError, load_config, validate  # noqa: E402
from nanotrain.config.cli_args import ArgParser, answer  # noqa: E402
from nanotrain.parallel.grid import RankGrid  # noqa: E402

GROUPS = ("tp", "cp", "dp", "pp", "ep", "dp_cp", "mp")


def main(argv: list[str] | None = None) -> int:
    """The command on ``argv`` (default ``sys.argv[1:]``; module doc); returns 0, or 2 for a wrong
    argument or an invalid config (one ``error:`` line on stderr)."""
    return answer(lambda: _main(argv))


def _main(argv: list[str] | None) -> int:
    parser = ArgParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    parser.add_argument("--rank", type=int, help="show only the groups and coordinates of this rank")
    args = parser.parse_args(argv)
    config = load_config(args.config, args.set)
    validate(config)
    p = config.parallelism
    grid = RankGrid(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, ep=p.ep)
    if args.rank is not None:
        if not 0 <= args.rank < grid.world_size:
            raise ConfigError(
                f"--rank {args.rank} is outside the world of {grid.world_size} ranks: give 0 to {grid.world_size - 1}"
            )
        print(f"rank {args.rank}: {grid.coords(args.rank)._asdict()}")
        for name in GROUPS:
            print(f"  {name:>5}_pg: {list(grid.group_of(name, args.rank))}")
        return 0
    print(grid.summary(max_world_for_groups=0))
    for name in GROUPS:
        print(f"\n{name} groups:")
        for group in grid.groups(name):
            print(f"  {list(group)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
