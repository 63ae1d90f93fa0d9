"""Rank-grid arithmetic for 5D parallelism, with no torch and no numpy (so the launcher,
``--dry-run`` and the checkpoint tools check any layout offline; ``ParallelContext`` is a thin layer
over it).

The world is laid out as in nanotron, ``arange(world).reshape(ep, pp, dp, cp, tp)``: TP varies
fastest (neighbouring ranks share a node and its fast links), then CP, DP, PP, EP::

    rank = (((ep * PP + pp) * DP + dp) * CP + cp) * TP + tp

Group names (``RankGrid.groups(axis)``):

* ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``, ``"ep"``: ranks that differ only along that axis;
* any ``"_"``-joined set of axes: ranks that differ only along those, e.g. ``"dp_cp"`` (gradient
  sync: every CP rank holds a full replica of its TP/PP shard) and ``"tp_ep"`` (nanotron's
  ``tp_and_ep_pg``);
* ``"mp"``: the ranks sharing one (dp, cp) coordinate (ep x pp x tp), which together hold exactly
  one copy of the model (global grad norm, parameter counts);
* ``"world"``: every rank.

Groups are listed in order of their lowest rank, each group's ranks ascending: the order
``torch.distributed.new_group`` uses, so a rank's index in its group tuple is its group rank.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import NamedTuple

AXES = ("ep", "pp", "dp", "cp", "tp")  # slowest -> fastest
_ALIASES = {"mp": ("ep", "pp", "tp"), "world": AXES}
_FULL_NAMES = {
    "tp": "tensor",
    "cp": "context",
    "dp": "data",
    "pp": "pipeline",
    "ep": "expert",
}


class Coords(NamedTuple):
    """One rank's position in the grid. Use ``._asdict()`` for a dict keyed by axis."""

    ep: int
    pp: int
    dp: int
    cp: int
    tp: int


@dataclass(frozen=True)
class RankGrid:
    """The (ep, pp, dp, cp, tp) grid; fields are the sizes of each axis."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for ax in AXES:
            size = getattr(self, ax)
            if isinstance(size, bool) or not isinstance(size, int) or size < 1:
                raise ValueError(f"{_FULL_NAMES[ax]} parallel size ({ax}) must be an integer >= 1, got {size!r}")

    @classmethod
    def of(cls, parallelism) -> "RankGrid":
        """The grid of a config's ``parallelism`` section (its tp, cp, dp, pp, ep)."""
        p = parallelism
        return cls(tp=p.tp, cp=p.cp, dp=p.dp, pp=p.pp, ep=p.ep)

    # ------------------------------------------------------------------ basic maps
    @property
    def sizes(self) -> Coords:
        return Coords(self.ep, self.pp, self.dp, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return self.ep * self.pp * self.dp * self.cp * self.tp

    @property
    def strides(self) -> Coords:
        """How far apart (in global rank) two ranks one step apart along each axis are."""
        tp_s = 1
        cp_s = self.tp
        dp_s = cp_s * self.cp
        pp_s = dp_s * self.dp
        ep_s = pp_s * self.pp
        return Coords(ep_s, pp_s, dp_s, cp_s, tp_s)

    def _check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be an integer in [0, {self.world_size}), got {rank!r}")

    def coords(self, rank: int) -> Coords:
        """Grid coordinates of a global rank."""
        rank = _as_int(rank)
        self._check_rank(rank)
        rank, tp = divmod(rank, self.tp)
        rank, cp = divmod(rank, self.cp)
        rank, dp = divmod(rank, self.dp)
        ep, pp = divmod(rank, self.pp)
        return Coords(ep, pp, dp, cp, tp)

    def rank(self, *, ep: int = 0, pp: int = 0, dp: int = 0, cp: int = 0, tp: int = 0) -> int:
        """Global rank at the given coordinates (omitted axes default to 0)."""
        values = {"ep": ep, "pp": pp, "dp": dp, "cp": cp, "tp": tp}
        out = 0
        for ax in AXES:
            v, size = _as_int(values[ax]), getattr(self, ax)
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < size:
                raise ValueError(f"{ax} coordinate must be an integer in [0, {size}), got {v!r}")
            out = out * size + v
        return out

    # ------------------------------------------------------------------ groups
    @staticmethod
    def axes_of(axis: str) -> tuple[str, ...]:
        """The grid axes spanned by a group name, slowest first (``"dp_cp"`` -> ``("dp", "cp")``)."""
        if axis in _ALIASES:
            return _ALIASES[axis]
        parts = axis.split("_") if isinstance(axis, str) else []
        if not parts or any(p not in AXES for p in parts) or len(set(parts)) != len(parts):
            raise ValueError(
                f"unknown group {axis!r}; use one of {list(AXES)}, 'mp', 'world', or '_'-joined axes such as 'dp_cp'"
            )
        return tuple(ax for ax in AXES if ax in parts)

    def _offsets(self, axes: tuple[str, ...]) -> list[int]:
        """Rank offsets of a group's members from its lowest member, ascending."""
        strides = self.strides._asdict()
        ranges = [range(0, getattr(self, ax) * strides[ax], strides[ax]) for ax in axes]
        return [sum(p) for p in itertools.product(*ranges)]

    def groups(self, axis: str) -> list[tuple[int, ...]]:
        """Every group along ``axis``: a partition of the world, ordered by lowest rank."""
        axes = self.axes_of(axis)
        offsets = self._offsets(axes)
        strides = self.strides._asdict()
        other = [ax for ax in AXES if ax not in axes]
        base_ranges = [range(0, getattr(self, ax) * strides[ax], strides[ax]) for ax in other]
        bases = sorted(sum(p) for p in itertools.product(*base_ranges))
        return [tuple(b + o for o in offsets) for b in bases]

    def group_of(self, axis: str, rank: int) -> tuple[int, ...]:
        """The group along ``axis`` that contains ``rank`` (O(group size), no full enumeration)."""
        axes = self.axes_of(axis)
        c = self.coords(rank)._asdict()
        strides = self.strides._asdict()
        base = _as_int(rank) - sum(c[ax] * strides[ax] for ax in axes)
        return tuple(base + o for o in self._offsets(axes))

    # ------------------------------------------------------------------ display
    def summary(self, max_world_for_groups: int = 64) -> str:
        """Human-readable layout; lists every group when the world is small enough to read."""
        lines = [
            f"RankGrid: world={self.world_size} = ep{self.ep} x pp{self.pp} x dp{self.dp} "
            f"x cp{self.cp} x tp{self.tp} (order ep, pp, dp, cp, tp; tp fastest)"
        ]
        names = list(reversed(AXES)) + ["dp_cp", "mp"]
        for name in names:
            n_groups = self.world_size // len(self.group_of(name, 0))
            lines.append(f"  {name:>5}: {n_groups} groups of {self.world_size // n_groups}")
            if self.world_size <= max_world_for_groups:
                lines.append("         " + " ".join(_fmt(g) for g in self.groups(name)))
        return "\n".join(lines)


def _fmt(group: tuple[int, ...]) -> str:
    return "[" + ",".join(map(str, group)) + "]"


def _as_int(v):
    """Accept numpy/torch integer scalars (they have ``__index__``) without importing them."""
    if isinstance(v, int) or not hasattr(v, "__index__"):
        return v
    return v.__index__()


class GroupShape:
    """A process group's shape without processes: what the tp layers and the model ask of a
    group when they are built (``size()`` and this rank's ``rank()``). Checkpoint skeletons and
    in-process tests build the model of any rank of any layout with it."""

    def __init__(self, size: int, rank: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank
