"""The GPU path's launch-time choices, checked on CPU: which GPU a rank takes, the process groups'
timeout against the hang watchdog's, NCCL's dump settings, the data-build wait, the torch API
floor of the collectives, and a stop vote that never blocks the host on a silent step."""
from __future__ import annotations

import pytest
import torch

from nanotrain.parallel.context import ParallelContext


@pytest.fixture
def gpus(monkeypatch):
    """``torch.cuda`` with ``n`` visible GPUs (none exists here); records ``set_device``."""
    chosen = []

    def visible(n: int) -> list:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
        return chosen
    return visible


@pytest.mark.parametrize("local_world, local_rank, visible, index", [
    (4, 2, 4, 2),  # every rank sees the node's GPUs: its own by LOCAL_RANK
    (4, 2, 1, 0),  # each rank sees exactly one (bound per task)
    (1, 0, 8, 0),  # one rank on the node: no other rank can share its GPU
])
def test_rank_picks_its_gpu(gpus, monkeypatch, local_world, local_rank, visible, index):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    chosen = gpus(visible)
    assert ParallelContext._select_device() == torch.device("cuda", index)
    assert chosen == [index]


def test_a_subset_of_gpus_per_rank_is_refused(gpus, monkeypatch):
    """4 ranks on the node, 2 GPUs visible to each (a per-task binding): ranks 0 and 2 would
    both take index 0, i.e. the same physical GPU."""
    for key, value in {"LOCAL_WORLD_SIZE": "4", "LOCAL_RANK": "2", "CUDA_VISIBLE_DEVICES": "0,1",
                       "SLURM_STEP_GPUS": "0,1", "SLURM_LOCALID": "2"}.items():
        monkeypatch.setenv(key, value)
    chosen = gpus(2)
    with pytest.raises(RuntimeError) as err:
        ParallelContext._select_device()
    message = str(err.value)
    for part in ("LOCAL_RANK=2", "LOCAL_WORLD_SIZE=4", "device_count()=2", "CUDA_VISIBLE_DEVICES=0,1",
                 "SLURM_STEP_GPUS=0,1", "SLURM_LOCALID=2", "Fix:"):
        assert part in message, message
    assert chosen == []
