"""The Llama's arithmetic in one place: its pipeline blocks and what each costs and holds.

Everything that reasons about the model without running it reads this module: the stage split
(the pipeline step keeps each rank's ``pipeline_blocks``), the parameter count of every (tp, pp,
ep) rank, the FLOPs behind MFU (``logging``), the ``--dry-run`` memory estimate
(``estimate/memory.py``). A new block type is described here once: its cost, its parameters per
tp rank and its FLOPs (what the parallelize plan's options cost is ``llama_parallelize_costs``).

Pure Python on the config (no torch), so a 4096-rank plan is estimated before torch is imported.
``tests/test_llama_arch.py`` holds these numbers against the real model on every stage for
several (tp, pp, tied, padded vocabulary) layouts. MoE layers: FLOPs and the stage split's costs
count the *active* weights (router, top_k experts, shared experts), parameter counts all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from nanotrain.config import ModelArgs
from nanotrain.parallel.stage_split import Attach, split_stages


# ----------------------------------------------------------------------------- shapes
def head_dim(args: ModelArgs) -> int:
    """Features per attention head: ``model.head_dim``, default ``hidden_size / num_attention_heads``
    (Qwen3 sets it apart: its query features ``heads * head_dim`` need not equal the hidden size)."""
    return args.head_dim or args.hidden_size // args.num_attention_heads


def query_features(args: ModelArgs) -> int:
    """Width of the attention's query (and of o_proj's input): ``heads * head_dim``."""
    return args.num_attention_heads * head_dim(args)


def kv_heads(args: ModelArgs) -> int:
    """``num_key_value_heads``, which defaults to one per query head (plain multi-head attention)."""
    return args.num_key_value_heads or args.num_attention_heads


def vocab_rows_per_rank(args: ModelArgs, tp: int) -> int:
    """Rows of the embedding / LM head on one tp rank: the vocabulary padded up to a multiple of
    tp (the padding rows are never saved and never predicted, but they are parameters)."""
    return -(-args.vocab_size // tp)


def expert_ffn(args: ModelArgs) -> int:
    """SwiGLU width of one expert: ``moe.expert_intermediate_size``, default the dense width."""
    return (args.moe.expert_intermediate_size or args.intermediate_size) if args.moe else args.intermediate_size


def is_moe_layer(args: ModelArgs, index: int) -> bool:
    """Layer ``index`` is MoE: past ``first_dense_layers``, every ``layer_frequency``-th."""
    moe = args.moe
    return (
        moe is not None
        and index >= moe.first_dense_layers
        and (index - moe.first_dense_layers) % moe.layer_frequency == 0
    )


def moe_layer_indices(args: ModelArgs) -> list[int]:
    """The MoE layers (``is_moe_layer``), as a range: ``--plan`` asks for every layout it scores."""
    moe = args.moe
    return [] if moe is None else list(range(moe.first_dense_layers, args.num_layers, moe.layer_frequency))


def _per_rank(features: int, tp: int, what: str) -> int:
    """``features / tp``, refused when the tensor-parallel layers could not shard them evenly."""
    if features % tp:
        raise ValueError(f"{what} ({features}) is not divisible by tp ({tp})")
    return features // tp


# ----------------------------------------------------------------------------- blocks
@dataclass(frozen=True)
class Block:
    """One pipeline block of ``LlamaModel`` (a top-level module or a decoder layer), in model order.

    ``name`` is the prefix of its parameters' names (``layers.7``); ``cost`` is its forward FLOPs
    per token, what the stage split balances (backward scales every block alike); ``attach``
    glues it to a neighbour's stage (the embedding to the first layer, the head to the last)."""

    name: str
    cost: int
    attach: Attach = None

    @property
    def kind(self) -> str:
        """``embed``, ``layers``, ``final_norm`` or ``lm_head``: what decides its parameters."""
        return self.name.split(".", 1)[0]


def block_costs(args: ModelArgs) -> dict[str, int]:
    """Forward FLOPs per token of each pipeline block (backward scales them all alike), for the
    stage split: a decoder layer's projections and attention (full-length sequences assumed; an
    MoE layer's active weights only), the LM head's vocab projection, the embedding's lookup (a
    copy of H values). ``layer`` is a dense layer, ``moe_layer`` an MoE one."""
    h = args.hidden_size
    attention = 4 * args.max_position_embeddings * query_features(args)
    layer = 2 * layer_matmul_parameters(args) + attention
    moe_layer = 2 * layer_matmul_parameters(args, moe=True) + attention if args.moe else layer
    return {"embed": h, "layer": layer, "moe_layer": moe_layer, "head": 2 * h * args.vocab_size}


def pipeline_blocks(args: ModelArgs) -> list[Block]:
    """The blocks of ``LlamaModel``, in order: embed, layers.0..L-1, final_norm, lm_head
    (untied only). The whole head (norm, vocab projection, loss) is charged to final_norm, tied or
    not, so a tied and an untied model split alike."""
    cost = block_costs(args)
    blocks = [Block("embed", cost["embed"], attach="next")]
    blocks += [
        Block(f"layers.{i}", cost["moe_layer" if is_moe_layer(args, i) else "layer"]) for i in range(args.num_layers)
    ]
    blocks.append(Block("final_norm", cost["head"], attach="prev"))
    if not args.tie_word_embeddings:
        blocks.append(Block("lm_head", 0, attach="prev"))
    return blocks


def stage_blocks(args: ModelArgs, pp: int = 1, virtual_stages: int = 1) -> list[list[str]]:
    """Block names of each virtual stage, exactly as ``place_stages`` places them (stage ``s`` on
    pp rank ``s % pp``)."""
    blocks = pipeline_blocks(args)
    stages = split_stages([b.cost for b in blocks], [b.attach for b in blocks], pp, virtual_stages if pp > 1 else 1)
    return [[blocks[i].name for i in stage] for stage in stages]


def rank_blocks(args: ModelArgs, pp: int = 1, rank: int = 0, virtual_stages: int = 1) -> list[str]:
    """Blocks built on one pp rank: those of its chunks, plus — tied and pp > 1 — the embedding's
    replica that the last stage builds to serve as its LM head (``pipeline_parallel/tied.py``)."""
    return list(every_rank_blocks(args, pp, virtual_stages)[rank])


_MEMO: dict[tuple, object] = {}  # (what, _split_key) -> every_rank_blocks / rank_summaries / distinct_ranks


def _split_key(args: ModelArgs, pp: int, virtual_stages: int) -> tuple:
    """What the stage split of ``args`` depends on (``pipeline_blocks``: the blocks' kinds and
    costs), cheaper to build than ``repr(args)`` when ``--plan`` asks thousands of times."""
    return (
        args.num_layers,
        args.hidden_size,
        args.intermediate_size,
        args.num_attention_heads,
        args.num_key_value_heads,
        args.vocab_size,
        args.max_position_embeddings,
        args.tie_word_embeddings,
        args.head_dim,
        args.qkv_bias,
        args.qk_norm,
        repr(args.moe) if args.moe else None,
        pp,
        virtual_stages,
    )


def _memoised(what: str, args: ModelArgs, pp: int, virtual_stages: int, build):
    """``build()``, once per (``what``, split key): ``--plan`` asks for the same model's split at
    every candidate layout. Callers must not modify what it returns."""
    key = (what, _split_key(args, pp, virtual_stages))
    if key not in _MEMO:
        if len(_MEMO) > 3072:
            _MEMO.clear()
        _MEMO[key] = build()
    return _MEMO[key]


@dataclass(frozen=True)
class RankSummary:
    """What one pp rank holds, as planning counts it: its decoder layers (their indices), how
    many of them are MoE, and its other blocks (embed, final_norm, lm_head)."""

    layers: tuple[int, ...]
    moe_layers: int
    others: tuple[str, ...]
    first_dense: Optional[int] = None  # a dense and an MoE layer of this rank (their sizes)
    first_moe: Optional[int] = None


def rank_summaries(args: ModelArgs, pp: int = 1, virtual_stages: int = 1) -> list[RankSummary]:
    """``RankSummary`` of every pp rank (memoised)."""

    def build():
        out = []
        for names in every_rank_blocks(args, pp, virtual_stages):
            layers = tuple(int(n.split(".")[1]) for n in names if n.startswith("layers."))
            kinds = [bool(args.moe) and is_moe_layer(args, i) for i in layers]
            out.append(
                RankSummary(
                    layers,
                    sum(kinds),
                    tuple(n for n in names if not n.startswith("layers.")),
                    next((i for i, k in zip(layers, kinds) if not k), None),
                    next((i for i, k in zip(layers, kinds) if k), None),
                )
            )
        return out

    return _memoised("summaries", args, pp, virtual_stages, build)


def rank_parameters(args: ModelArgs, rank: RankSummary, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(all, routed-expert) parameters of one (tp, ep) rank holding ``rank``'s blocks."""
    total = sum(block_parameters(args, n, tp, ep) for n in rank.others)
    if rank.first_dense is not None:
        total += (len(rank.layers) - rank.moe_layers) * layer_parameters(args, tp, rank.first_dense, ep)
    if rank.first_moe is not None:
        total += rank.moe_layers * layer_parameters(args, tp, rank.first_moe, ep)
    return total, rank.moe_layers * routed_expert_parameters(args, ep) if args.moe else 0


def every_rank_blocks(args: ModelArgs, pp: int = 1, virtual_stages: int = 1) -> list[list[str]]:
    """``rank_blocks`` of every pp rank, from one stage split (memoised)."""
    return _memoised("blocks", args, pp, virtual_stages, lambda: _every_rank_blocks(args, pp, virtual_stages))


def distinct_ranks(args: ModelArgs, pp: int = 1, virtual_stages: int = 1) -> list[int]:
    """The pp ranks whose blocks can differ in what planning asks of them: the first of each run
    of ranks holding the same count of (dense, MoE) layers and the same other blocks (a later
    one holds no more micro-batches in flight and sends no more), and the last. Memoised."""

    def build():
        out, seen = [], set()
        for r, rank in enumerate(rank_summaries(args, pp, virtual_stages)):
            shape = (len(rank.layers), rank.moe_layers, rank.others)
            if shape not in seen or r == pp - 1:
                seen.add(shape)
                out.append(r)
        return out

    return _memoised("distinct", args, pp, virtual_stages, build)


def _every_rank_blocks(args: ModelArgs, pp: int, virtual_stages: int) -> list[list[str]]:
    stages = stage_blocks(args, pp, virtual_stages)
    out = []
    for rank in range(pp):
        names = [name for s in range(rank, len(stages), pp) for name in stages[s]]
        if args.tie_word_embeddings and pp > 1 and "final_norm" in names and "embed" not in names:
            names.append("embed")
        out.append(names)
    return out


# ----------------------------------------------------------------------------- parameters
def layer_matmul_parameters(args: ModelArgs, moe: bool = False) -> int:
    """Weights of one unsharded decoder layer that multiply every token: qkv, o_proj and the
    dense gate/up/down, or (``moe``) the router, top_k experts and the shared experts (not the
    qkv bias or the norms: they are added, not multiplied, ``layer_vector_parameters``)."""
    h = args.hidden_size
    q_out, kv_out = query_features(args), kv_heads(args) * head_dim(args)
    attention = h * (q_out + 2 * kv_out) + q_out * h
    if not moe:
        return attention + 3 * h * args.intermediate_size
    m, ffn = args.moe, expert_ffn(args)
    return attention + m.num_experts * h + (m.top_k + m.num_shared_experts) * 3 * h * ffn


def layer_vector_parameters(args: ModelArgs, tp: int = 1) -> int:
    """One decoder layer's one-dimensional parameters on one tp rank: the two RMSNorm weights
    (replicated), the qkv bias (``qkv_bias``: split over tp with its rows, 1/tp of q, k and v)
    and the q/k norms (``qk_norm``: one head's width each, replicated: every head shares them)."""
    out = 2 * args.hidden_size
    if args.qkv_bias:
        kv_out = kv_heads(args) * head_dim(args)
        out += _per_rank(query_features(args), tp, "query features") + 2 * _per_rank(kv_out, tp, "key/value features")
    if args.qk_norm:
        out += 2 * head_dim(args)
    return out


def layer_parameters(args: ModelArgs, tp: int = 1, index: int | None = None, ep: int = 1) -> int:
    """One decoder layer on one (tp, ep) rank: fused qkv and gate/up (column), o_proj and down
    (row), each 1/tp; its vectors (``layer_vector_parameters``). Layer ``index`` MoE: the router
    (replicated), E/ep routed experts (not split over tp) and the shared experts (1/tp)."""
    h, ffn = args.hidden_size, args.intermediate_size
    q_out, kv_out = query_features(args), kv_heads(args) * head_dim(args)
    qkv = h * (_per_rank(q_out, tp, "query features") + 2 * _per_rank(kv_out, tp, "key/value features"))
    o_proj = _per_rank(q_out, tp, "query features") * h
    vectors = layer_vector_parameters(args, tp)
    if index is not None and is_moe_layer(args, index):
        m, effn = args.moe, expert_ffn(args)
        experts = routed_expert_parameters(args, ep)
        shared = 3 * h * _per_rank(m.num_shared_experts * effn, tp, "shared expert features")
        return qkv + o_proj + m.num_experts * h + experts + shared + vectors
    mlp = 3 * h * _per_rank(ffn, tp, "model.intermediate_size")  # gate and up (fused), down
    return qkv + o_proj + mlp + vectors


def routed_expert_parameters(args: ModelArgs, ep: int = 1) -> int:
    """One MoE layer's routed experts on one ep rank: E/ep SwiGLUs (gate, up, down) of the expert
    width, not split over tp; the parameters ZeRO-1 shards over dp x cp only."""
    m = args.moe
    return _per_rank(m.num_experts, ep, "model.moe.num_experts") * 3 * args.hidden_size * expert_ffn(args)


def block_parameters(args: ModelArgs, name: str, tp: int = 1, ep: int = 1) -> int:
    """Parameters of the block ``name`` (a ``Block.name``) on one (tp, ep) rank (the only bias is
    the optional qkv one, counted with its layer)."""
    kind = name.split(".", 1)[0]
    if kind in ("embed", "lm_head"):  # vocab-parallel rows, padded
        return vocab_rows_per_rank(args, tp) * args.hidden_size
    if kind == "layers":
        return layer_parameters(args, tp, int(name.split(".")[1]), ep)
    if kind == "final_norm":
        return args.hidden_size
    raise ValueError(f"unknown block {name!r}")


def stage_parameters(
    args: ModelArgs, tp: int = 1, pp: int = 1, rank: int = 0, virtual_stages: int = 1, ep: int = 1
) -> int:
    """``sum(p.numel() for p in model.parameters())`` of the model on one (tp, pp, ep) rank,
    tied replica included; every tp rank of a stage holds the same count (padding is even)."""
    return sum(block_parameters(args, name, tp, ep) for name in rank_blocks(args, pp, rank, virtual_stages))


@dataclass(frozen=True)
class ParamCount:
    """Parameters of the unsharded model, split the way the FLOP count needs them."""

    embedding: int
    per_layer_matmul: int  # qkv + o_proj + gate/up/down of one dense decoder layer
    per_layer_vector: int  # one decoder layer's norms and qkv bias (``layer_vector_parameters``)
    num_layers: int
    final_norm: int
    lm_head: int  # 0 when tied to the embedding
    moe_layers: int = 0  # how many of num_layers are MoE
    moe_layer_matmul: int = 0  # an MoE layer's weights: attention, router, all experts, shared
    moe_layer_active: int = 0  # an MoE layer's weights a token multiplies (top_k experts)

    @property
    def total(self) -> int:
        """What `sum(p.numel() for p in model.parameters())` gives at tp=1 (tied weights once)."""
        dense = self.num_layers - self.moe_layers
        return (
            self.embedding
            + dense * self.per_layer_matmul
            + self.moe_layers * self.moe_layer_matmul
            + self.num_layers * self.per_layer_vector
            + self.final_norm
            + self.lm_head
        )

    @property
    def active(self) -> int:
        """Parameters one token uses: ``total`` with only top_k of the routed experts."""
        return self.total - self.moe_layers * (self.moe_layer_matmul - self.moe_layer_active)

    @property
    def matmul(self) -> int:
        """N_matmul of ``training_flops_per_token``: layer matmuls (MoE: active) plus the (possibly tied) head."""
        head = self.lm_head or self.embedding
        dense = self.num_layers - self.moe_layers
        return dense * self.per_layer_matmul + self.moe_layers * self.moe_layer_active + head


def parameter_count(args: ModelArgs) -> ParamCount:
    """The unsharded model (tp = pp = ep = 1), from the same per-block counts as every stage."""
    vectors = layer_vector_parameters(args)
    embedding = block_parameters(args, "embed")
    moe = moe_layer_indices(args)
    return ParamCount(
        embedding=embedding,
        per_layer_matmul=layer_matmul_parameters(args),
        per_layer_vector=vectors,
        num_layers=args.num_layers,
        final_norm=block_parameters(args, "final_norm"),
        lm_head=0 if args.tie_word_embeddings else block_parameters(args, "lm_head"),
        moe_layers=len(moe),
        moe_layer_matmul=layer_parameters(args, 1, moe[0]) - vectors if moe else 0,
        moe_layer_active=layer_matmul_parameters(args, moe=True) if moe else 0,
    )


# ----------------------------------------------------------------------------- FLOPs
def attention_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """12 * L * H * S: QK^T and AV, forward + backward, full S x S: an upper bound of the causal and
    the document-masked (``data.document_masking``) work; H the query features ``heads * head_dim``."""
    return 12 * args.num_layers * query_features(args) * seq_len


def training_flops_per_token(args: ModelArgs, seq_len: int) -> int:
    """Model FLOPs of one training token (forward + backward), in the PaLM convention (Chowdhery et
    al. 2022, appendix B; torchtitan's ``get_num_flop_per_token``): ``6 * N_matmul + 12 * L * H * S``.

    ``N_matmul``: the weights that multiply every token (per layer qkv, o_proj and the SwiGLU or the
    MoE layer's active weights, plus the LM head even when tied: its matmul runs either way; not the
    embedding lookup or the norms); 6 = 2 (multiply-add) x 3 (forward, backward for activations and
    for weights). ``12 * L * H * S``: attention scores and the weighted sum over the full S x S
    matrix (``attention_flops_per_token``). A property of the model, not of this implementation, so
    that MFU compares across codebases: recomputation (``llama_parallelize_costs.
    hardware_flops_per_token`` adds it, for HFU), vocabulary padding, the causal mask and the
    document mask are not counted (attention is charged its full S x S, the upper bound)."""
    return 6 * parameter_count(args).matmul + attention_flops_per_token(args, seq_len)
