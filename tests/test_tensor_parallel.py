"""Tensor-parallel layers against unsharded torch references, in real gloo process groups.

Each TP layer is compared with nn.Linear / nn.Embedding / F.cross_entropy holding the SAME full
weights (loaded into the shards with copy_from_full_): forward outputs, the input gradient, and
every weight-gradient piece (through the parameter's ShardInfo pairs) within 1e-5 in fp32, for
tp in {1, 2, 4} x {ALL_REDUCE, REDUCE_SCATTER} x async {off, on}; async results are also compared
with the synchronous ones.

Process launches dominate the cost on a 2-core box, so there is ONE 4-rank launch: it builds the
tp=4 ParallelContext plus tp=2 groups ({0,1}, {2,3}) and tp=1 groups ({r}), runs every case on
every tp size and returns a flat {case: max error} dict (or the case's traceback). The pytest
functions below then assert per tp with messages naming each failing case. ShardInfo layout is
unit-tested in-process with a stub group (layers only ask a group for size() and rank()).
"""

from __future__ import annotations

import functools
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from nanotrain.parallel.grid import GroupShape
from nanotrain.parallel.sharding import copy_from_full_, get_shard_info, row_shard_info, scatter_to_full
from nanotrain.parallel.tensor_parallel import (
    TensorParallelColumnLinear,
    TensorParallelEmbedding,
    TensorParallelRowLinear,
    allreduce_sequence_parallel_grads_,
    column_linear,
    has_sequence_parallel_partial_grad,
    init_from_full_,
    sharded_cross_entropy,
)

from helpers.dist import run_distributed

TOL = 1e-5
S, B = 8, 2  # sequence-first activations [S, B, H]; S divisible by every tp
VOCAB = 258  # not divisible by 4: padded to 260 at tp=4
MODES = ("ALL_REDUCE", "REDUCE_SCATTER")
TP_SIZES = (1, 2, 4)


# ----------------------------------------------------------------------------- helpers (ranks)
def _err(a, b) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _piece_err(local: torch.Tensor, full: torch.Tensor, info) -> float:
    """Max error of this rank's pieces vs the full tensor; uncovered (padding) entries must be 0."""
    covered = torch.zeros_like(local, dtype=torch.bool)
    e = 0.0
    for loc, glob in info.pairs:
        e = max(e, _err(local[loc], full[glob]))
        covered[loc] = True
    return max(e, _err(local[~covered], torch.zeros_like(local[~covered])))


def _local_from_full(full: torch.Tensor, info, local_shape, fill=0.0) -> torch.Tensor:
    out = torch.full(local_shape, fill, dtype=full.dtype)
    for loc, glob in info.pairs:
        out[loc] = full[glob]
    return out


def _uses(out: torch.Tensor, fn_name: str, depth: int = 3) -> bool:
    """Whether `fn_name` (an autograd Function) is among out's last `depth` graph nodes."""
    frontier = [out.grad_fn]
    for _ in range(depth):
        if any(f is not None and fn_name in type(f).__name__ for f in frontier):
            return True
        frontier = [n for f in frontier if f is not None for n, _ in f.next_functions]
    return False


def _async_path(out, group, async_, fn_name) -> dict:
    """With tp > 1 and async on, the overlapped Function must really be in the graph."""
    if not async_ or group.size() == 1:
        return {}
    return {"async_path_used": 0.0 if _uses(out, fn_name) else float("inf")}


def _seq(t: torch.Tensor, group, mode) -> torch.Tensor:
    """This rank's sequence shard under REDUCE_SCATTER, the full tensor otherwise."""
    if mode != "REDUCE_SCATTER":
        return t
    return t.chunk(group.size(), dim=0)[group.rank()]


def _fill(params_full: dict, layer_params: dict) -> None:
    for name, full in params_full.items():
        copy_from_full_(layer_params[name], full)


# ----------------------------------------------------------------------------- cases (ranks)
def _column_case(group, mode, async_, g, in_f, out_f, bias=False, chunks=None, pad=False):
    layer = TensorParallelColumnLinear(
        in_f, out_f, group, mode, bias=bias, async_communication=async_, contiguous_chunks=chunks, pad_to_tp=pad
    )
    ref = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)  # O(1) activations
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=g))
    _fill(dict(ref.named_parameters()), dict(layer.named_parameters()))
    x = torch.randn(S, B, in_f, generator=g, requires_grad=True)
    gout = torch.randn(S, B, out_f, generator=g)
    ref_out = ref(x)
    ref_out.backward(gout)
    ref_out = ref_out.detach()

    winfo = get_shard_info(layer.weight)
    cols = [(loc[0], glob[0]) for loc, glob in winfo.pairs]  # output columns <- weight rows
    xin = _seq(x.detach(), group, mode).clone().requires_grad_()
    out = layer(xin)
    ref_local, gout_local = torch.zeros_like(out), torch.zeros_like(out)
    for loc, glob in cols:
        ref_local[..., loc], gout_local[..., loc] = ref_out[..., glob], gout[..., glob]
    out.backward(gout_local)
    errs = {
        "out": _err(out, ref_local),
        "dx": _err(xin.grad, _seq(x.grad, group, mode)),
        "dW": _piece_err(layer.weight.grad, ref.weight.grad, winfo),
    }
    errs.update(_async_path(out, group, async_, "ColumnLinearAsync"))
    tensors = {"out": out, "dx": xin.grad, "dW": layer.weight.grad}
    if bias:
        errs["db"] = _piece_err(layer.bias.grad, ref.bias.grad, get_shard_info(layer.bias))
        tensors["db"] = layer.bias.grad
    return errs, tensors


def _row_case(group, mode, async_, g, in_f, out_f, bias=False):
    layer = TensorParallelRowLinear(in_f, out_f, group, mode, bias=bias, async_communication=async_)
    ref = nn.Linear(in_f, out_f, bias=bias)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(out_f, in_f, generator=g) / in_f**0.5)  # O(1) activations
        if bias:
            ref.bias.copy_(torch.randn(out_f, generator=g))
    _fill(dict(ref.named_parameters()), dict(layer.named_parameters()))
    x = torch.randn(S, B, in_f, generator=g, requires_grad=True)
    gout = torch.randn(S, B, out_f, generator=g)
    ref_out = ref(x)
    ref_out.backward(gout)

    winfo = get_shard_info(layer.weight)
    ((loc, glob),) = winfo.pairs
    xin = x.detach()[..., glob[1]].clone().requires_grad_()
    out = layer(xin)
    out.backward(_seq(gout, group, mode))
    allreduce_sequence_parallel_grads_(layer.parameters(), group)  # partial bias grads under SP
    errs = {
        "out": _err(out, _seq(ref_out.detach(), group, mode)),
        "dx": _err(xin.grad, x.grad[..., glob[1]]),
        "dW": _piece_err(layer.weight.grad, ref.weight.grad, winfo),
    }
    if mode == "REDUCE_SCATTER":  # the ALL_REDUCE row has nothing to overlap: sync path
        errs.update(_async_path(out, group, async_, "RowLinearAsyncReduceScatter"))
    tensors = {"out": out, "dx": xin.grad, "dW": layer.weight.grad}
    if bias:
        errs["db"] = _err(layer.bias.grad, ref.bias.grad)
        tensors["db"] = layer.bias.grad
    return errs, tensors


def _embedding_case(group, mode, async_, g, vocab=VOCAB, dim=16):
    layer = TensorParallelEmbedding(vocab, dim, group, mode)
    ref = nn.Embedding(vocab, dim)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(vocab, dim, generator=g))
    copy_from_full_(layer.weight, ref.weight)
    ids = torch.randint(0, vocab, (S, B), generator=g)
    ids[0, 0], ids[1, 0] = 0, vocab - 1  # both ends of the vocabulary
    gout = torch.randn(S, B, dim, generator=g)
    ref_out = ref(ids)
    ref_out.backward(gout)
    out = layer(ids)
    out.backward(_seq(gout, group, mode))
    winfo = get_shard_info(layer.weight)
    errs = {
        "out": _err(out, _seq(ref_out.detach(), group, mode)),
        "dW": _piece_err(layer.weight.grad, ref.weight.grad, winfo),
    }
    return errs, {"out": out, "dW": layer.weight.grad}


def _vocab_info(group, vocab):
    tp = group.size()
    padded = -(-vocab // tp) * tp
    return row_shard_info((padded,), 0, (padded,), group.rank(), tp, real_sizes=(vocab,)), padded // tp


def _cross_entropy_case(group, mode, async_, g, scale=3.0, rel=False):
    logits = (torch.randn(S, B, VOCAB, generator=g) * scale).requires_grad_()
    targets = torch.randint(0, VOCAB, (S, B), generator=g)
    targets[0, 0], targets[1, 1], targets[2, 0] = 0, VOCAB - 1, -100  # ends + an ignored token
    gloss = torch.randn(S, B, generator=g)
    ref = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view(S, B)
    ref.backward(gloss)
    info, v_local = _vocab_info(group, VOCAB)
    # The padded columns hold huge garbage: masking must make it irrelevant.
    local = _local_from_full(logits.detach(), _col_info(info), (S, B, v_local), fill=1e4)
    local.requires_grad_()
    loss = sharded_cross_entropy(local, targets, group, VOCAB)
    loss.backward(gloss)
    denom = ref.detach().abs().max().item() if rel else 1.0
    errs = {
        "loss": _err(loss, ref.detach()) / denom,
        "dlogits": _piece_err(local.grad, logits.grad, _col_info(info)),
        "finite": 0.0 if torch.isfinite(loss).all() else float("inf"),
    }
    return errs, {"loss": loss, "dlogits": local.grad}


def _col_info(info):
    """A 1-D vocab ShardInfo applied to the last dim of [S, B, V] tensors."""

    class _Last:
        pairs = tuple(((Ellipsis, loc[0]), (Ellipsis, glob[0])) for loc, glob in info.pairs)

    return _Last


def _tied_head_case(group, mode, async_, g, dim=16):
    """Embedding -> tied LM head (column_linear on the embedding weight) -> sharded CE."""
    emb = TensorParallelEmbedding(VOCAB, dim, group, mode)
    ref = nn.Embedding(VOCAB, dim)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(VOCAB, dim, generator=g) * 0.5)
    copy_from_full_(emb.weight, ref.weight)
    ids = torch.randint(0, VOCAB, (S, B), generator=g)
    targets = torch.randint(0, VOCAB, (S, B), generator=g)
    w = torch.randn(S, B, generator=g)
    h = ref(ids)
    ref_loss = F.cross_entropy(F.linear(h, ref.weight).reshape(-1, VOCAB), targets.reshape(-1), reduction="none").view(
        S, B
    )
    (ref_loss * w).sum().backward()
    hidden = emb(ids)
    logits = column_linear(hidden, emb.weight, None, group, mode, async_)
    loss = sharded_cross_entropy(logits, targets, group, VOCAB)
    (loss * w).sum().backward()
    errs = {
        "loss": _err(loss, ref_loss.detach()),
        "dW": _piece_err(emb.weight.grad, ref.weight.grad, get_shard_info(emb.weight)),
        **_async_path(logits, group, async_, "ColumnLinearAsync"),
    }
    return errs, {"loss": loss, "dW": emb.weight.grad}


CASES = {
    "column": functools.partial(_column_case, in_f=16, out_f=24),
    "column_bias": functools.partial(_column_case, in_f=16, out_f=24, bias=True),
    # fused QKV, GQA: 8 query heads and 2 kv heads of head_dim 4 -> chunks (32, 8, 8)
    "column_qkv": functools.partial(_column_case, in_f=16, out_f=48, bias=True, chunks=(32, 8, 8)),
    "column_gate_up": functools.partial(_column_case, in_f=16, out_f=64, chunks=(32, 32)),
    "column_pad_head": functools.partial(_column_case, in_f=16, out_f=VOCAB, bias=True, pad=True),
    "row": functools.partial(_row_case, in_f=24, out_f=16),
    "row_bias": functools.partial(_row_case, in_f=24, out_f=16, bias=True),
    "embedding": _embedding_case,
    "tied_head": _tied_head_case,
}
MODE_FREE_CASES = {  # no mode/async dependence: run once per tp
    "cross_entropy": _cross_entropy_case,
    "cross_entropy_large_logits": functools.partial(_cross_entropy_case, scale=300.0, rel=True),
}


def _run_suite():
    import torch.distributed as dist

    from nanotrain.parallel.parallel_context import ParallelContext

    torch.set_num_threads(1)
    pc = ParallelContext(tensor_parallel_size=4)
    rank = dist.get_rank()
    tp2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    tp1 = [dist.new_group([r]) for r in range(4)][rank]
    groups = {1: tp1, 2: tp2, 4: pc.tp_pg}
    results = {}

    def record(key, fn, *args):
        try:
            errs, tensors = fn(*args)
        except Exception:
            results[key] = traceback.format_exc()
            return None
        results.update({f"{key}:{k}": v for k, v in errs.items()})
        return tensors

    for tp, group in groups.items():
        for name, fn in MODE_FREE_CASES.items():
            record(f"tp{tp}/{name}", fn, group, "ALL_REDUCE", False, torch.Generator().manual_seed(7))
        for mode in MODES:
            for i, name in enumerate(CASES):
                fn, seed = CASES[name], 1000 + 100 * tp + i  # same data on every rank
                sync = record(f"tp{tp}/{mode}/sync/{name}", fn, group, mode, False, torch.Generator().manual_seed(seed))
                asyn = record(f"tp{tp}/{mode}/async/{name}", fn, group, mode, True, torch.Generator().manual_seed(seed))
                if sync is not None and asyn is not None:
                    for k in sync:
                        results[f"tp{tp}/{mode}/async_vs_sync/{name}:{k}"] = _err(asyn[k], sync[k])
    pc.destroy()
    return results


# ----------------------------------------------------------------------------- pytest side
@functools.lru_cache(maxsize=None)
def _suite_results() -> dict:
    per_rank = run_distributed(_run_suite, 4, timeout=240)
    merged: dict = {}
    for rank, res in enumerate(per_rank):
        for key, value in res.items():
            if isinstance(value, str):
                merged.setdefault(key, f"rank {rank}:\n{value}")
            else:
                merged[key] = max(merged.get(key, 0.0), value)
    return merged


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", TP_SIZES)
def test_tp_layers_match_reference(tp):
    results = {k: v for k, v in _suite_results().items() if k.startswith(f"tp{tp}/")}
    crashed = {k: v for k, v in results.items() if isinstance(v, str)}
    assert not crashed, "cases raised:\n" + "\n".join(f"== {k}\n{v}" for k, v in crashed.items())
    bad = {k: v for k, v in results.items() if not v <= TOL}
    lines = "\n".join(f"  {k}: {v:.3g}" for k, v in sorted(bad.items()))
    assert not bad, f"tp={tp}: cases over {TOL}:\n{lines}"
    # Every (mode, async, case) ran: a silently skipped case is a failure too.
    expected = {f"tp{tp}/{m}/{a}/{n}" for m in MODES for a in ("sync", "async") for n in CASES}
    expected |= {f"tp{tp}/{n}" for n in MODE_FREE_CASES}
    seen = {k.split(":")[0] for k in results}
    assert expected <= seen, f"missing cases: {sorted(expected - seen)}"


# ----------------------------------------------------------------------------- ShardInfo (in-process)
def _sl(a, b):
    return slice(a, b)


def test_shard_info_fused_chunks_tp2():
    layer = TensorParallelColumnLinear(16, 48, GroupShape(2, 1), "ALL_REDUCE", bias=True, contiguous_chunks=(32, 8, 8))
    info = get_shard_info(layer.weight)
    assert layer.weight.shape == (24, 16) and info.global_shape == (48, 16) and info.axis == "tp"
    full16 = _sl(0, 16)
    assert info.pairs == (
        ((_sl(0, 16), full16), (_sl(16, 32), full16)),
        ((_sl(16, 20), full16), (_sl(36, 40), full16)),
        ((_sl(20, 24), full16), (_sl(44, 48), full16)),
    )
    binfo = get_shard_info(layer.bias)
    assert binfo.global_shape == (48,)
    assert [(loc[0], glob[0]) for loc, glob in binfo.pairs] == [
        (_sl(0, 16), _sl(16, 32)),
        (_sl(16, 20), _sl(36, 40)),
        (_sl(20, 24), _sl(44, 48)),
    ]


def test_shard_info_padding_excluded():
    head = TensorParallelColumnLinear(16, VOCAB, GroupShape(4, 3), "ALL_REDUCE", pad_to_tp=True)
    assert (head.out_features, head.padded_out_features, head.local_out_features) == (258, 260, 65)
    info = get_shard_info(head.weight)
    assert info.global_shape == (258, 16)
    assert info.pairs == (((_sl(0, 63), _sl(0, 16)), (_sl(195, 258), _sl(0, 16))),)
    emb = TensorParallelEmbedding(VOCAB, 8, GroupShape(4, 3), "REDUCE_SCATTER")
    assert (emb.padded_num_embeddings, emb.vocab_start, emb.vocab_end) == (260, 195, 260)
    assert get_shard_info(emb.weight).pairs == (((_sl(0, 63), _sl(0, 8)), (_sl(195, 258), _sl(0, 8))),)
    # A rank whose rows are all padding holds no piece at all.
    tiny = TensorParallelEmbedding(5, 8, GroupShape(4, 3), "ALL_REDUCE")
    assert tiny.padded_num_embeddings == 8 and get_shard_info(tiny.weight).pairs == ()


def test_shard_info_row_and_tp1():
    row = TensorParallelRowLinear(24, 16, GroupShape(2, 1), "REDUCE_SCATTER", bias=True)
    info = get_shard_info(row.weight)
    assert row.weight.shape == (16, 12) and info.global_shape == (16, 24)
    assert info.pairs == (((_sl(0, 16), _sl(0, 12)), (_sl(0, 16), _sl(12, 24))),)
    assert not get_shard_info(row.bias).is_sharded and has_sequence_parallel_partial_grad(row.bias)
    assert not has_sequence_parallel_partial_grad(
        TensorParallelRowLinear(24, 16, GroupShape(2, 1), "ALL_REDUCE", bias=True).bias
    )
    solo = TensorParallelColumnLinear(16, 48, GroupShape(1, 0), "ALL_REDUCE", contiguous_chunks=(32, 8, 8))
    assert not get_shard_info(solo.weight).is_sharded and solo.weight.shape == (48, 16)


def test_layer_argument_errors():
    with pytest.raises(ValueError, match="not divisible by tp"):
        TensorParallelColumnLinear(16, 30, GroupShape(4, 0), "ALL_REDUCE", contiguous_chunks=(24, 6))
    with pytest.raises(ValueError, match="pad_to_tp"):
        TensorParallelColumnLinear(16, 48, GroupShape(4, 0), "ALL_REDUCE", contiguous_chunks=(32, 16), pad_to_tp=True)
    with pytest.raises(ValueError, match="unknown tp mode"):
        TensorParallelRowLinear(16, 16, GroupShape(2, 0), "SEQUENCE")


def test_init_from_full_is_tp_invariant():
    """Seeded full-tensor init: the pieces of all tp=4 ranks reassemble to the tp=1 weights."""

    def build(rank, tp):
        layer = TensorParallelColumnLinear(16, 48, GroupShape(tp, rank), "ALL_REDUCE", contiguous_chunks=(32, 8, 8))
        gen = torch.Generator().manual_seed(3)  # same seed on every "rank"
        init_from_full_(layer.weight, lambda t: t.normal_(0, 0.02, generator=gen))
        return layer

    ref = build(0, 1).weight.detach()
    full = torch.full((48, 16), float("nan"))
    for rank in range(4):
        scatter_to_full(build(rank, 4).weight, full)
    assert torch.equal(full, ref)
    head = TensorParallelColumnLinear(16, VOCAB, GroupShape(4, 3), "ALL_REDUCE", pad_to_tp=True)
    head.weight.data.fill_(5.0)
    init_from_full_(head.weight, lambda t: t.fill_(1.0))
    assert head.weight[:63].eq(1).all() and head.weight[63:].eq(0).all()  # padding zeroed
