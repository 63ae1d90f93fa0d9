"""Optimizer construction, LR schedule values, state-by-name round trips (single process), and the
global grad-norm clipping across tp/pp/dp (one 4-rank gloo launch covering three layouts)."""

import math

import pytest
import torch
from torch import nn

from nanotrain.config.schema import OptimizerArgs
from nanotrain.optim import (
    build_lr_scheduler,
    build_optimizer,
    clip_grad_norm_,
    load_optimizer_state_by_name,
    lr_at,
    optimizer_state_by_name,
)
from nanotrain.parallel.data_parallel import ZeroOneOptimizer

from helpers.dist import run_distributed


# ----------------------------------------------------------------------------- schedule
def _lrs(args, train_steps, n):
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=args.lr)
    sched = build_lr_scheduler(opt, args, train_steps)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


def test_schedule_warmup_then_cosine():
    args = OptimizerArgs(lr=1e-3, warmup_steps=10, lr_decay_style="cosine", min_lr=1e-4)
    lrs = _lrs(args, 110, 115)
    assert lrs[0] == pytest.approx(1e-4)  # lr / warmup: small, not zero
    assert lrs[4] == pytest.approx(5e-4)
    assert lrs[9] == pytest.approx(1e-3)  # warmup reaches lr on its last step
    assert lrs[10] == pytest.approx(1e-3)  # decay starts at the peak
    assert lrs[60] == pytest.approx((1e-3 + 1e-4) / 2)  # half way: cosine midpoint
    assert lrs[35] == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi / 4)))
    assert lrs[110] == pytest.approx(1e-4) and lrs[114] == pytest.approx(1e-4)  # min after end
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    assert lrs == pytest.approx([lr_at(s, args, 110) for s in range(115)])


def test_schedule_linear_constant_and_no_warmup():
    lin = OptimizerArgs(lr=2.0, warmup_steps=0, lr_decay_style="linear", min_lr=0.0)
    assert _lrs(lin, 4, 6) == pytest.approx([2.0, 1.5, 1.0, 0.5, 0.0, 0.0])
    const = OptimizerArgs(lr=2.0, warmup_steps=2, lr_decay_style="constant")
    assert _lrs(const, 4, 5) == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0])


def test_schedule_wsd_linear_and_1_sqrt():
    lin = OptimizerArgs(
        lr=2.0, warmup_steps=2, lr_decay_style="wsd", decay_fraction=0.4, decay_shape="linear", min_lr=0.0
    )
    # 10 steps: warmup 0-1, stable 2-5 at lr, decay over the last round(0.4*10)=4 steps (6-9)
    assert _lrs(lin, 10, 12) == pytest.approx([1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 1.5, 1.0, 0.5, 0.0, 0.0])
    sq = OptimizerArgs(
        lr=1.0, warmup_steps=0, lr_decay_style="wsd", decay_fraction=0.5, decay_shape="1-sqrt", min_lr=0.1
    )
    lrs = _lrs(sq, 8, 9)
    assert lrs[:4] == pytest.approx([1.0] * 4)
    assert lrs[4:] == pytest.approx([0.1 + 0.9 * (1 - math.sqrt(p / 4)) for p in range(5)])
    assert lrs[8] == pytest.approx(0.1)
    assert lrs == pytest.approx([lr_at(s, sq, 8) for s in range(9)])
    # resumable: a scheduler restored at step 5 continues with the uninterrupted values
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=sq.lr)
    sched = build_lr_scheduler(opt, sq, 8)
    for _ in range(5):
        opt.step()
        sched.step()
    opt2 = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=sq.lr)
    sched2 = build_lr_scheduler(opt2, sq, 8)
    sched2.load_state_dict(sched.state_dict())
    for _ in range(2):
        opt2.step()
        sched2.step()
    assert opt2.param_groups[0]["lr"] == pytest.approx(lrs[7])  # 5 steps + 2 after the restore


def test_scheduler_state_dict_is_plain_and_resumes():
    args = OptimizerArgs(lr=1e-3, warmup_steps=3, lr_decay_style="cosine", min_lr=1e-5)
    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.AdamW([p], lr=args.lr)
    sched = build_lr_scheduler(opt, args, 20)
    for _ in range(7):
        opt.step()
        sched.step()
    sd = sched.state_dict()
    assert all(isinstance(v, (int, float, list, bool, type(None))) for v in sd.values()), sd
    opt2 = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=args.lr)
    sched2 = build_lr_scheduler(opt2, args, 20)
    sched2.load_state_dict(sd)
    for _ in range(5):
        for o in (opt, sched, opt2, sched2):
            o.step()
        assert opt.param_groups[0]["lr"] == opt2.param_groups[0]["lr"]


# ----------------------------------------------------------------------------- optimizer
class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 8)
        self.norm = nn.Parameter(torch.ones(8))
        self.fc = nn.Linear(8, 8)

    def forward(self, idx):
        return self.fc(self.emb(idx) * self.norm).pow(2).mean()


def _train(model, opt, steps, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        model(torch.randint(0, 10, (4, 5), generator=g)).backward()
        opt.step()
        opt.zero_grad()


def test_weight_decay_groups_and_names():
    m = Tiny()
    args = OptimizerArgs(lr=1e-3, weight_decay=0.1, betas=(0.8, 0.9), eps=1e-7)
    opt = build_optimizer(m.named_parameters(), args, None, zero_stage=0)
    assert type(opt) is torch.optim.AdamW
    decay, no_decay = opt.param_groups
    assert decay["param_names"] == ["emb.weight", "fc.weight"] and decay["weight_decay"] == 0.1
    assert no_decay["param_names"] == ["norm", "fc.bias"] and no_decay["weight_decay"] == 0.0
    assert decay["betas"] == (0.8, 0.9) and decay["eps"] == 1e-7 and decay["lr"] == 1e-3
    with pytest.raises(ValueError, match="zero_stage"):
        build_optimizer(m.named_parameters(), args, None, zero_stage=4)


@pytest.mark.parametrize("src_stage,dst_stage", [(0, 0), (1, 1), (0, 1), (1, 0)])
def test_state_by_name_round_trip_continues_identically(src_stage, dst_stage):
    """Save after 3 steps, load into a fresh model + optimizer (any stage), 3 more steps: same as
    6 uninterrupted steps. Single process: ZeRO-1 with a dp group of one."""
    args = OptimizerArgs(lr=1e-2, weight_decay=0.1)
    a = Tiny()
    opt_a = build_optimizer(a.named_parameters(), args, None, zero_stage=src_stage)
    assert isinstance(opt_a, ZeroOneOptimizer) == (src_stage == 1)
    _train(a, opt_a, 3, seed=1)
    states = {
        k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
        for k, v in optimizer_state_by_name(opt_a).items()
    }
    assert states["fc.weight"]["exp_avg"].shape == (64,) and states["fc.weight"]["step"].item() == 3

    b = Tiny()
    b.load_state_dict(a.state_dict())
    opt_b = build_optimizer(b.named_parameters(), args, None, zero_stage=dst_stage)
    load_optimizer_state_by_name(opt_b, states)
    _train(a, opt_a, 3, seed=2)
    _train(b, opt_b, 3, seed=2)
    for (n, pa), pb in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(pa, pb), n


# ----------------------------------------------------------------------------- clipping
def test_clip_single_process_matches_torch():
    m, ref = Tiny(), Tiny()
    for model in (m, ref):
        model(torch.arange(10).view(2, 5)).backward()
    for max_norm in (1e-3, 1e3):
        norm = clip_grad_norm_(m.parameters(), max_norm, None)
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        assert norm.dtype == torch.float32
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-6)
        for p, q in zip(m.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=0)


def _full_model(stages: int):
    """Per stage: a fused row-sharded weight, a column-sharded weight, a replicated bias; the
    gradients are the full (unsharded) ones, with different magnitudes per tensor."""
    g = torch.Generator().manual_seed(42)
    return [
        {
            "w_rows": torch.randn(16, 6, generator=g) * (s + 1),
            "w_cols": torch.randn(5, 8, generator=g) * 0.1,
            "bias": torch.randn(16, generator=g) * 3,
        }
        for s in range(stages)
    ]


def _clip_worker() -> dict:
    from nanotrain.parallel.parallel_context import ParallelContext
    from nanotrain.parallel.sharding import copy_from_full_, get_shard_info, set_shard_info

    out = {}
    for label, sizes in (
        ("tp2_pp2", dict(tensor_parallel_size=2, pipeline_parallel_size=2)),
        ("tp2_dp2", dict(tensor_parallel_size=2, data_parallel_size=2)),
        ("tp4", dict(tensor_parallel_size=4)),
    ):
        pc = ParallelContext(**sizes)
        full = _full_model(pc.pp_size)
        res = {}
        for factor in (0.25, 4.0):  # clipping triggers / does not
            params = _local_params(pc, full[pc.pp_rank])
            ref = [t.clone().requires_grad_() for stage in full for t in stage.values()]
            for t, g in zip(ref, [g for stage in full for g in stage.values()]):
                t.grad = g.clone()
            ref_norm = torch.nn.utils.clip_grad_norm_(ref, float("inf"))  # norm only
            max_norm = factor * ref_norm.item()
            torch.nn.utils.clip_grad_norm_(ref, max_norm)
            norm = clip_grad_norm_([p for p, _ in params], max_norm, pc)
            # clipped local grads vs the slices of the clipped reference grads
            ref_stage = ref[3 * pc.pp_rank : 3 * pc.pp_rank + 3]
            err = 0.0
            for (p, _), t in zip(params, ref_stage):
                tmp = nn.Parameter(torch.zeros_like(p.grad))
                set_shard_info(tmp, get_shard_info(p))
                copy_from_full_(tmp, t.grad)
                expect = tmp.detach()
                err = max(err, ((p.grad - expect).abs().max() / expect.abs().max()).item())
            res[factor] = {"norm": norm.item(), "ref": ref_norm.item(), "grad_rel_err": err}
        out[label] = res
    return out


def _local_params(pc, stage_full: dict):
    """This rank's parameters of its stage, with ShardInfo and their slice of the full grads."""
    from nanotrain.parallel.sharding import copy_from_full_, row_shard_info, set_shard_info

    tp, r = pc.tp_size, pc.tp_rank
    infos = {
        "w_rows": (row_shard_info((16, 6), 0, (8, 4, 4), r, tp), (16 // tp, 6)),
        "w_cols": (row_shard_info((5, 8), 1, (8,), r, tp), (5, 8 // tp)),
        "bias": (None, (16,)),
    }
    params = []
    for name, g_full in stage_full.items():
        info, shape = infos[name]
        p = nn.Parameter(torch.zeros(shape))
        if info is not None:
            set_shard_info(p, info)
        g = nn.Parameter(torch.zeros(shape))  # a carrier so copy_from_full_ sees the same info
        if info is not None:
            set_shard_info(g, info)
        copy_from_full_(g, g_full)
        p.grad = g.detach().clone()
        params.append((p, g_full))
    return params


def test_clip_global_norm_across_tp_pp_dp():
    results = run_distributed(_clip_worker, 4, timeout=120)
    for rank, out in enumerate(results):
        for label, res in out.items():
            clipped, unclipped = res[0.25], res[4.0]
            for r in (clipped, unclipped):
                assert r["norm"] == pytest.approx(r["ref"], rel=1e-6), (rank, label, r)
            assert clipped["grad_rel_err"] < 1e-6, (rank, label, clipped)
            assert unclipped["grad_rel_err"] < 1e-6, (rank, label, unclipped)
    # every rank of a layout sees the same norm (dp replicas included)
    for label in results[0]:
        assert len({out[label][0.25]["norm"] for out in results}) == 1
