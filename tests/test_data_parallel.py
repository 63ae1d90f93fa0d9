"""Bucketed DP gradient sync and ZeRO-1, in real gloo process groups (CPU, fp32).

Process launches are the expensive part, so there is one launch per dp size (2 and 4) that runs
every check and returns numbers; the tests below only look at them. References are computed inside
each rank by replaying every rank's data in a single process.
"""

import pytest
import torch
from torch import nn

from nanotrain.config.schema import OptimizerArgs
from nanotrain.parallel.data_parallel import BucketedGradSync, zero_partition

from helpers.dist import run_distributed

TINY_CAP_MB = 0.002  # ~2 KB: one bucket per parameter or two; forces many buckets
BIG_CAP_MB = 25.0  # the default: one bucket for the whole model


class MLP(nn.Module):
    """Tiny model with 2-D weights, biases and a 1-D gain (both weight-decay groups).

    ``extras`` adds a parameter never used in forward (placed early in the parameter order, so
    its bucket is one of the last and blocks later buckets' launch) and one used only when
    ``use_sometimes`` is set (per rank: different graphs on different ranks).
    """

    def __init__(self, extras: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        if extras:
            self.unused = nn.Linear(4, 4)
        self.gain = nn.Parameter(torch.ones(64))
        self.fc2 = nn.Linear(64, 64)
        if extras:
            self.sometimes = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 8)

    def forward(self, x, use_sometimes: bool = False):
        h = torch.tanh(self.fc1(x)) * self.gain
        h = torch.tanh(self.fc2(h))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.fc3(h)


def _model(extras=False) -> MLP:
    torch.manual_seed(0)
    return MLP(extras)


def _batch(seed: int, n: int = 8):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 16, generator=g), torch.randn(n, 8, generator=g)


def _loss(model, x, y, **kw):
    return nn.functional.mse_loss(model(x, **kw), y)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: (p.grad.clone() if p.grad is not None else torch.zeros_like(p)) for n, p in model.named_parameters()}


def _ref_avg(seeds, extras=False, flags=None) -> dict[str, torch.Tensor]:
    """Average over ranks of the gradient each rank computes alone."""
    acc = None
    for r, seed in enumerate(seeds):
        m = _model(extras)
        kw = {"use_sometimes": flags[r]} if flags else {}
        _loss(m, *_batch(seed), **kw).backward()
        g = _grads(m)
        acc = g if acc is None else {k: acc[k] + g[k] for k in acc}
    return {k: v / len(seeds) for k, v in acc.items()}


def _ref_concat(seeds) -> dict[str, torch.Tensor]:
    """Single-process gradient of the mean loss over all ranks' batches concatenated."""
    m = _model()
    xs, ys = zip(*(_batch(s) for s in seeds))
    _loss(m, torch.cat(xs), torch.cat(ys)).backward()
    return _grads(m)


def _max_err(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- rank function
def _dp_worker(world: int) -> dict:
    from nanotrain.optim import build_lr_scheduler, build_optimizer, optimizer_state_by_name
    from nanotrain.parallel.parallel_context import ParallelContext

    pc = ParallelContext(data_parallel_size=world)
    rank, group = pc.dp_rank, pc.dp_cp_pg
    out: dict = {"rank": rank}

    # 1. one backward, several bucket sizes: average of per-rank grads, overlap evidence.
    for cap in (TINY_CAP_MB, 0.02, BIG_CAP_MB):
        model = _model()
        sync = BucketedGradSync(list(model.parameters()), group, cap)
        _loss(model, *_batch(rank)).backward()
        log = list(sync.launch_log)  # taken before finish: what backward itself launched
        sync.finish_grad_sync()
        got = _grads(model)
        out[("basic", cap)] = {
            "n_buckets": len(sync.buckets),
            "n_params": len(sync.params),
            "log": log,
            "err_avg": _max_err(got, _ref_avg(range(world))),
            "err_concat": _max_err(got, _ref_concat(range(world))),
            "views": all(p.grad.data_ptr() == sync.grad_view(p).data_ptr() for p in model.parameters()),
        }

    # 2. no_sync: 3 micro-batches == one big batch; then a second step after zero_grad and a
    #    third after set_to_none (what optimizer.zero_grad() does) to prove the reset paths.
    model = _model()
    sync = BucketedGradSync(list(model.parameters()), group, TINY_CAP_MB)
    errs, logs_inside = [], []
    for step in range(3):
        seeds = [1000 * step + 10 * r + m for r in range(world) for m in range(3)]
        for m in range(3):
            x, y = _batch(1000 * step + 10 * rank + m)
            if m < 2:
                with sync.no_sync():
                    (_loss(model, x, y) / 3).backward()
                logs_inside.append(len(sync.launch_log))
            else:
                (_loss(model, x, y) / 3).backward()
        sync.finish_grad_sync()
        errs.append(_max_err(_grads(model), _ref_concat(seeds)))
        if step == 0:
            sync.zero_grad()
        else:
            for p in model.parameters():
                p.grad = None
    out["no_sync"] = {"errs": errs, "launched_inside_no_sync": logs_inside}

    # 3. a parameter with no grad anywhere and one with a grad on rank 0 only: no deadlock,
    #    zeros for the missing ones, identical grads on every rank.
    model = _model(extras=True)
    sync = BucketedGradSync(list(model.parameters()), group, TINY_CAP_MB)
    flags = [r == 0 for r in range(world)]
    _loss(model, *_batch(rank), use_sometimes=flags[rank]).backward()
    in_backward = sum(1 for *_, from_hook in sync.launch_log if from_hook)
    sync.finish_grad_sync()
    got = _grads(model)
    out["unused"] = {
        "err": _max_err(got, _ref_avg(range(world), extras=True, flags=flags)),
        "unused_zero": bool((got["unused.weight"] == 0).all()),
        "order": [i for i, *_ in sync.launch_log],
        "n_buckets": len(sync.buckets),
        "in_backward": in_backward,
        "fingerprint": torch.cat([g.flatten() for g in got.values()]),
    }

    # 4. ZeRO-1 vs plain AdamW for 10 steps (same synced grads), plus an end-to-end single-
    #    process run on the concatenated batch; warmup + cosine schedule driving both.
    args = OptimizerArgs(lr=1e-2, weight_decay=0.1, warmup_steps=3, lr_decay_style="cosine", min_lr=1e-3)
    model, ref, e2e = _model(), _model(), _model()
    opt = build_optimizer(model.named_parameters(), args, group, zero_stage=1)
    ref_opt = build_optimizer(ref.named_parameters(), args, None, zero_stage=0)
    e2e_opt = build_optimizer(e2e.named_parameters(), args, None, zero_stage=0)
    scheds = [build_lr_scheduler(o, args, 10) for o in (opt, ref_opt, e2e_opt)]
    sync = BucketedGradSync(list(model.parameters()), group, 0.01)
    diffs, e2e_diffs, lrs = [], [], []
    for step in range(10):
        _loss(model, *_batch(1000 * step + rank)).backward()
        sync.finish_grad_sync()
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()
        xs, ys = zip(*(_batch(1000 * step + r) for r in range(world)))
        _loss(e2e, torch.cat(xs), torch.cat(ys)).backward()
        for o in (opt, ref_opt, e2e_opt):
            o.step()
        for s in scheds:
            s.step()
        sync.zero_grad()
        ref_opt.zero_grad()
        e2e_opt.zero_grad()
        diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
        e2e_diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), e2e.parameters())))
        lrs.append([g["lr"] for g in opt.param_groups])
    ref_state = optimizer_state_by_name(ref_opt)
    state_err = 0.0
    for name, st in optimizer_state_by_name(opt).items():
        r = ref_state[name]
        a, b = st["start"], st["stop"]
        assert (a, b) == opt.param_ranges()[name]
        for key in ("exp_avg", "exp_avg_sq"):
            state_err = max(state_err, (st[key] - r[key][a:b]).abs().max().item())
        state_err = max(state_err, abs(st["step"].item() - r["step"].item()))
    out["zero"] = {
        "diffs": diffs,
        "e2e_diffs": e2e_diffs,
        "lrs": lrs,
        "ref_lrs": [g["lr"] for g in ref_opt.param_groups],
        "state_elems": sum(s["exp_avg"].numel() for s in opt.state.values()),
        "state_elems_sq": sum(s["exp_avg_sq"].numel() for s in opt.state.values()),
        "total": sum(p.numel() for p in model.parameters()),
        "state_err": state_err,
        "n_groups": len(opt.param_groups),
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "ranges_all": [opt.param_ranges(r) for r in range(world)],
    }

    # 5. ZeRO-1 built after its gradient sync (the trainer's order) takes the sync over: tiny
    #    buckets padded to a multiple of dp, reduce-scattered (and all-gathered too until the
    #    first update: whole gradients then), parameters all-gathered bucket by bucket; the same
    #    10 steps as ZeRO-0 on all-reduced gradients, with a parameter that never gets a gradient
    #    and one used on rank 0 only.
    model, ref = _model(extras=True), _model(extras=True)
    sync = BucketedGradSync(list(model.parameters()), group, TINY_CAP_MB)
    ref_sync = BucketedGradSync(list(ref.parameters()), group, TINY_CAP_MB)
    opt = build_optimizer(model.named_parameters(), args, group, zero_stage=1)
    ref_opt = build_optimizer(ref.named_parameters(), args, group, zero_stage=0)
    scheds = [build_lr_scheduler(o, args, 10) for o in (opt, ref_opt)]
    diffs, gathered, whole = [], [], None
    for step in range(10):
        for m, s in ((model, sync), (ref, ref_sync)):
            _loss(m, *_batch(1000 * step + rank), use_sometimes=rank == 0).backward()
            s.finish_grad_sync()
        gathered.append(sync.gather_grads)
        if step == 0:
            whole = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
        for o, s in zip((opt, ref_opt), scheds):
            o.step()
            s.step()
        sync.zero_grad()
        ref_sync.zero_grad()
        diffs.append(max((p - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters())))
    owned = sum(b - a for a, b in opt.param_ranges().values())
    out["zero_sharded"] = {
        "diffs": diffs,
        "gathered": gathered,
        "whole": whole,
        "shards": sync.shards,
        "n_buckets": len(sync.buckets),
        "padding": [b.buffer.numel() - sum(p.numel() for p in b.params) for b in sync.buckets],
        "owned": owned,
        "state_elems": sum(st["exp_avg"].numel() for st in opt.state.values()),
        "params": torch.cat([p.detach().flatten() for p in model.parameters()]),
        "total": sum(p.numel() for p in model.parameters()),
    }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def dp_results(request):
    world = request.param
    return world, run_distributed(_dp_worker, world, world, timeout=120)


# ----------------------------------------------------------------------------- tests
def test_grads_are_the_average_for_every_bucket_size(dp_results):
    world, results = dp_results
    for res in results:
        tiny, big = res[("basic", TINY_CAP_MB)], res[("basic", BIG_CAP_MB)]
        assert tiny["n_buckets"] >= 6 and big["n_buckets"] == 1
        for cap in (TINY_CAP_MB, 0.02, BIG_CAP_MB):
            r = res[("basic", cap)]
            assert r["views"], "every .grad must stay a view into its bucket"
            assert r["err_avg"] < 1e-6, (cap, r["err_avg"])
            assert r["err_concat"] < 1e-6, (cap, r["err_concat"])


def test_all_reduces_are_launched_during_backward(dp_results):
    """Overlap: buckets are launched from hooks while later hooks (earlier layers) are still to
    come, in index order, and all of them before backward returns when every param has a grad."""
    _, results = dp_results
    for res in results:
        r = res[("basic", TINY_CAP_MB)]
        log = r["log"]
        assert [i for i, *_ in log] == list(range(r["n_buckets"]))
        assert all(from_hook for *_, from_hook in log)
        first_hooks_fired = log[0][1]
        assert first_hooks_fired < r["n_params"], "first all-reduce must start before backward ends"
        assert sum(1 for _, fired, _ in log if fired < r["n_params"]) >= r["n_buckets"] // 2


def test_no_sync_accumulation_equals_big_batch(dp_results):
    _, results = dp_results
    for res in results:
        r = res["no_sync"]
        assert r["launched_inside_no_sync"] == [0] * 6
        assert max(r["errs"]) < 1e-6, r["errs"]


def test_param_without_grad_does_not_deadlock(dp_results):
    world, results = dp_results
    for res in results:
        r = res["unused"]
        assert r["err"] < 1e-6 and r["unused_zero"]
        assert r["order"] == list(range(r["n_buckets"]))
    # every rank ends with the same gradients although their graphs differed
    for res in results[1:]:
        assert torch.equal(res["unused"]["fingerprint"], results[0]["unused"]["fingerprint"])


def test_zero1_equals_adamw_and_states_are_sharded(dp_results):
    world, results = dp_results
    for res in results:
        z = res["zero"]
        assert max(z["diffs"]) <= 1e-6, z["diffs"]
        assert max(z["e2e_diffs"]) < 1e-5, z["e2e_diffs"]  # includes grad rounding of dp
        assert z["state_err"] <= 1e-6
        assert z["n_groups"] == 2
        assert all(lr == z["ref_lrs"] for lr in z["lrs"][-1:])
        assert z["state_elems"] == z["state_elems_sq"]
        assert z["state_elems"] <= -(-z["total"] // world)  # ~1/dp of the elements
        assert z["state_elems"] >= z["total"] // world - world
    assert sum(res["zero"]["state_elems"] for res in results) == results[0]["zero"]["total"]
    for res in results[1:]:  # every dp rank holds the full, identical parameters
        assert torch.equal(res["zero"]["params"], results[0]["zero"]["params"])
        assert res["zero"]["ranges_all"] == results[0]["zero"]["ranges_all"]


def test_zero1_over_its_reduce_scattering_sync_equals_adamw(dp_results):
    world, results = dp_results
    for res in results:
        z = res["zero_sharded"]
        assert z["shards"] == world and z["n_buckets"] >= 6
        assert all(0 <= pad < world for pad in z["padding"]), z["padding"]
        assert z["gathered"] == [True] + [False] * 9  # whole gradients until the first update
        assert z["whole"] < 1e-6
        assert max(z["diffs"]) <= 1e-6, z["diffs"]
        assert z["state_elems"] == z["owned"]
    assert sum(res["zero_sharded"]["owned"] for res in results) == results[0]["zero_sharded"]["total"]
    for res in results[1:]:  # every dp rank holds the full, identical parameters
        assert torch.equal(res["zero_sharded"]["params"], results[0]["zero_sharded"]["params"])


# ----------------------------------------------------------------------------- single process
def test_group_of_one_needs_no_communication():
    model, ref = _model(), _model()
    sync = BucketedGradSync(list(model.parameters()), None, TINY_CAP_MB)
    assert sync.world_size == 1
    for m in range(3):
        x, y = _batch(m)
        if m < 2:
            with sync.no_sync():
                _loss(model, x, y).backward()
        else:
            _loss(model, x, y).backward()
        _loss(ref, x, y).backward()
    sync.finish_grad_sync()
    assert _max_err(_grads(model), _grads(ref)) < 1e-6
    assert [i for i, *_ in sync.launch_log] == list(range(len(sync.buckets)))
    sync.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_misuse_is_an_error():
    model = _model()
    _sync = BucketedGradSync(list(model.parameters()), None, BIG_CAP_MB)  # its hooks watch backward
    _loss(model, *_batch(0)).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(model, *_batch(1)).backward()  # second sync'ed backward before finish


def test_zero_partition_is_balanced_and_cuts_params():
    parts = zero_partition([10, 7, 3], 4)  # 20 elements -> chunks of 5
    assert parts == [[(0, 0, 5)], [(0, 5, 10)], [(1, 0, 5)], [(1, 5, 7), (2, 0, 3)]]
    parts = zero_partition([5, 5], 3)  # chunk 4: 4, 4, 2
    sizes = [sum(b - a for _, a, b in p) for p in parts]
    assert sizes == [4, 4, 2]
