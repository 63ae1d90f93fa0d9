"""Which node each rank runs on: SLURM's node name, not the host name.

Why not ``socket.gethostname()``: SLURM's node names are what ``--exclude`` and ``ExcNodeList``
take, and hosts may share a host name (several slurmd on one machine, as on the local test
cluster, where n1 and n2 are one host; containers with a fixed host name). ``SLURMD_NODENAME`` is
set by slurmd in every task; elsewhere (local runs, torchrun) the host name stands in.

``NODES`` is the process-wide map rank -> node, filled by the start-up health check (one
all-gather) and read by the straggler watch (``logging/stragglers.py``) to name a straggler's
node. Standard library only.
"""

from __future__ import annotations

import os
import socket
from typing import Mapping, Optional


def node_name(environ: Mapping[str, str] | None = None) -> str:
    """This process's node: SLURMD_NODENAME, else the host name."""
    environ = os.environ if environ is None else environ
    return environ.get("SLURMD_NODENAME") or socket.gethostname()


class NodeMap:
    """``of_rank[r]``: the node of global rank r, once known (None before)."""

    def __init__(self) -> None:
        self.of_rank: Optional[list[str]] = None

    def set(self, nodes: list[str]) -> None:
        self.of_rank = list(nodes)

    def get(self, rank: int) -> Optional[str]:
        return self.of_rank[rank] if self.of_rank is not None and 0 <= rank < len(self.of_rank) else None


NODES = NodeMap()
