"""GPU checks (marker ``gpu``; skipped cleanly without CUDA). Run by benchmarks/gpu_check.sh:

    python -m pytest -q -m gpu tests/test_gpu.py

* NCCL process group at world size 1 through ``ParallelContext`` (in a subprocess, so no process
  group leaks into other tests);
* every parameter, buffer and gradient of the model on the CUDA device;
* bf16 autocast forward/backward: bf16 matmuls, fp32 loss, fp32 weights and gradients;
* a tiny (1,1,1) training step on the GPU gives the CPU's losses (fp32: tight; bf16: loose).
* the trainer's batch prefetcher copies batches to the GPU unchanged;
* an async save's pinned, side-stream host copies hold the step boundary's values;
* a checkpoint's fused AdamW state, loaded through nanotrain's loader, sits on the device and
  takes the uninterrupted optimizer's next step exactly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

TINY = dict(
    vocab_size=256,
    hidden_size=128,
    intermediate_size=512,
    num_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    dtype="bfloat16",
)


def _model(device, compute_dtype=None, seed=0):
    from nanotrain.config import ModelArgs
    from nanotrain.models.llama_parallelize import build_llama

    return build_llama(ModelArgs(**TINY), None, seed=seed, device=device, compute_dtype=compute_dtype)


def _batch(n=4, seq=64):
    ids = torch.randint(0, TINY["vocab_size"], (n, seq + 1), generator=torch.Generator().manual_seed(0))
    return ids[:, :-1], ids[:, 1:]


def test_nccl_parallel_context_world_size_1(tmp_path):
    script = textwrap.dedent("""
        import torch, torch.distributed as dist
        from nanotrain.parallel.parallel_context import ParallelContext
        pc = ParallelContext()
        assert pc.backend == "nccl", pc.backend
        assert pc.device.type == "cuda", pc.device
        t = torch.ones(4, device=pc.device)
        dist.all_reduce(t, group=pc.dp_pg)
        dist.all_reduce(t, group=pc.tp_pg)
        dist.barrier()
        assert t.tolist() == [1.0] * 4
        assert dist.get_process_group_ranks(pc.tp_pg) == [0] and pc.world_size == 1
        pc.destroy()
        print("OK", torch.cuda.get_device_name(pc.device))
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(29400 + os.getpid() % 500),
        PYTHONPATH=str(ROOT),
    )
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_model_placed_on_cuda():
    model = _model("cuda")
    tensors = list(model.named_parameters()) + list(model.named_buffers())
    assert tensors
    off = [name for name, t in tensors if t.device.type != "cuda"]
    assert not off, f"not on CUDA: {off}"
    ids, targets = (t.cuda() for t in _batch())
    model(ids, targets).backward()
    assert all(p.grad is not None and p.grad.device.type == "cuda" for p in model.parameters())


def test_bf16_autocast_forward_backward_keeps_fp32_weights_and_grads():
    model = _model("cuda", compute_dtype=torch.bfloat16)
    seen = []
    hook = model.layers["0"].attn.qkv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    ids, targets = (t.cuda() for t in _batch())
    loss = model(ids, targets)
    hook.remove()
    assert seen == [torch.bfloat16], "the projections must run in bf16 under autocast"
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    for name, p in model.named_parameters():
        assert p.dtype == torch.float32, name
        assert p.grad is not None and p.grad.dtype == torch.float32 and torch.isfinite(p.grad).all(), name
    reference = _model("cuda")(ids, targets)  # fp32 on GPU
    assert abs(loss.item() - reference.item()) / reference.item() < 2e-2


def _train(device, compute_dtype, steps=3):
    from nanotrain.config import OptimizerArgs
    from nanotrain.optim import build_lr_scheduler, build_optimizer
    from nanotrain.parallel.data_parallel import BucketedGradSync
    from nanotrain.training.step import forward_backward, optimizer_step

    class OneProcess:  # what optimizer_step reads of a ParallelContext at (1,1,1): None groups = one process
        tp_pg = mp_pg = embedding_pg = None
        tp_rank = ep_rank = 0
        pp_size = 1

    torch.backends.cuda.matmul.allow_tf32 = False
    model = _model(device, compute_dtype)
    opt_args = OptimizerArgs(lr=1e-3, warmup_steps=0, lr_decay_style="constant", clip_grad=1.0)
    sync = BucketedGradSync(list(model.parameters()), None)
    optimizer = build_optimizer(model.named_parameters(), opt_args)
    scheduler = build_lr_scheduler(optimizer, opt_args, steps)
    ids, targets = _batch(8)
    micro = [(ids[:4].to(device), targets[:4].to(device)), (ids[4:].to(device), targets[4:].to(device))]
    losses = []
    for _ in range(steps):
        losses.append(forward_backward(model, micro, sync).item())
        optimizer_step(model, sync, optimizer, scheduler, OneProcess(), opt_args.clip_grad)
    return losses


def test_train_step_on_gpu_matches_cpu():
    cpu = _train("cpu", None)
    gpu = _train("cuda", None)
    bf16 = _train("cuda", torch.bfloat16)
    assert all(abs(a - b) / a < 1e-4 for a, b in zip(cpu, gpu)), (cpu, gpu)
    assert all(abs(a - b) / a < 3e-2 for a, b in zip(cpu, bf16)), (cpu, bf16)
    assert gpu[-1] < gpu[0] and bf16[-1] < bf16[0]


def test_batch_prefetcher_copies_to_cuda_ahead():
    """The trainer's batches reach the GPU (pinned, non_blocking, on a side stream) unchanged."""
    from nanotrain.data import BatchPrefetcher

    class Sampler:
        def batch(self, consumed, dp_rank):
            ids = torch.arange(consumed, consumed + 64).view(2, 32)
            return [(ids, ids + 1)]

    prefetcher = BatchPrefetcher(Sampler(), 0, torch.device("cuda", torch.cuda.current_device()))
    prefetcher.prefetch(64)
    for consumed in (64, 128):  # prefetched, then fetched on demand
        ids, targets = prefetcher.get(consumed)[0]
        assert ids.is_cuda and targets.is_cuda
        assert torch.equal(ids.cpu(), torch.arange(consumed, consumed + 64).view(2, 32))


def test_background_save_of_cuda_state_holds_the_step_boundary(tmp_path):
    """An async save's host copies of CUDA parameters and AdamW states (pinned buffers, a side
    stream) hold the step boundary's values even when the update runs right after
    ``wait_snapshot()``, with the next step's kernels queued behind the copies."""
    from nanotrain.checkpoint import begin_save, load_checkpoint
    from nanotrain.config import OptimizerArgs
    from nanotrain.optim import build_optimizer

    def step(model, opt):
        ids, targets = (t.cuda() for t in _batch())
        model(ids, targets).backward()
        opt.step()
        opt.zero_grad()

    model = _model("cuda")
    opt = build_optimizer(model.named_parameters(), OptimizerArgs(lr=1e-2), zero_stage=0)
    for save_step in (1, 2):
        step(model, opt)
        want = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        pending = begin_save(tmp_path / "ck", save_step, model, opt, background=True)
        ids, targets = (t.cuda() for t in _batch())
        model(ids, targets).backward()  # the next step's forward and backward beside the copies
        pending.wait_snapshot()
        opt.step()
        opt.zero_grad()
        pending.finish()
        fresh = _model("cuda", seed=3)
        load_checkpoint(tmp_path / "ck", fresh, path=tmp_path / "ck" / f"step_{save_step:06d}")
        for n, p in fresh.named_parameters():
            assert torch.equal(p.detach().cpu(), want[n]), (save_step, n)


def test_resumed_fused_adamw_state_is_on_the_device_and_steps_as_uninterrupted(tmp_path):
    """On CUDA the AdamW is fused, and the fused kernel reads every state tensor, ``step``
    included, through a device pointer that nothing checks (gpu-review.md section 1): after a
    resume each must sit where torch's own load_state_dict puts it (the parameter's device), and
    the next update must equal the uninterrupted optimizer's bit for bit. The placement is
    asserted before any step, so a host tensor fails here instead of as an illegal memory access
    that would take the CUDA context of every later test with it."""
    from nanotrain.checkpoint import load_checkpoint, save_checkpoint
    from nanotrain.config import OptimizerArgs
    from nanotrain.optim import build_lr_scheduler, build_optimizer

    args = OptimizerArgs(lr=1e-2, warmup_steps=0, lr_decay_style="constant")

    def build(seed):
        model = _model("cuda", seed=seed)
        opt = build_optimizer(model.named_parameters(), args, zero_stage=0)
        return model, opt, build_lr_scheduler(opt, args, 100)

    model, opt, sched = build(0)
    assert all(g.get("fused") for g in opt.param_groups), "nanotrain's AdamW on CUDA is fused"
    ids, targets = (t.cuda() for t in _batch())
    for _ in range(2):
        model(ids, targets).backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    save_checkpoint(tmp_path / "ck", 2, model, opt, sched)
    fresh, fresh_opt, fresh_sched = build(3)
    load_checkpoint(tmp_path / "ck", fresh, fresh_opt, fresh_sched)
    for name, p in fresh.named_parameters():
        for key, value in fresh_opt.state[p].items():
            assert value.device == p.device, f"{name} {key} on {value.device}, the fused kernel reads it on {p.device}"
    model(ids, targets).backward()
    for p, q in zip(model.parameters(), fresh.parameters()):  # the same gradients: only the optimizer differs
        q.grad = p.grad.clone()
    opt.step()
    fresh_opt.step()
    torch.cuda.synchronize()
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(p, q), name
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][key], fresh_opt.state[q][key]), (name, key)
