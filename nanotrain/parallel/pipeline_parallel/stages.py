"""Which blocks of a model each pipeline rank holds, and cutting a built model down to them.

A model is a sequence of named blocks (an embedding, decoder layers, a head), each with a cost.
``place_stages`` cuts that sequence into ``pp * virtual_stages`` contiguous virtual stages that
balance the cost, exactly (``parallel/stage_split.py``: the most expensive stage is as cheap as
any split allows, and among those the most even split is taken). A block declared with
``attach="next"`` / ``"prev"`` (an embedding, a final norm, an LM head) is glued to its neighbour,
so e.g. a large LM head pushes layers off the last stage.

Placement (Megatron's interleaving): virtual stage ``s`` lives on pp rank ``s % pp`` as that
rank's model chunk ``s // pp``, so with ``v`` virtual stages per rank, rank r holds chunks
r, r + pp, ... With v = 1 this is the plain split: stage r on rank r.

``keep_blocks_`` then removes from a (meta) model every block another rank holds: a decoder
layer leaves its ``ModuleDict``, a top-level block becomes None. Names do not change
(``layers.7.attn.qkv.weight`` on whichever rank holds layer 7).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from torch import nn

from nanotrain.parallel.stage_split import Attach, split_stages


@dataclass(frozen=True, eq=False)
class ModelChunk:
    """The blocks of one virtual stage held by this rank, in model order."""

    virtual_stage: int
    num_virtual_stages: int
    blocks: tuple[str, ...]

    @property
    def is_first(self) -> bool:  # takes the data (token ids)
        return self.virtual_stage == 0

    @property
    def is_last(self) -> bool:  # produces the loss
        return self.virtual_stage == self.num_virtual_stages - 1

    def __contains__(self, block: object) -> bool:
        return block in self.blocks


def place_stages(
    names: Sequence[str],
    costs: Sequence[int],
    attaches: Sequence[Attach],
    pp_rank: int,
    pp_size: int,
    virtual_stages: int = 1,
) -> tuple[ModelChunk, ...]:
    """This rank's model chunks (chunk c = virtual stage c * pp + pp_rank) of the blocks
    ``names`` with their ``costs`` and ``attaches``."""
    virtual_stages = virtual_stages if pp_size > 1 else 1
    num_stages = pp_size * virtual_stages
    stages = split_stages(list(costs), list(attaches), pp_size, virtual_stages)
    return tuple(
        ModelChunk(s, num_stages, tuple(names[i] for i in stages[s])) for s in range(pp_rank, num_stages, pp_size)
    )


def keep_blocks_(model: nn.Module, blocks: Iterable[str], held: Iterable[str]) -> None:
    """Remove, in place, each of ``blocks`` (module paths: ``embed``, ``layers.3``) not in ``held``."""
    held = set(held)
    for path in blocks:
        if path in held:
            continue
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path)
        if isinstance(parent, nn.ModuleDict):
            del parent[name]
        else:
            setattr(parent, name, None)
