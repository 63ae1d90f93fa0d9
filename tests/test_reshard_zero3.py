"""Offline resharding to ZeRO-3: the optimizer ranges ``reshard.optimizer_ranges`` writes for
stage 3 are the ones a stage-3 ``ZeroOneOptimizer`` holds (its buckets cut at the gather units),
so a resumed run takes them as they are. One process on torch's fake backend: building the
optimizer posts no collective, and ``param_ranges(r)`` answers for every dp rank r."""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from helpers.models import MODEL, OPTIM


def test_offline_zero3_ranges_are_the_optimizers():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from nanotrain.checkpoint.reshard import optimizer_ranges
    from nanotrain.models.llama_parallelize import build_llama
    from nanotrain.optim import build_optimizer, optimizer_groups
    from nanotrain.parallel.data_parallel import build_grad_sync
    from nanotrain.parallel.parallel_context import ParallelContext

    dp = 4
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=dp)
    pc = model = grad_sync = optimizer = None
    try:
        pc = ParallelContext(data_parallel_size=dp)
        model = build_llama(dataclasses.replace(MODEL, num_layers=3), pc.tp_pg, seed=5)
        # small buckets: several per layer, and at stages 1-2 some spanning two layers
        grad_sync = build_grad_sync(list(model.parameters()), pc, bucket_cap_mb=0.05)
        optimizer = build_optimizer(model.named_parameters(), OPTIM, zero_stage=3, **optimizer_groups(pc))
        for r in range(dp):
            offline = optimizer_ranges(model, 3, dp, r, 1, 0, bucket_cap_mb=0.05)
            assert {n: (a, b) for n, a, b in offline} == optimizer.param_ranges(r), r
        # the unit cuts matter here: stage 2's partition of the same model differs
        assert optimizer_ranges(model, 2, dp, 1, 1, 0, bucket_cap_mb=0.05) != optimizer_ranges(
            model, 3, dp, 1, 1, 0, bucket_cap_mb=0.05
        )
    finally:
        del model, grad_sync, optimizer  # what holds the groups, before they go
        if pc is not None:
            pc.destroy(synchronize=False)
        if dist.is_initialized():
            dist.destroy_process_group()
