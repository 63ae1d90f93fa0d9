"""The two sides every row of ``vs_native.py`` compares: nanotrain's public pieces (``Ours``) and
the PyTorch-native stack doing the same training (``NativeFlat``: plain loop, DDP or DTensor TP;
``NativePipeline``: ``torch.distributed.pipelining`` with optional TP and FSDP2), plus the native
optimizer, clipping and loss helpers they share.

Kept in one module, apart from the harness and the jobs, so that the two implementations being
compared sit next to each other and can be checked for doing the same work.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING

from bench_common import MICRO_SEQS, MODEL, OPTIM, SEED, SEQ, Bench, micro_batches, model_args, optim_args

if TYPE_CHECKING:
    import torch


# ------------------------------------------------------------------------------ nanotrain side
class Ours:
    """nanotrain's public pieces, wired as nanotrain/training/trainer.py wires them."""

    def __init__(
        self,
        bench: Bench,
        dp=1,
        tp=1,
        pp=1,
        mode="ALL_REDUCE",
        engine="1f1b",
        v=1,
        micro=MICRO_SEQS,
        spec: dict = MODEL,
        pc=None,
        zero=0,
    ):
        from nanotrain.models.llama_parallelize import build_llama
        from nanotrain.optim import build_lr_scheduler, build_optimizer
        from nanotrain.parallel.data_parallel import BucketedGradSync
        from nanotrain.parallel.parallel_context import ParallelContext
        from nanotrain.parallel.pipeline_parallel import PipelineEngine

        self.bench, self.micro = bench, micro
        self.pc = pc or ParallelContext(tensor_parallel_size=tp, data_parallel_size=dp, pipeline_parallel_size=pp)
        self.args = model_args(spec)
        self.pp, self.v = pp, v
        self.model = build_llama(
            self.args, self.pc.tp_pg, mode=mode, pp_rank=self.pc.pp_rank, pp_size=pp, virtual_stages=v, seed=SEED
        )
        self.grad_sync = BucketedGradSync(list(self.model.parameters()), self.pc.dp_cp_pg)
        # The sync first: at ZeRO-1/2 the optimizer takes its partition from the sync's buckets.
        self.optimizer = build_optimizer(self.model.named_parameters(), optim_args(), self.pc.dp_cp_pg, zero_stage=zero)
        self.scheduler = build_lr_scheduler(self.optimizer, optim_args(), bench.total_steps)
        self.engine = PipelineEngine(engine, self.pc.pp_pg) if pp > 1 else None

    def step(self, i: int) -> float:
        from nanotrain.training.step import train_step

        micro = micro_batches(self.bench.batch(i), self.pc.dp_rank, self.pc.dp_size, self.micro)
        return train_step(
            self.model, micro, self.grad_sync, self.optimizer, self.scheduler, self.pc, OPTIM["clip_grad"], self.engine
        ).loss

    def layer_stages(self) -> dict[int, int]:
        """Virtual stage of every decoder layer (the split the model was cut by, computed for every
        rank from the config), for the native split."""
        from nanotrain.models.llama_arch import stage_blocks

        return {
            int(name.split(".")[1]): stage
            for stage, blocks in enumerate(stage_blocks(self.args, self.pp, self.v))
            for name in blocks
            if name.startswith("layers.")
        }


# ------------------------------------------------------------------------------- native side
def native_optimizer(modules, bench: Bench):
    import torch
    from native_llama import decay_groups

    from nanotrain.optim import build_lr_scheduler

    groups = [{"params": [], "weight_decay": OPTIM["weight_decay"]}, {"params": [], "weight_decay": 0.0}]
    for m in modules:
        for g, add in zip(groups, decay_groups(m, OPTIM["weight_decay"])):
            g["params"] += add["params"]
    opt = torch.optim.AdamW(groups, lr=OPTIM["lr"], betas=OPTIM["betas"], eps=OPTIM["eps"])
    return opt, build_lr_scheduler(opt, optim_args(), bench.total_steps)  # same LambdaLR factor


def native_clip_(params, max_norm: float, pp_group=None):
    """torchtitan's ``clip_grad_norm_``: the local (DTensor-aware) norm, squared-summed over pp.

    Gradients on different meshes (plain-TP norms are plain tensors; under FSDP2 + TP the norms
    live on the dp mesh, the projections on the dp x tp mesh) cannot share a foreach kernel, so
    the norm and the scaling run per mesh group, as torchtitan's does per parameter group."""
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    groups: dict = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    parts = []
    for ps in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in ps], 2.0)
        parts.append(n.full_tensor() if isinstance(n, DTensor) else n)
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts))
    if pp_group is not None:
        total = total**2
        dist.all_reduce(total, group=pp_group)
        total = total**0.5
    for ps in groups.values():
        torch.nn.utils.clip_grads_with_norm_(ps, max_norm, total)
    return total


def plain_loss(loss) -> "torch.Tensor":
    from torch.distributed.tensor import DTensor

    return loss.full_tensor() if isinstance(loss, DTensor) else loss


class NativeFlat:
    """No pipeline: a plain loop (ws 1), DDP (dp), or DTensor TP (+SP) with loss_parallel."""

    def __init__(self, bench: Bench, dp=1, tp=1, sequence_parallel=False, micro=MICRO_SEQS):
        import torch
        import torch.distributed as dist
        from native_llama import apply_tp, build_native
        from torch.distributed.device_mesh import init_device_mesh

        self.bench, self.micro, self.dp, self.tp = bench, micro, dp, tp
        self.model = build_native(model_args(), SEQ, SEED)
        self.ddp = False
        self.dp_rank = dist.get_rank() // tp if dist.is_initialized() else 0
        if tp > 1:
            mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
            apply_tp(self.model, mesh["tp"], sequence_parallel)
            if dp > 1:
                raise NotImplementedError("dp x tp natively needs FSDP2 (see Native3D)")
        elif dp > 1:
            self.model = torch.nn.parallel.DistributedDataParallel(self.model)
            self.ddp = True
        self.optimizer, self.scheduler = native_optimizer([self.model], bench)

    def step(self, i: int) -> float:
        import torch.distributed as dist
        from native_llama import cross_entropy
        from torch.distributed.tensor.parallel import loss_parallel

        micro = micro_batches(self.bench.batch(i), self.dp_rank, self.dp, self.micro)
        total = None
        with loss_parallel() if self.tp > 1 else nullcontext():
            for j, (x, y) in enumerate(micro):
                last = j == len(micro) - 1
                with nullcontext() if last or not self.ddp else self.model.no_sync():
                    loss = cross_entropy(self.model(x), y) / len(micro)
                    loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        native_clip_(list(self.model.parameters()), OPTIM["clip_grad"])
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        total = plain_loss(total)
        if self.dp > 1:  # the logged loss is the global batch's, as nanotrain's train_step returns
            dist.all_reduce(total)
            total = total / self.dp
        return total.item()


class NativePipeline:
    """``torch.distributed.pipelining``: manual split (the same layers per stage as nanotrain),
    ``PipelineStage`` per local stage, Schedule1F1B / ScheduleInterleaved1F1B; optionally DTensor
    TP and FSDP2 replicate/fully_shard per stage (the native 3D)."""

    def __init__(
        self,
        bench: Bench,
        layer_stages: dict[int, int],
        pp: int,
        v: int,
        m: int,
        dp=1,
        tp=1,
        dp_kind="replicate",
        schedule="1f1b",
    ):
        import torch
        import torch.distributed as dist
        from native_llama import apply_dp, apply_tp, build_native, cross_entropy, pipeline_stage_module
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleInterleaved1F1B

        self.bench, self.dp, self.tp, self.pp, self.m = bench, dp, tp, pp, m
        mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_group = mesh["pp"].get_group()
        self.dp_group = mesh["dp"].get_group() if dp > 1 else None
        pp_rank, self.dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
        full = build_native(model_args(), SEQ, SEED)
        num_stages = pp * v
        self.my_stages = [pp_rank + k * pp for k in range(v)]
        self.modules, stages = [], []
        for s in self.my_stages:
            layers = sorted(i for i, st in layer_stages.items() if st == s)
            module = pipeline_stage_module(full, layers, first=s == 0, last=s == num_stages - 1)
            if tp > 1:
                apply_tp(module, mesh["tp"], sequence_parallel=False)
            if dp > 1:
                apply_dp(module, mesh["dp"], dp_kind)
            self.modules.append(module)
            stages.append(PipelineStage(module, s, num_stages, torch.device("cpu"), group=self.pp_group))
        del full
        self.has_first, self.has_last = 0 in self.my_stages, num_stages - 1 in self.my_stages
        if schedule == "1f1b":
            self.schedule = Schedule1F1B(stages[0], n_microbatches=m, loss_fn=cross_entropy)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=m, loss_fn=cross_entropy)
        self.optimizer, self.scheduler = native_optimizer(self.modules, bench)
        self.params = [p for mod in self.modules for p in mod.parameters()]
        self.pp_last_rank = dist.get_global_rank(self.pp_group, pp - 1)

    def step(self, i: int) -> float:
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor.parallel import loss_parallel

        batch = self.bench.batch(i)
        per = batch.shape[0] // self.dp
        batch = batch[self.dp_rank * per : (self.dp_rank + 1) * per]
        x, y = batch[:, :-1], batch[:, 1:]
        losses: list = []
        with loss_parallel() if self.tp > 1 else nullcontext():
            if self.has_first:
                self.schedule.step(x, target=y if self.has_last else None, losses=losses)
            elif self.has_last:
                self.schedule.step(target=y, losses=losses)
            else:
                self.schedule.step()
        native_clip_(self.params, OPTIM["clip_grad"], self.pp_group if self.pp > 1 else None)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad()
        # The logged loss on every rank, as nanotrain's train_step returns it: mean over
        # micro-batches on the last stage, averaged over dp, broadcast along pp.
        if self.has_last:
            loss = torch.stack([plain_loss(x).detach() for x in losses]).mean().double()
            if self.dp_group is not None:
                dist.all_reduce(loss, group=self.dp_group)
                loss /= self.dp
        else:
            loss = torch.zeros((), dtype=torch.float64)
        dist.broadcast(loss, src=self.pp_last_rank, group=self.pp_group)
        return loss.item()
