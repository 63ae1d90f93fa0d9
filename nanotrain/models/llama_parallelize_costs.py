"""What the Llama's parallelize plan (``llama_parallelize.py``) costs, torch-free: what one rank
keeps for backward, in bytes, per decoder layer (dense or MoE, under tp, sequence parallelism,
cp and each ``training.recompute`` mode), the last stage's head and its logits in one piece or
in chunks (``training.loss_chunk_tokens``, resolved here: ``loss_chunk_tokens``,
``head_chunk_rows``); and the FLOPs recompute and the chunks' rerun add (HFU). Built on
``llama_arch`` (shapes, blocks, parameters, model FLOPs); the ``--dry-run`` memory estimate
(``estimate/memory.py``) and ``--plan`` sum these.

What THIS implementation's autograd keeps (measured by benchmarks/memory.py with saved-tensor
hooks, unique storages; tests/test_memory_measured.py holds it within 15%), not Megatron's
paper count: its fp32 RMSNorm internals, fused qkv / gate-up outputs, RoPE copies, the SDPA
output and log-sum-exp, and, under autocast, the bf16 weight copies each linear saves. The
head's backward peak is what its allocations reach (``benchmarks/memory.py --loss`` on CPU,
``--rehearse`` at real shapes: tests/test_chunked_loss.py, tests/test_estimate_rehearsed.py).
"""

from __future__ import annotations

from nanotrain.config import Config, ModelArgs
from nanotrain.models.llama_arch import (
    attention_flops_per_token,
    expert_ffn,
    head_dim,
    is_moe_layer,
    kv_heads,
    layer_matmul_parameters,
    query_features,
    training_flops_per_token,
    vocab_rows_per_rank,
)

RECOMPUTE_MODES = ("none", "selective", "full")
# The chunked loss (``training.loss_chunk_tokens`` null): on from the 32k vocabularies (Llama 2,
# Mistral 7B, TinyLlama: 32000) up, whose logits outweigh a decoder layer's activations at
# hidden sizes up to ~4k; 2048 tokens a chunk keeps each matmul large enough to run at full
# speed on a GPU (2048 x hidden x vocab/tp) while its logits are 1/4 of an 8192-token
# micro-batch's (a 128k vocabulary: 1 GB of fp32 logits per chunk instead of 4 GB).
LOSS_CHUNK_MIN_VOCAB = 32000
LOSS_CHUNK_TOKENS = 2048


def check_recompute(mode: str) -> str:
    """``mode`` if it is a ``training.recompute`` value, else ValueError naming the choices."""
    if mode not in RECOMPUTE_MODES:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE_MODES)}, got {mode!r}")
    return mode


def loss_chunk_tokens(config: Config) -> int:
    """``training.loss_chunk_tokens`` resolved for ``config``'s layout: the setting itself (0: off),
    or for null ``LOSS_CHUNK_TOKENS`` where the vocabulary has ``LOSS_CHUNK_MIN_VOCAB`` tokens or
    more and chunks of that size lower the head's peak on the last stage, else 0. Chunks are not
    free: while they run, autograd holds the fp32 sum of their LM head weight gradients (``4 x
    vocab/tp x hidden`` bytes) beside one chunk's logits; a micro-batch of few tokens for its
    hidden size saves less than that (``head_saved_bytes + head_backward_bytes``, both ways)."""
    setting = config.training.loss_chunk_tokens
    if setting is not None:
        return setting
    if config.model.vocab_size < LOSS_CHUNK_MIN_VOCAB:
        return 0
    rows, shards = _head_rows(config)
    chunk = loss_chunk_rows(LOSS_CHUNK_TOKENS, rows, shards)
    return LOSS_CHUNK_TOKENS if chunk and _head_peak(config, chunk) < _head_peak(config, 0) else 0


def loss_chunk_rows(chunk_tokens: int, rows: int, shards: int = 1) -> int:
    """Rows of a rank's ``rows``-token hidden state that one chunk of the loss takes, or 0 when the
    head runs in one piece (chunking off, or a single chunk would hold every row). ``shards``: the
    ranks whose rows one chunk's logits cover (tp under sequence parallelism, where the LM head
    gathers the chunk's rows of every tp rank), so that a chunk's logits stay ``chunk_tokens``
    rows whatever the layout; at least one row a rank."""
    if chunk_tokens <= 0:
        return 0
    per_rank = max(1, chunk_tokens // shards)
    return per_rank if per_rank < rows else 0


def head_chunk_rows(config: Config) -> int:
    """``loss_chunk_rows`` of a micro-batch on the last stage of ``config``'s layout (0: the head
    runs in one piece)."""
    rows, shards = _head_rows(config)
    return loss_chunk_rows(loss_chunk_tokens(config), rows, shards)


def _head_rows(config: Config) -> tuple[int, int]:
    """(rows of a rank's hidden state per micro-batch, tp ranks one chunk's logits cover): the
    ``micro_batch_size x sequence_length / cp`` tokens, ``/ tp`` of them under sequence
    parallelism."""
    p, t = config.parallelism, config.training
    shards = p.tp if p.tp_mode == "REDUCE_SCATTER" else 1
    return t.micro_batch_size * (t.sequence_length // p.cp) // shards, shards


def _head_peak(config: Config, chunk_rows: int) -> float:
    """The head's bytes at its peak for one micro-batch: what it keeps and what backward adds."""
    p, t = config.parallelism, config.training
    local = t.sequence_length // p.cp
    return head_saved_bytes(config.model, local, t.micro_batch_size, p.tp, p.tp_mode, chunk_rows) + head_backward_bytes(
        config.model, local, t.micro_batch_size, p.tp, p.tp_mode, chunk_rows
    )


def hardware_flops_per_token(args: ModelArgs, seq_len: int, recompute: str = "none", chunked_loss: bool = False) -> int:
    """FLOPs the hardware executes per training token, for HFU: the model FLOPs plus what
    ``training.recompute`` runs again in backward — ``full`` one more forward of every decoder
    layer (its matmuls, ``2 * N_layer`` each with an MoE layer's active weights, and attention
    ``4 * L * H * S``), ``selective`` the attention core's forward (``4 * L * H * S``; the SwiGLU
    activation is elementwise, not counted) — and, with ``chunked_loss`` (``head_chunk_rows``),
    the LM head's forward again (``2 * H * V``: each chunk's logits are recomputed in backward)."""
    model = training_flops_per_token(args, seq_len)
    attention_forward = attention_flops_per_token(args, seq_len) // 3
    head = 2 * args.hidden_size * args.vocab_size if chunked_loss else 0
    if recompute == "full":
        layers = sum(layer_matmul_parameters(args, moe=is_moe_layer(args, i)) for i in range(args.num_layers))
        return model + 2 * layers + attention_forward + head
    if recompute == "selective":
        return model + attention_forward + head
    return model + head


def compute_bytes(args: ModelArgs) -> int:
    """Bytes of one activation value in the compute dtype (bf16/fp16 under autocast, else fp32)."""
    return 2 if args.dtype in ("bfloat16", "float16") else 4


def activation_bytes_per_layer(
    args: ModelArgs,
    sequence_length: int,
    micro_batch_size: int,
    *,
    tp: int = 1,
    tp_mode: str = "ALL_REDUCE",
    cp: int = 1,
    recompute: str = "none",
    cpu: bool = False,
) -> float:
    """Bytes one decoder layer keeps for backward, per micro-batch in flight, on one rank.

    Per token of this rank's ``n = s/cp * b`` (``c`` = compute-dtype bytes, t = tp, sequence
    parallelism divides the replicated part by t):
    * two RMSNorms: the fp32 input (a copy under autocast), ``x * rsqrt`` (fp32), rsqrt (one
      fp32 per token), replicated (``/t`` under REDUCE_SCATTER): ``2 * (8h + 4)``;
    * the two column linears' inputs (the norm outputs; gathered over the whole sequence under
      REDUCE_SCATTER): ``2 * c * h``;
    * attention, ``/t``, with ``q = heads * head_dim`` query features (``h`` unless
      ``model.head_dim`` sets it apart): the qkv output ``c (q + 2 kv)`` (its v part is SDPA's
      input), rotated q ``c q`` and k ``c kv`` (a ``no_rope_layers`` layer keeps no rotated copy:
      counted as rotating, the estimate errs high there), the SDPA output (the o_proj input)
      ``c q``, its log-sum-exp ``4 heads``; with ``qk_norm`` the two per-head RMSNorms keep
      ``x * rsqrt`` (fp32) and rsqrt (one fp32 per head) and, under autocast, their fp32 input
      copy: ``(4 or 8) (q + kv) + 4 (heads + kv_heads)``. Under cp the local k and v are not kept
      but the gathered ones of the whole sequence are (``2 c kv * cp``), the two causal chunks'
      outputs are concatenated into a copy (another ``c q``); on CPU (``cpu``) each chunk's
      lower-right causal mask is
      materialized (torch's CausalBias has no CPU kernel) and kept, fp32 ``[s/2cp, visible
      keys]``: ``4 (s/2cp)^2 (2cp + 1)`` per micro-batch (on GPU the efficient-attention
      kernel takes the causal variant without a mask);
    * SwiGLU, ``/t``: gate/up output ``2 c F``, ``silu(gate)`` ``c F``, the down input ``c F``;
    * autocast (bf16): every linear saves the bf16 copy of its weight, per micro-batch: 2 bytes
      per matmul parameter of the rank's layer.
    ``selective`` drops the log-sum-exp and ``silu(gate)`` (recomputed from tensors kept anyway;
    under cp also the chunks' outputs and masks);
    ``full`` keeps the layer's input only (``c h``, ``/t`` under REDUCE_SCATTER)."""
    check_recompute(recompute)
    c, h, ffn = compute_bytes(args), args.hidden_size, args.intermediate_size
    kv, heads, q = kv_heads(args) * head_dim(args), args.num_attention_heads, query_features(args)
    n = sequence_length // cp * micro_batch_size
    replicated = tp if tp_mode == "REDUCE_SCATTER" else 1
    if recompute == "full":
        return c * h * n / replicated
    norms = 2 * (8 * h + 4) / replicated + 2 * c * h
    masks = 0.0
    if cp > 1:
        attention = c * (3 * q + 2 * kv * cp) + 4 * heads
        chunk = sequence_length // (2 * cp)  # the two causal chunks' fp32 masks, [chunk, visible keys]
        masks = 4 * chunk * chunk * (2 * cp + 1) if cpu else 0.0
    else:
        attention = c * (3 * q + 3 * kv) + 4 * heads
    if args.qk_norm:  # the fp32 input copy only under autocast (an fp32 q is a view of the qkv output)
        attention += (8 if c < 4 else 4) * (q + kv) + 4 * (heads + kv_heads(args))
    mlp = 4 * c * ffn
    if recompute == "selective":  # cp: the chunks' outputs and masks live inside the region too
        attention -= 4 * heads + (c * q if cp > 1 else 0)
        mlp -= c * ffn
        masks = 0.0
    weights = 2 * layer_matmul_parameters(args) / tp if c == 2 else 0
    return n * (norms + (attention + mlp) / tp) + masks + weights


def head_saved_bytes(
    args: ModelArgs,
    local_tokens: int,
    micro_batch_size: int,
    tp: int = 1,
    tp_mode: str = "ALL_REDUCE",
    chunk_rows: int = 0,
) -> float:
    """What the last stage's head keeps per micro-batch: the final RMSNorm (as a layer's) and
    its output, the logits (fp32) over this tp rank's padded vocabulary rows and, under
    autocast, the LM head weight's copy in the compute dtype (each micro-batch's forward casts
    its own). Under the chunked loss (``chunk_rows``, ``head_chunk_rows``) only the hidden state
    the chunks start from, in the compute dtype (this rank's ``1/tp`` of the tokens under
    sequence parallelism)."""
    n, h, c = local_tokens * micro_batch_size, args.hidden_size, compute_bytes(args)
    replicated = tp if tp_mode == "REDUCE_SCATTER" else 1
    if chunk_rows:
        return n / replicated * c * h
    rows = vocab_rows_per_rank(args, tp)
    return n * ((8 * h + 4) / replicated + c * h + 4 * rows) + (rows * h * c if c < 4 else 0)


def moe_extra_activation_bytes(
    args: ModelArgs,
    sequence_length: int,
    micro_batch_size: int,
    *,
    tp: int = 1,
    tp_mode: str = "ALL_REDUCE",
    cp: int = 1,
    recompute: str = "none",
) -> float:
    """What an MoE layer keeps for backward beyond a dense layer's count, per micro-batch, 2 bytes
    a value (an estimate in Megatron's spirit): each of the k copies of a token holds its row
    before and after the all-to-all (2 * h) and its expert's gate, up and activation (3 * F_e),
    instead of the dense MLP's 3 * F / tp; the router's fp32 logits and probabilities (2 * E,
    4 bytes). Routed tokens are this rank's s/cp, divided by tp under REDUCE_SCATTER only (the
    routed experts are not split over tp). ``recompute``: ``full`` keeps the layer's input only
    (``activation_bytes_per_layer`` counts it), ``selective`` drops each SwiGLU's ``silu(gate)``
    (one of the three F values, routed and shared, as the dense MLP's)."""
    if args.moe is None or check_recompute(recompute) == "full":
        return 0.0
    m = args.moe
    s, b, h = sequence_length // cp, micro_batch_size, args.hidden_size
    routed = s * b // (tp if tp_mode == "REDUCE_SCATTER" else 1)
    kept = 2 if recompute == "selective" else 3  # F-wide values per SwiGLU (the dense count is adjusted alike)
    values = routed * m.top_k * (2 * h + kept * expert_ffn(args)) - s * b * kept * args.intermediate_size / tp
    values += s * b * kept * m.num_shared_experts * expert_ffn(args) / tp
    return 2 * values + routed * 2 * m.num_experts * 4


def head_backward_bytes(
    args: ModelArgs,
    local_tokens: int,
    micro_batch_size: int,
    tp: int = 1,
    tp_mode: str = "ALL_REDUCE",
    chunk_rows: int = 0,
) -> float:
    """What the head's backward adds at its peak, beside ``head_saved_bytes`` (``_head_backward_peak``).
    Chunked (``chunk_rows``, this rank's rows per chunk, ``x tp`` gathered under sequence
    parallelism): the hidden state's gradient, filled chunk by chunk, and the larger of the
    first chunk rerun and taken back (its LM head weight gradient then copied into the fp32 sum)
    and the largest later one (beside that sum); each chunk casts its own weight copy, autocast's
    cache being off inside a chunk."""
    n, rep = local_tokens * micro_batch_size, (tp if tp_mode == "REDUCE_SCATTER" else 1)
    if not chunk_rows:
        return _head_backward_peak(args, n, tp, tp_mode) - head_saved_bytes(args, n, 1, tp, tp_mode)
    rows = n // rep
    count = -(-rows // chunk_rows)
    later = chunk_rows if count > 2 else rows - chunk_rows
    first = _head_backward_peak(args, chunk_rows * rep, tp, tp_mode, copies_sum=True)
    rest = _head_backward_peak(args, later * rep, tp, tp_mode, beside_sum=True)
    return max(first, rest) + rows * compute_bytes(args) * args.hidden_size


def _head_backward_peak(
    args: ModelArgs, tokens: int, tp: int, tp_mode: str, copies_sum: bool = False, beside_sum: bool = False
) -> float:
    """The head's bytes at the peak of its backward over ``tokens`` (gathered) tokens: its saved
    tensors (``head_saved_bytes``) until the largest of these moments (``c`` compute-dtype bytes):
    * the loss's backward: without tp torch's cross-entropy keeps its fp32 log-softmax while the
      nll gradient and the log-softmax gradient exist, both fp32 (``4 + 8`` bytes a logit); the
      vocab-parallel loss (tp > 1) makes one fp32 gradient from its saved softmax and, under
      autocast, its copy in the compute dtype (``4 + 4 + c``); the LM head's saved weight copy
      (``c`` a weight, under autocast) waits beside them;
    * the LM head's matmul backward: the logits' gradient (``c`` a logit), the weight copy and
      the weight's gradient in the compute dtype;
    * under autocast, that gradient's fp32 cast beside it;
    * ``copies_sum`` (the chunked loss's first chunk, its graph gone): the fp32 gradient and its
      copy, the sum.
    The final norm's saved tensors and the LM head's input stay through the first three; with
    ``beside_sum`` (a later chunk) the fp32 sum of the weight gradients stays through all."""
    c, h, rows = compute_bytes(args), args.hidden_size, vocab_rows_per_rank(args, tp)
    low = c if c < 4 else 0  # autocast: the low-precision copies
    norm = head_saved_bytes(args, tokens, 1, tp, tp_mode) - 4 * tokens * rows - rows * h * low
    loss = tokens * rows * (12 if tp == 1 else 8 + low) + rows * h * low
    matmul = tokens * rows * c + rows * h * (low + c)
    cast = rows * h * (c + 4) if low else 0
    copy = 8 * rows * h if copies_sum else 0
    return max(norm + max(loss, matmul, cast), copy) + (4 * rows * h if beside_sum else 0)


def logits_bytes(args: ModelArgs, local_tokens: int, micro_batch_size: int, tp: int = 1) -> int:
    """The last stage's fp32 logits and their gradient for ``local_tokens`` per sequence, over
    this tp rank's (padded) vocabulary rows."""
    return local_tokens * micro_batch_size * vocab_rows_per_rank(args, tp) * 4 * 2
