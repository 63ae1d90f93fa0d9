"""The pipeline stage split as pure arithmetic (no torch), so that code which only plans — the
model's parameter count per stage (``models/llama_arch.py``), the ``--dry-run`` memory estimate —
computes exactly the split ``place_stages`` makes, without importing torch or building a model.

It lives beside ``grid.py`` rather than in ``pipeline_parallel/`` because importing anything from
that package imports torch (its ``__init__`` exports the engine and P2P).
"""

from __future__ import annotations

import functools
from typing import Literal, Optional, Sequence

Attach = Optional[Literal["next", "prev"]]


def balanced_split(costs: Sequence[int], parts: int) -> list[int]:
    """Sizes of the contiguous, non-empty groups of ``costs`` that minimise the largest group sum.

    Exact and on integers (identical on every rank). Among the splits with that optimum it takes
    the most even one (least sum of squared group costs), so spare capacity is spread out rather
    than dumped on one stage; remaining ties go to the earliest cut.

    The optimum largest group is found by bisection (a greedy packing says whether a bound
    fits); the most even split is a dynamic programme that only visits cuts which keep every
    group within that bound and leave the rest splittable within it. Any other cut cannot lie on
    an optimal split, so the answer is the full programme's, but the work is near
    ``parts * n * (n / parts)`` instead of ``parts * n**2``: a plan of a deep model stays fast.
    """
    n = len(costs)
    if not 1 <= parts <= n:
        raise ValueError(f"cannot split {n} pipeline units into {parts} non-empty stages")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + int(c))
    cap = _smallest_largest(prefix, parts)
    total = prefix[n]
    inf = float("inf")
    # best[k][i]: least sum of squares splitting the first i units into k groups; cut[k][i]: last cut.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        prev, row, cuts, room = best[k - 1], best[k], cut[k], (parts - k) * cap
        low = 0  # the first j whose group (j, i] is within cap: it only moves right as i grows
        for i in range(k, n - (parts - k) + 1):
            if prefix[i] > k * cap or total - prefix[i] > room:
                continue  # no split of the first i into k groups, or of the rest, fits the cap
            while prefix[i] - prefix[low] > cap:
                low += 1
            for j in range(max(k - 1, low), i):
                if prev[j] == inf:
                    continue
                group = prefix[i] - prefix[j]
                value = prev[j] + group * group
                if value < row[i]:
                    row[i], cuts[i] = value, j
    sizes, i = [], n
    for k in range(parts, 0, -1):
        sizes.append(i - cut[k][i])
        i = cut[k][i]
    return sizes[::-1]


def _smallest_largest(prefix: list[int], parts: int) -> int:
    """The least bound on a group's sum for which ``parts`` contiguous non-empty groups exist."""
    n = len(prefix) - 1
    lo = max(prefix[i + 1] - prefix[i] for i in range(n))
    hi = prefix[n]
    while lo < hi:
        mid = (lo + hi) // 2
        groups, start = 1, 0
        for i in range(1, n + 1):
            if prefix[i] - prefix[start] > mid:
                groups, start = groups + 1, i - 1
        if groups <= parts:  # fewer groups can always be split further: n >= parts
            hi = mid
        else:
            lo = mid + 1
    return lo


def _units(attach: Sequence[Attach]) -> list[list[int]]:
    """Group block indices so that attached blocks share a unit with their neighbour."""
    units: list[list[int]] = []
    glue_next = False
    for i, how in enumerate(attach):
        if units and (glue_next or how == "prev"):
            units[-1].append(i)
        else:
            units.append([i])
        glue_next = how == "next"
    return units


def split_stages(
    costs: Sequence[int], attach: Sequence[Attach], pp_size: int, virtual_stages: int = 1
) -> list[list[int]]:
    """The block indices of each of the ``pp_size * virtual_stages`` contiguous virtual stages of
    balanced cost; a block with ``attach`` ``"next"`` / ``"prev"`` always shares its neighbour's
    stage. Virtual stage ``s`` is pp rank ``s % pp_size``'s chunk ``s // pp_size``. Memoised:
    ``--plan`` asks for the same split of one model for every candidate layout."""
    return [list(stage) for stage in _split(tuple(int(c) for c in costs), tuple(attach), pp_size, virtual_stages)]


@functools.lru_cache(maxsize=256)
def _split(costs: tuple, attach: tuple, pp_size: int, virtual_stages: int) -> tuple:
    num_stages = pp_size * virtual_stages
    units = _units(attach)
    if len(units) < num_stages:
        raise ValueError(
            f"{len(units)} pipeline units (layers) cannot fill pp*virtual_stages = "
            f"{pp_size}*{virtual_stages} stages: every stage needs at least one"
        )
    sizes = balanced_split([sum(costs[i] for i in unit) for unit in units], num_stages)
    stages, start = [], 0
    for size in sizes:
        stages.append(tuple(i for unit in units[start : start + size] for i in unit))
        start += size
    return tuple(stages)
