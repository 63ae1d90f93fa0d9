"""TensorPointer: "this tensor exists, but on pipeline rank `group_rank`" (nanotron's 11-line idea).

A pipeline rank that does not hold a value gets a pointer instead of a tensor: the engine returns
one for the loss on every stage but the last, and describes a chunk's input that comes from
another stage as one (it is resolved by a receive from that rank). Using a pointer as a tensor
fails loudly instead of computing on the wrong rank.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TensorPointer:
    group_rank: int  # rank in the pipeline group (pp_pg) that holds the tensor
