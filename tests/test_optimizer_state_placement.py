"""Loaded AdamW states sit where torch's own ``Optimizer.load_state_dict`` would put them.

On CUDA the optimizer is fused, and the fused kernel reads ``step`` through a device pointer: a
step left on the host after a resume is an illegal memory access on the first ``step()``. The
meta device stands in for CUDA here (torch accepts fused/capturable AdamW over meta parameters),
and torch's ``_process_value_according_to_param_policy`` is the oracle. ZeRO-1 runs over torch's
``fake`` backend at dp 2 in this process (no peers: nothing is communicated while loading).
"""

import itertools

import pytest
import torch
import torch.distributed as dist
from torch import nn

from nanotrain.config.schema import OptimizerArgs
from nanotrain.optim import build_optimizer, load_optimizer_state_by_name, optimizer_state_by_name


class Tiny(nn.Module):
    def __init__(self, device):
        super().__init__()
        self.emb = nn.Embedding(10, 8, device=device)
        self.norm = nn.Parameter(torch.ones(8, device=device))
        self.fc = nn.Linear(8, 8, device=device)


@pytest.fixture
def fake_dp2():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _cpu_states(optimizer) -> dict:
    """What the checkpoint loader hands over: host tensors, one range per parameter."""
    g = torch.Generator().manual_seed(0)
    return {
        name: {
            **s,
            "step": torch.tensor([3.0]),  # saved as a 1-element tensor
            "exp_avg": torch.randn(s["stop"] - s["start"], generator=g),
            "exp_avg_sq": torch.rand(s["stop"] - s["start"], generator=g),
        }
        for name, s in optimizer_state_by_name(optimizer).items()
    }


def _check_placement(optimizer) -> list[str]:
    """Every state tensor against torch's policy for its parameter; returns the misplaced ones."""
    groups = optimizer.state_dict()["param_groups"]  # "params" as ids, with fused/capturable
    ids = {id(p): i for i, p in enumerate(itertools.chain(*(g["params"] for g in optimizer.param_groups)))}
    policy = torch.optim.Optimizer._process_value_according_to_param_policy
    wrong = []
    for p, st in optimizer.state.items():
        assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
        for key, value in st.items():
            # Where torch puts a state depends on the parameter and its group only: ask with a
            # host stand-in (a meta value cannot be copied anywhere).
            want = policy(p, torch.empty(value.shape, dtype=value.dtype), ids[id(p)], groups, key)
            if (value.device, value.dtype) != (want.device, want.dtype):
                wrong.append(f"{key}: {value.device}/{value.dtype}, torch puts it on {want.device}/{want.dtype}")
        assert st["step"].shape == ()
    assert len(optimizer.state) == sum(len(g["params"]) for g in optimizer.param_groups)
    return wrong


def _optimizer(device, zero: int, flag: str | None):
    opt = build_optimizer(Tiny(device).named_parameters(), OptimizerArgs(lr=1e-3), None, zero_stage=zero)
    for g in opt.param_groups:
        if flag:
            g[flag] = True  # what build_optimizer sets on CUDA (fused); capturable for CUDA graphs
    return opt


@pytest.mark.parametrize("flag", ["fused", "capturable"])
@pytest.mark.parametrize("zero", [0, 1])
def test_fused_or_capturable_states_load_onto_the_param_device(zero, flag, request):
    if zero == 1:
        request.getfixturevalue("fake_dp2")
    opt = _optimizer("meta", zero, flag)
    if zero == 1:
        shard = sum(s.numel() for g in opt.param_groups for s in g["params"])
        assert shard < sum(p.numel() for p in opt.params)  # rank 0 of dp 2 holds part of the states
    load_optimizer_state_by_name(opt, _cpu_states(opt))
    assert _check_placement(opt) == []
    assert all(st["step"].device.type == "meta" for st in opt.state.values())


@pytest.mark.parametrize("zero", [0, 1])
def test_plain_states_keep_the_host_step_and_the_values(zero):
    opt = _optimizer("cpu", zero, None)
    states = _cpu_states(opt)
    load_optimizer_state_by_name(opt, states)
    assert _check_placement(opt) == []
    for name, st in optimizer_state_by_name(opt).items():
        assert st["step"].device.type == "cpu" and st["step"].item() == 3.0
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(st[key].reshape(-1), states[name][key])
            assert st[key].data_ptr() != states[name][key].data_ptr()  # a copy, not the caller's
