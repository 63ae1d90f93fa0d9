"""Pipeline schedules as plain lists of actions, one list per pp rank.

An action is F (forward) or B (backward) of one micro-batch through one of this rank's model
chunks. The engine executes the list in order and derives every send and receive from it, so a
schedule is only this ordering, and where it communicates (``schedule_steps``): it can be read,
printed, tested and simulated without processes.

* ``afab`` (GPipe): all m forwards, then all m backwards. Holds the activations of all m
  micro-batches at once.
* ``1f1b`` (PipeDream-flush, nanotron/Megatron): ``pp - rank - 1`` warm-up forwards, then
  alternate one forward and one backward, then the remaining backwards. Rank r never holds more
  than ``pp - r`` micro-batches' activations, whatever m; same bubble as afab,
  (p - 1) / (m + p - 1).
* ``interleaved_1f1b`` (Megatron): each rank holds v chunks (virtual stages r, r + pp, ...);
  micro-batches go through the chunks in groups of pp, so the pipeline fills v times faster and
  the bubble shrinks to (p - 1) / (v * m + p - 1), at the price of v times more messages. Needs
  m to be a multiple of pp.
"""

from __future__ import annotations

from typing import Callable, NamedTuple


class Action(NamedTuple):
    op: str  # "F" or "B"
    chunk: int  # index of the model chunk on this rank
    microbatch: int


def afab(pp: int, rank: int, m: int, v: int = 1) -> list[Action]:
    _check(pp, rank, m, v, chunks=1)
    return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]


def one_f_one_b(pp: int, rank: int, m: int, v: int = 1) -> list[Action]:
    _check(pp, rank, m, v, chunks=1)
    warmup = min(pp - rank - 1, m)
    actions = [Action("F", 0, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions += [Action("F", 0, warmup + i), Action("B", 0, i)]
    return actions + [Action("B", 0, i) for i in range(m - warmup, m)]


def interleaved_1f1b(pp: int, rank: int, m: int, v: int) -> list[Action]:
    """Megatron's ``forward_backward_pipelining_with_interleaving`` ordering."""
    return [a for step in interleaved_1f1b_steps(pp, rank, m, v) for a in step]


def interleaved_1f1b_steps(pp: int, rank: int, m: int, v: int) -> list[tuple[Action, ...]]:
    """The interleaved ordering cut at its communication points, as Megatron communicates: a
    warm-up forward or a cool-down backward alone, and each steady-state (forward, backward)
    pair as one step, whose outputs (both directions) go out in the same batch as the inputs of
    the next pair. Exchanging between the two actions of a pair, as 1f1b does, deadlocks on
    NCCL: two neighbours then each run a batch holding only a send, whose receive the other
    posts in its next batch (``test_pipeline_nccl_semantics.py`` keeps that as a control)."""
    _check(pp, rank, m, v)
    if m % pp:
        raise ValueError(f"interleaved_1f1b needs the micro-batch count ({m}) to be a multiple of pp ({pp})")
    total = m * v
    if m == pp:  # one group of micro-batches: Megatron runs every forward first
        warmup = total
    else:
        warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)

    def action(op: str, k: int) -> Action:
        chunk = (k % (pp * v)) // pp
        return Action(op, chunk if op == "F" else v - 1 - chunk, (k // (pp * v)) * pp + k % pp)

    steps: list[tuple[Action, ...]] = [(action("F", k),) for k in range(warmup)]
    steps += [(action("F", warmup + k), action("B", k)) for k in range(total - warmup)]
    return steps + [(action("B", k),) for k in range(total - warmup, total)]


SCHEDULES: dict[str, Callable[[int, int, int, int], list[Action]]] = {
    "afab": afab,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
}


def get_schedule(name: str) -> Callable[[int, int, int, int], list[Action]]:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pp_engine {name!r}; expected one of {sorted(SCHEDULES)}")
    return SCHEDULES[name]


def schedule_steps(name: str, pp: int, rank: int, m: int, v: int = 1) -> list[tuple[Action, ...]]:
    """A rank's actions grouped by communication point: the engine exchanges messages only
    between steps, each time in one batch (see ``engine.py``). afab and 1f1b communicate around
    every action (Megatron's ``send_forward_recv_backward`` pairing); interleaved 1f1b around
    each steady-state pair (``interleaved_1f1b_steps``)."""
    if name == "interleaved_1f1b":
        return interleaved_1f1b_steps(pp, rank, m, v)
    return [(a,) for a in get_schedule(name)(pp, rank, m, v)]


def theoretical_bubble(name: str, pp: int, m: int, v: int = 1) -> float:
    """Idle fraction of each stage with equal-cost stages and free communication."""
    chunks = v if name == "interleaved_1f1b" else 1
    return (pp - 1) / (chunks * m + pp - 1)


def _check(pp: int, rank: int, m: int, v: int, chunks: int | None = None) -> None:
    if not (pp >= 1 and 0 <= rank < pp and m >= 1 and v >= 1):
        raise ValueError(f"bad schedule arguments pp={pp} rank={rank} m={m} v={v}")
    if chunks is not None and v != chunks:
        raise ValueError(
            f"this schedule runs one model chunk per rank, got {v} "
            "(pp_virtual_stages > 1 needs pp_engine: interleaved_1f1b)"
        )
