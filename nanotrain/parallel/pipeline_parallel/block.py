"""PipelineBlock: a piece of the model declared on every pipeline rank and built only on its owner.

The model code declares every block on every rank (so each rank knows the whole model: the order,
the names and the cost of each piece) without building any. ``place_blocks`` then cuts the block
sequence into ``pp * virtual_stages`` contiguous virtual stages that balance the cost, and each rank
builds only the blocks of its own stages. A block that is not built here holds no parameters, and
calling it returns a ``TensorPointer`` to the rank that owns it: it never computes on the wrong rank.

Placement (Megatron's interleaving): virtual stage ``s`` lives on pp rank ``s % pp`` as that rank's
model chunk ``s // pp``, so with ``v`` virtual stages per rank, rank r holds chunks r, r + pp, ...
With v = 1 this is the plain split: stage r on rank r.

Cost. Every block carries a cost (forward FLOPs per token is what ``LlamaModel`` uses); the
partition minimises the cost of the most expensive stage, exactly (dynamic programming over the
contiguous splits, ``parallel/stage_split.py``), and among those takes the most even split. A
block declared with ``attach="next"`` / ``"prev"`` (an embedding, a final norm, an LM head) is
never alone in a stage: it is glued to its neighbour, and its cost is counted in that neighbour's
stage, so e.g. a large LM head pushes layers off the last stage.

Names. A built block adopts the parameters and submodules of the module it stands for, so a
parameter has the same name on any stage and at any pp as in the single-process model
(``layers.7.attn.qkv.weight``, not ``layers.7.pp_block.attn.qkv.weight``): checkpoints, seeded
initialisation and tests compare by these names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from torch import nn

from nanotrain.parallel.pipeline_parallel.tensor_pointer import TensorPointer
from nanotrain.parallel.stage_split import Attach, split_stages


class PipelineBlock(nn.Module):
    """``builder()`` makes the module; it is called only on the pp rank that owns the block."""

    def __init__(self, builder: Callable[[], nn.Module], cost: int, attach: Attach = None):
        super().__init__()
        self.builder, self.cost, self.attach = builder, int(cost), attach
        self.rank: Optional[int] = None  # owning pp rank, set by place_blocks
        self.virtual_stage: Optional[int] = None
        object.__setattr__(self, "_built", None)  # not a registered child (its parts are adopted)

    @property
    def is_built(self) -> bool:
        return self._built is not None

    @property
    def module(self) -> Optional[nn.Module]:
        return self._built

    def set_rank(self, rank: int, virtual_stage: int, my_rank: int) -> None:
        """Record the owner; build here if this rank is it."""
        self.rank, self.virtual_stage = rank, virtual_stage
        if rank == my_rank:
            self.build()

    def build(self) -> None:
        """Build on this rank (its owner, or a rank holding a replica, e.g. a tied embedding)."""
        if self._built is not None:
            return
        module = self.builder()
        object.__setattr__(self, "_built", module)
        for name, child in module.named_children():
            self.add_module(name, child)
        for name, param in module.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in module.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in module._non_persistent_buffers_set)

    def forward(self, *args, **kwargs):
        if self._built is None:
            return TensorPointer(self.rank)
        return self._built(*args, **kwargs)

    def _apply(self, fn, recurse=True):
        """``.to()`` / ``.double()`` may replace this block's own tensors: keep the built module's
        references to them in step (children are shared objects and need nothing)."""
        out = super()._apply(fn, recurse)
        if self._built is not None:
            self._built._parameters.update({k: v for k, v in self._parameters.items() if k in self._built._parameters})
            self._built._buffers.update({k: v for k, v in self._buffers.items() if k in self._built._buffers})
        return out

    def train(self, mode: bool = True):
        if self._built is not None:
            self._built.training = mode  # its children are ours and follow super().train
        return super().train(mode)

    def extra_repr(self) -> str:
        where = "here" if self.is_built else "elsewhere"
        return f"rank={self.rank}, virtual_stage={self.virtual_stage}, cost={self.cost}, built {where}"


@dataclass(frozen=True, eq=False)
class ModelChunk:
    """The blocks of one virtual stage held by this rank, in model order."""

    virtual_stage: int
    num_virtual_stages: int
    blocks: tuple[PipelineBlock, ...]

    @property
    def is_first(self) -> bool:  # takes the data (token ids)
        return self.virtual_stage == 0

    @property
    def is_last(self) -> bool:  # produces the loss
        return self.virtual_stage == self.num_virtual_stages - 1

    def __contains__(self, block: object) -> bool:
        return any(block is b for b in self.blocks)


def place_blocks(blocks: Sequence[PipelineBlock], pp_rank: int, pp_size: int,
                 virtual_stages: int = 1) -> tuple[ModelChunk, ...]:
    """Assign every block a virtual stage and an owner rank, build this rank's blocks, and return
    this rank's model chunks (chunk c = virtual stage c * pp + pp_rank)."""
    num_stages = pp_size * virtual_stages
    stage_blocks = [[blocks[i] for i in stage] for stage in
                    split_stages([b.cost for b in blocks], [b.attach for b in blocks], pp_size, virtual_stages)]
    for stage, members in enumerate(stage_blocks):
        for block in members:
            block.set_rank(stage % pp_size, stage, pp_rank)
    return tuple(ModelChunk(s, num_stages, tuple(stage_blocks[s]))
                 for s in range(pp_rank, num_stages, pp_size))
