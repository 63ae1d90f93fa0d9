"""Scaled dot-product attention as both the model and context parallelism call it (torch only,
no process group: ``models`` may import it)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# SDPA takes grouped-query k/v (fewer heads than q) as they are from torch 2.5 on (``enable_gqa``).
SDPA_GQA = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 5)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kwargs) -> torch.Tensor:
    """Scaled dot-product attention over ``[B, heads, S, d]``; grouped-query k/v go in without
    the per-head copy ``repeat_interleave`` makes (callers repeat them on older torch)."""
    if SDPA_GQA and k.shape[1] != q.shape[1]:
        kwargs["enable_gqa"] = True
    return F.scaled_dot_product_attention(q, k, v, **kwargs)
