"""Document masking (``data.document_masking``, issue 30) in one process: what the sampler hands
out, and that the masked model is exactly each document run on its own.

* The sampler on a hand-made token stream (read in order): per-token document ids restart at each
  separator and at each window's start, the separators' targets are -100 under
  ``data.mask_boundary_loss``, and with both options off the micro-batches are today's pairs; the
  prefetcher carries the ids to the device with the batch.
* Exact reference (float64, 1e-10): a packed window's loss and every gradient equal the sum over
  its documents, each run through the model alone with positions from 0 (lengths 1 to 8, one cut
  by the window's end, one ending at it), on a model with GQA, q/k norms, a qkv bias and a layer
  without RoPE; with the boundary loss kept, the difference is exactly the separators' predictions
  of the next document's first token.
* transformers' ``LlamaForCausalLM`` given the same ``position_ids`` and the block-diagonal causal
  4-D mask computes the same logits (float64, 1e-10).
* Recompute (selective, full) is bit-identical to none with masks; bf16 stays near fp32.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from nanotrain.config import ModelArgs
from nanotrain.data.dataset import TokenDataset
from nanotrain.data.sampler import GlobalSampler, SourcePart, document_ids
from nanotrain.models.llama import param_seed
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.parallel.context_parallel import zigzag_table
from nanotrain.parallel.cp_balance import balanced_order
from nanotrain.parallel.documents import document_attention, document_positions

SEP = 0
ARGS = ModelArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    qkv_bias=True,
    qk_norm=True,
    no_rope_layers=[1],
    max_position_embeddings=32,
    dtype="float32",
    init_std=0.3,  # sharp attention: what a token sees and where it sits change the loss a lot
)
SEQ = 24
# Separator positions among each row's SEQ inputs: row 0 holds a length-1 document (the lone
# separator at 4) and ends in a document cut by the window's end; row 1 starts with a length-1
# document and ends with a separator (its target, the next window's first token, is a boundary).
SEPARATORS = ([3, 4, 10, 17], [0, 12, 23])


def packed_rows() -> torch.Tensor:
    """[2, SEQ + 1] windows: random non-separator tokens, separators at ``SEPARATORS``."""
    rows = torch.randint(1, ARGS.vocab_size, (2, SEQ + 1), generator=torch.Generator().manual_seed(3))
    for r, where in enumerate(SEPARATORS):
        rows[r, where] = SEP
    return rows


def model(args: ModelArgs = ARGS, **plan):
    """The one-process model, its biases and q/k norm weights away from 0 and 1 (seeded)."""
    part = build_llama(args, None, seed=5, **plan)
    with torch.no_grad():
        for name, p in part.named_parameters():
            gen = torch.Generator().manual_seed(param_seed(5, name))
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
    return part


def grads_of(part, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    part.zero_grad()
    loss.backward()
    return {n: p.grad.clone() for n, p in part.named_parameters()}


# ----------------------------------------------------------------------------- sampler
def hand_made_sampler(**options) -> GlobalSampler:
    """Windows of 8 inputs over a stream whose documents are 3, 2, 1, 5, 3 and 10+ tokens long."""
    stream = [5, 6, SEP, 7, SEP, SEP, 8, 9, 9, 9, SEP, 3, 4, SEP] + [2] * 10 + [SEP, 1]
    ds = TokenDataset(
        tokens=np.array(stream, dtype=np.uint16),
        seq_len=8,
        separator_id=SEP,
        tokenizer_vocab_size=16,
        num_documents=6,
        path="",
        from_cache=True,
    )
    return GlobalSampler(
        [SourcePart("hand", ds, shuffle=False)], seed=0, dp=1, micro_batch_size=1, batch_accumulation=3, **options
    )


def test_sampler_gives_document_ids_restarting_at_separators_and_windows():
    batch = hand_made_sampler(document_masking=True, mask_boundary_loss=True).batch(0, 0)
    assert [len(mb) for mb in batch] == [3, 3, 3]
    ids, targets, docs = (torch.stack([mb[i][0] for mb in batch]) for i in range(3))
    assert ids.tolist() == [[5, 6, 0, 7, 0, 0, 8, 9], [9, 9, 0, 3, 4, 0, 2, 2], [2, 2, 2, 2, 2, 2, 2, 2]]
    assert docs.tolist() == [[0, 0, 0, 1, 1, 2, 3, 3], [0, 0, 0, 1, 1, 1, 2, 2], [0] * 8]
    assert targets.tolist() == [
        [6, 0, -100, 0, -100, -100, 9, 9],
        [9, 0, -100, 4, 0, -100, 2, 2],
        [2, 2, 2, 2, 2, 2, 2, 0],  # the last window's target separator is kept: it ends a document
    ]
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 0, 1, 2, 0, 1], list(range(8))]
    assert all(t.dtype == torch.int64 and t.shape == (1, 8) for mb in batch for t in mb)


def test_cp_balance_adds_each_micro_batch_token_order():
    plain = hand_made_sampler(document_masking=True).batch(0, 0)
    batch = hand_made_sampler(document_masking=True, cp_balance=2).batch(0, 0)
    assert [len(mb) for mb in batch] == [4, 4, 4]
    for (*same, order), expected in zip(batch, plain):
        assert all(torch.equal(a, b) for a, b in zip(same, expected))
        assert order.dtype == torch.int64 and torch.equal(order, torch.from_numpy(balanced_order(same[2], 2)))
    assert not torch.equal(batch[1][3], zigzag_table(8, 2))  # the second window's documents leave zig-zag


def test_options_off_are_todays_pairs_and_boundary_loss_alone_masks_targets():
    plain = hand_made_sampler().batch(0, 0)
    windows = torch.from_numpy(hand_made_sampler().samples(0, 3))
    assert [len(mb) for mb in plain] == [2, 2, 2]
    for mb, w in zip(plain, windows):
        assert torch.equal(mb[0], w[None, :-1]) and torch.equal(mb[1], w[None, 1:])
    masked = hand_made_sampler(mask_boundary_loss=True).batch(0, 0)
    assert [len(mb) for mb in masked] == [2, 2, 2]
    for (ids, targets), (_, plain_targets) in zip(masked, plain):
        assert torch.equal(targets, plain_targets.masked_fill(ids == SEP, -100))


def test_prefetcher_moves_document_ids_with_the_batch():
    from nanotrain.data import BatchPrefetcher

    sampler = hand_made_sampler(document_masking=True)
    on_device = BatchPrefetcher(sampler, 0, torch.device("meta"))  # stands in for an accelerator
    on_device.prefetch(3)
    for consumed in (3, 0):  # prefetched, then not
        got = on_device.get(consumed)
        assert [len(mb) for mb in got] == [3] * 3 and all(t.device.type == "meta" for mb in got for t in mb)
    assert all(len(mb) == 3 for mb in BatchPrefetcher(sampler, 0, torch.device("cpu")).get(0))


# ----------------------------------------------------------------------------- the model
def documents_alone(part, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed token loss of every document of every row, each run through ``part`` on its own
    (a [1, length] batch, positions from 0)."""
    total = torch.zeros((), dtype=torch.float64)
    for row, row_targets in zip(ids, targets):
        docs = document_ids(row, SEP)
        for d in docs.unique():
            keep = docs == d
            total = total + part(row[keep][None], row_targets[keep][None]) * int(keep.sum())
    return total


def test_packed_window_equals_each_document_alone_in_float64():
    part = model().double()
    rows = packed_rows()
    ids, targets = rows[:, :-1], rows[:, 1:].masked_fill(rows[:, :-1] == SEP, -100)  # boundary loss masked
    docs = document_ids(ids, SEP)
    lengths = torch.cat([torch.bincount(d) for d in docs]).tolist()
    assert 1 in lengths and max(lengths) >= 7 and ids[0, -1] != SEP and ids[1, -1] == SEP
    packed = part(ids, targets, documents=docs) * ids.numel()  # the mean counts ignored tokens as 0
    reference = documents_alone(part, ids, targets)
    assert abs(packed.item() - reference.item()) <= 1e-10 * abs(reference.item())
    got, want = grads_of(part, packed), grads_of(part, reference)
    for name in want:
        scale = want[name].abs().max().item()
        assert scale > 0 and (got[name] - want[name]).abs().max().item() <= 1e-10 * scale, name
    with torch.no_grad():  # the comparison sees the mask, and the positions on their own
        logits = part(ids, documents=docs)
        inner = part.inner
        positions_only = inner.head(inner.run_layers(inner.embed_tokens(ids), None, document_positions(docs).t()))
        for other in (part(ids), positions_only):
            assert (other - logits).abs().max().item() > 1e-2 * logits.abs().max().item()


def test_kept_boundary_loss_adds_each_separators_prediction_of_the_next_document():
    part = model().double()
    rows = packed_rows()
    ids, targets = rows[:, :-1], rows[:, 1:]
    docs = document_ids(ids, SEP)
    with torch.no_grad():
        kept = part(ids, targets, documents=docs).item() * ids.numel()
        masked = documents_alone(part, ids, targets.masked_fill(ids == SEP, -100)).item()
        boundary = 0.0
        for r, where in enumerate(SEPARATORS):
            for i in where:  # the separator's logits are its document's alone: its last token's
                start = int((docs[r] == docs[r, i]).nonzero()[0])
                logits = part(ids[r, start : i + 1][None])[-1, 0]
                boundary -= torch.log_softmax(logits, -1)[targets[r, i]].item()
    assert abs(kept - (masked + boundary)) <= 1e-10 * abs(kept)


def hf_state_dict(part) -> dict[str, torch.Tensor]:
    """nanotrain's parameters under transformers' Llama names (qkv and gate_up split)."""
    p = {n: t.detach() for n, t in part.named_parameters()}
    q, kv = ARGS.num_attention_heads * 8, ARGS.num_key_value_heads * 8
    out = {"model.embed_tokens.weight": p["embed.weight"], "lm_head.weight": p["lm_head.weight"]}
    out["model.norm.weight"] = p["final_norm.weight"]
    for i in range(ARGS.num_layers):
        hf, mine = f"model.layers.{i}.", f"layers.{i}."
        for name, t in zip("qkv", p[mine + "attn.qkv.weight"].split([q, kv, kv])):
            out[f"{hf}self_attn.{name}_proj.weight"] = t
        out[hf + "self_attn.o_proj.weight"] = p[mine + "attn.o_proj.weight"]
        out[hf + "mlp.gate_proj.weight"], out[hf + "mlp.up_proj.weight"] = p[mine + "mlp.gate_up.weight"].chunk(2)
        out[hf + "mlp.down_proj.weight"] = p[mine + "mlp.down.weight"]
        out[hf + "input_layernorm.weight"] = p[mine + "input_norm.weight"]
        out[hf + "post_attention_layernorm.weight"] = p[mine + "post_attn_norm.weight"]
    return out


def test_equals_transformers_given_position_ids_and_a_block_diagonal_mask():
    transformers = pytest.importorskip("transformers")
    from helpers.hf_reference import in_float64

    args = dataclasses.replace(ARGS, head_dim=None, qkv_bias=False, qk_norm=False, no_rope_layers=[])  # Llama
    part = model(args).double()
    config = transformers.LlamaConfig(
        vocab_size=args.vocab_size,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        max_position_embeddings=args.max_position_embeddings,
        rms_norm_eps=args.rms_norm_eps,
        rope_theta=args.rope_theta,
        tie_word_embeddings=False,
    )
    # SDPA takes a boolean 4-D mask as given (True: attend); eager's softmax runs in float32.
    hf = transformers.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    hf.load_state_dict(hf_state_dict(part), strict=True)
    hf = in_float64(hf).eval()
    ids = packed_rows()[:, :-1]
    docs = document_ids(ids, SEP)
    _, mask = document_attention(docs)
    with torch.no_grad():
        mine = part(ids, documents=docs).transpose(0, 1)
        ref = hf(ids, attention_mask=mask, position_ids=document_positions(docs)).logits
        plain = hf(ids).logits
    scale = ref.abs().max().item()
    assert (mine - ref).abs().max().item() <= 1e-10 * scale
    assert (plain - ref).abs().max().item() > 1e-2 * scale  # the comparison sees the mask


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_recompute_reruns_the_masked_kernel_bit_identically(recompute):
    rows = packed_rows()
    ids, targets = rows[:, :-1], rows[:, 1:]
    docs = document_ids(ids, SEP)
    base, again = model(), model(recompute=recompute)
    want = grads_of(base, base(ids, targets, documents=docs))
    got = grads_of(again, again(ids, targets, documents=docs))
    assert all(torch.equal(got[n], want[n]) for n in want)


def test_bf16_masked_loss_is_near_fp32():
    rows = packed_rows()
    ids, targets = rows[:, :-1], rows[:, 1:]
    docs = document_ids(ids, SEP)
    with torch.no_grad():
        fp32 = model()(ids, targets, documents=docs).item()
        bf16 = model(compute_dtype="bfloat16")(ids, targets, documents=docs).item()
        unmasked = model(compute_dtype="bfloat16")(ids, targets).item()
    assert abs(bf16 - fp32) <= 1e-2 * fp32 < abs(unmasked - fp32)
