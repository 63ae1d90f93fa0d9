"""ModelPart: this rank's part of a parallelized model, what the trainer, the engines, the
optimizer and the checkpoints are handed.

A plain model (``models/``) is cut and swapped by its family's parallelize plan; the part then
adds what only a parallel run needs, around the model's own three forward pieces
(``embed_tokens(ids)``, ``run_layers(hidden, names, positions)``, ``head(hidden, targets)``):

* its pipeline chunks (``forward(..., chunk=c)`` runs one, as the engines call it);
* the sequence layout: under context parallelism each rank keeps its zig-zag share of the ids
  and targets and rotates its tokens at their global positions; under sequence parallelism the
  hidden state between layers holds ``S / tp`` tokens while attention sees them all;
* document masking (``documents.py``): every chunk of every stage is handed the micro-batch's
  per-token document ids ``[B, S]`` (the whole window's, on every tp and cp rank) and derives the
  RoPE positions and the block-causal mask of the tokens its attention sees from them; under
  cp's balanced order (``parallelism.cp_balance: documents``) the micro-batch's token order
  ``[cp, S/cp]`` comes with them (``cp_order``) and picks this rank's ids, targets and queries;
* the compute dtype (autocast around the forward) and the message crossing stage boundaries.

Parameter names are the plain model's (``Adopting``): ``layers.7.attn.qkv.weight`` here too.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from nanotrain.parallel import accelerator
from nanotrain.parallel.context_parallel import ContextParallel, zigzag_table
from nanotrain.parallel.data_parallel.shard_params import param_gather_of
from nanotrain.parallel.documents import document_attention
from nanotrain.parallel.part.adopt import Adopting
from nanotrain.parallel.pipeline_parallel import MessageSpec, ModelChunk, is_tied_replica
from nanotrain.parallel.tensor_parallel import TensorParallelLinearMode, has_sequence_parallel_partial_grad


class ModelPart(Adopting):
    """``forward(input_ids [B, S], targets [B, S], hidden, chunk)`` runs one chunk: the hidden
    state for the next stage, or on the last stage the mean token loss (fp32 scalar; the logits
    without targets). Every cp rank is given the full ``[B, S]`` ids and targets, and with
    ``documents`` (document masking: per-token document ids ``[B, S]``) every chunk of every
    stage is given them too."""

    def __init__(
        self,
        model: nn.Module,
        chunks: tuple[ModelChunk, ...],
        *,
        cp: ContextParallel,
        sequence_shards: int = 1,
        mode: TensorParallelLinearMode = TensorParallelLinearMode.ALL_REDUCE,
        async_communication: bool = False,
        compute_dtype: Optional[torch.dtype] = None,
    ):
        super().__init__(model)
        self.chunks, self.cp, self.sequence_shards = chunks, cp, sequence_shards
        self.mode, self.async_communication = mode, async_communication
        self.compute_dtype = compute_dtype

    # ------------------------------------------------------------------ what the model is
    @property
    def args(self):
        return self.inner.args

    @property
    def moe_state(self):
        return self.inner.moe_state

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    def begin_step(self, microbatches: int) -> None:
        self.inner.begin_step(microbatches)

    def sequence_parallel_params(self) -> list[nn.Parameter]:
        """Params replicated over tp whose gradients are partial sums over tp (sequence shards
        under REDUCE_SCATTER, heads for the q/k norms): ``allreduce_sequence_parallel_grads_``."""
        return [p for p in self.parameters() if has_sequence_parallel_partial_grad(p)]

    def chunk_parameters(self, chunk: int) -> list[nn.Parameter]:
        """The parameters whose gradients the backward of ``chunk`` computes: those under its
        blocks, and a tied replica (the last stage's copy of the embedding, used by the head)
        with the last chunk; a parameter under no block of this rank goes with every chunk.
        ZeRO-2's gradient rounds (``data_parallel/shard_grads.py``) reduce exactly these."""
        cache = self.__dict__.setdefault("_chunk_parameters", {})
        if chunk not in cache:
            mine = self.chunks[chunk]
            out = []
            for name, p in self.named_parameters():
                owners = [c for c in self.chunks if any(name.startswith(b + ".") for b in c.blocks)]
                if owners:
                    keep = mine in owners
                elif is_tied_replica(p):
                    keep = mine.is_last
                else:
                    keep = True
                if keep:
                    out.append(p)
            cache[chunk] = out
        return cache[chunk]

    @property
    def residual_dtype(self) -> torch.dtype:
        """dtype of the hidden states between layers and stages: the compute dtype under
        autocast (bf16: half the activation memory and pipeline bytes, as Megatron and nanotron),
        else the parameters' dtype."""
        if self.compute_dtype not in (None, torch.float32):
            return self.compute_dtype
        return next(self.parameters()).dtype

    def pipeline_message(self, micro_batch_size: int, sequence_length: int) -> MessageSpec:
        """What crosses every pipeline stage boundary for micro-batches of ``[B, S]`` tokens:
        this rank's hidden state ``[S / cp (/ tp under sequence parallelism), B, H]``."""
        seq = sequence_length // self.cp.size // self.sequence_shards
        return MessageSpec((seq, micro_batch_size, self.args.hidden_size), self.residual_dtype)

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        hidden: torch.Tensor | None = None,
        chunk: int = 0,
        documents: torch.Tensor | None = None,
        cp_order: torch.Tensor | None = None,
    ) -> torch.Tensor:
        device = self.device
        _check_input("input_ids", input_ids, device, integer=True)
        _check_input("targets", targets, device, integer=True)
        _check_input("hidden", hidden, device, integer=False)
        _check_input("documents", documents, device, integer=True)
        _check_input("cp_order", cp_order, device, integer=True)
        if self.compute_dtype in (None, torch.float32):
            return self._forward(input_ids, targets, hidden, chunk, documents, cp_order)
        with accelerator.autocast(device.type, dtype=self.compute_dtype):
            return self._forward(input_ids, targets, hidden, chunk, documents, cp_order)

    def _forward(self, input_ids, targets, hidden, chunk: int, documents, cp_order) -> torch.Tensor:
        part, model = self.chunks[chunk], self.inner
        order = self._order(documents, cp_order)
        gather = self._param_gather()  # ZeRO-3 (None below): hooks the layers on the first forward
        if part.is_first:
            ids = self.cp.local(input_ids, order=order)
            hidden = _gathered(gather, (model.embed,), model.embed_tokens, ids, backward_reads=False)
            hidden = hidden.to(self.residual_dtype)
        layers = [name.split(".", 1)[1] for name in part.blocks if name.startswith("layers.")]
        kernel = model.args.attention_kernel
        if documents is None:
            hidden = model.run_layers(hidden, layers, self._positions(hidden))
        elif order is not None:  # balanced: this rank's queries over the keys in gather order
            attention = document_attention(documents, order[self.cp.rank], order.reshape(-1), kernel)
            hidden = model.run_layers(hidden, layers, *attention)
        else:  # the queries attention sees: the whole window's (tp, both modes) or this cp rank's
            queries = self.cp.positions(documents.shape[1], documents.device) if self.cp.enabled else None
            hidden = model.run_layers(hidden, layers, *document_attention(documents, queries, kernel=kernel))
        if not part.is_last:
            return hidden
        targets = None if targets is None else self.cp.local(targets, order=order)
        return _gathered(gather, (model.final_norm, model.lm_head), model.head, hidden, targets, keep=True)

    # ------------------------------------------------------------------ ZeRO-3
    def _param_gather(self):
        """The optimizer's ParamGather at ZeRO-3 (None below), hooked on first use around every
        decoder layer this rank holds, with each pipeline chunk's units as its prefetch order."""
        ref = self.__dict__.get("_gather_ref")
        gather = ref() if ref is not None else None
        if gather is not None:
            return gather
        # The first parameter is a dense one (an embedding or a layer's norm), sharded whenever any
        # parameter is (dense replicas dp x cp x ep >= an expert's dp x cp): one lookup per forward.
        gather = param_gather_of(next(self.parameters()))
        if gather is None:
            return None
        gather.set_chunks([gather.units_of(self.chunk_parameters(c)) for c in range(len(self.chunks))])
        gref = weakref.ref(gather)
        for name in gather.units:
            if name.startswith("layers."):
                layer, unit = self.inner.layers[name.split(".", 1)[1]], [name]
                # A hook outliving its gather (another optimizer built for this model) does
                # nothing. Never traced (compiled layers run their hooks inside the compiled
                # call): a traced hook would keep the gather, and its process groups, in the
                # compiled code's guards for good.
                before = torch.compiler.disable(lambda m, a, unit=unit: (g := gref()) and g.before_forward(unit))
                after = torch.compiler.disable(
                    lambda m, a, out, unit=unit: (g := gref()) and g.after_forward(unit, out)
                )
                layer.register_forward_pre_hook(before)
                layer.register_forward_hook(after)
        self.__dict__["_gather_ref"] = gref
        return gather

    def _order(self, documents, cp_order) -> torch.Tensor | None:
        """The micro-batch's token order ``[cp, S/cp]`` under cp's balanced order (zig-zag's table
        when none came with the batch, e.g. an evaluation batch), else None (zig-zag positions)."""
        if not self.cp.balanced:
            return None
        if documents is None:
            raise ValueError("parallelism.cp_balance 'documents' needs data.document_masking")
        if cp_order is None:
            return zigzag_table(documents.shape[1], self.cp.size, documents.device)
        return cp_order

    def _positions(self, hidden: torch.Tensor) -> torch.Tensor:
        """Global positions of the tokens attention sees on this rank: the whole sequence's
        (hidden holds ``S / cp / sequence_shards`` of them), or its cp share."""
        seq = hidden.shape[0] * self.sequence_shards * self.cp.size
        if self.cp.enabled:
            return self.cp.positions(seq, hidden.device)
        return self.inner.default_positions(seq, hidden.device)


def _gathered(gather, modules, fn, *args, backward_reads: bool = True, keep: bool = False):
    """``fn(*args)`` with the full weights of ``modules`` (ZeRO-3: their units gathered for it by
    ``gather``, ``data_parallel/shard_params.py``, whose ``after_forward`` says what
    ``backward_reads`` and ``keep`` do; without one, just the call)."""
    if gather is None:
        return fn(*args)
    names = gather.units_of(p for m in modules for p in m.parameters())
    gather.before_forward(names)
    out = fn(*args)
    gather.after_forward(names, out, backward_reads, keep)
    return out


def _check_input(name: str, tensor: torch.Tensor | None, device: torch.device, integer: bool) -> None:
    """The model's entry contract (host metadata only, no sync): inputs already on the model's
    device — on a GPU a CPU batch would otherwise fail deep inside an embedding or the loss."""
    if tensor is None:
        return
    if tensor.device != device:
        raise RuntimeError(
            f"LlamaModel: {name} is on {tensor.device}, the model on {device}; move "
            f"batches to the device first (the trainer's BatchPrefetcher does)"
        )
    if integer and tensor.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"LlamaModel: {name} must be int64/int32 token ids, got {tensor.dtype}")
