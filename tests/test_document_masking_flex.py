"""The FlexAttention path of document masking (``model.attention_kernel: flex``) on the CPU.

torch has FlexAttention's training kernels for CUDA only (no backward on the CPU), so the GPU
check (``benchmarks/gpu_check.sh``) compares its training step with this reference; here:

* The tile lists (``document_blocks.tile_lists``), spread back to element level the way the kernel
  reads them (full tiles whole, partial tiles through the element rule), equal the materialised
  reference mask exactly, for windows with documents of length 1, one cut by the window's end,
  tiles that split documents and lengths that are not a multiple of the tile, under every token
  order cp uses: all queries, zig-zag ranks at cp2 and cp4, and a balanced order (keys in gather
  order). A wrong rule (a tile declared full because it is below the diagonal, whatever its
  documents) is caught by the same comparison; most tiles are skipped once documents are short.
* The compiled CPU forward of FlexAttention under the block mask equals SDPA under the reference
  mask (float32, 2e-6; the CPU kernel has no float64): each cp2 rank's queries over the gathered
  keys (zig-zag and balanced, grouped-query k/v, 16-token tiles so that the kernel skips some)
  through ``ContextParallel.attention``, and the whole model (GQA, q/k norm, a layer without
  RoPE) under ``model.attention_kernel: flex`` with compiled layers (``training.compile``).
* ``resolve_kernel``: auto is flex on CUDA and the reference elsewhere; flex refuses to train on
  the CPU in one line.
* --dry-run and --plan say, under document masking, which kernel runs, that the memory estimate
  adds the materialised mask (sdpa_mask) or nothing (flex), and that MFU counts the full S x S;
  the estimate differs by exactly the mask per micro-batch in flight. A checkpoint resumes under
  another kernel (it changes how, not what, the model computes).
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
import torch

from nanotrain.config import ModelArgs
from nanotrain.models.llama_parallelize import build_llama
from nanotrain.parallel import document_blocks
from nanotrain.parallel.context_parallel import ContextParallel, cp_positions
from nanotrain.parallel.cp_balance import balanced_order, packed_documents
from nanotrain.parallel.document_blocks import document_block_mask
from nanotrain.parallel.documents import document_attention, resolve_kernel
from nanotrain.parallel.sdpa import masked_sdpa

SEQ, BLOCK = 96, 16  # small tiles: many of them on a short window, 96 = 6 tiles (cp4: 24 queries)


def windows() -> torch.Tensor:
    """[3, SEQ] document ids: lengths 1 to 40 with a length-1 document in the middle, the second
    window cutting a document at its start, and one document filling a whole window."""
    lengths = [1, 7, 16, 1, 40, 3, 1, 29, 2, 17, 50, 5, 33]
    rows = [packed_documents(lengths, SEQ, w) for w in (0, 1)] + [np.zeros(SEQ, dtype=np.int64)]
    return torch.as_tensor(np.stack(rows))


def orders(documents: torch.Tensor, cps=(2, 4)):
    """(cp, rank, balanced, query positions, key positions) of every token order attention runs
    in: the whole window, each zig-zag rank at ``cps`` (keys in position order), each rank of a
    balanced cp2 order (keys in gather order)."""
    yield 1, 0, False, None, None
    for cp in cps:
        for r in range(cp):
            yield cp, r, False, cp_positions(SEQ, cp, r), None
    order = torch.as_tensor(balanced_order(documents, 2, k=2))
    for r in range(2):
        yield 2, r, True, order[r], order.reshape(-1)


def _operands(documents, queries, keys):
    q_docs = documents if queries is None else documents.index_select(1, queries)
    q_index = torch.arange(SEQ) if queries is None else queries
    k_docs = documents if keys is None else documents.index_select(1, keys)
    return q_docs, q_index, k_docs, torch.arange(SEQ) if keys is None else keys


def _tiles(num_blocks: torch.Tensor, indices: torch.Tensor, columns: int) -> torch.Tensor:
    """A block mask's ordered lists ``[B, 1, Qt]`` / ``[B, 1, Qt, Kt]`` -> dense tiles ``[B, Qt, Kt]``."""
    listed = torch.arange(indices.shape[-1]) < num_blocks[..., None]
    dense = torch.zeros(*indices.shape[:-1], columns + 1, dtype=torch.bool)
    dense.scatter_(-1, torch.where(listed, indices.long(), columns), True)
    return dense[:, 0, :, :columns]


def emulate(block_mask, s_q: int, s_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the ``[B, S_q, S]`` mask a FlexAttention kernel computes from ``block_mask``: full tiles
    whole, partial tiles through its ``mask_mod``, others skipped; its partial and full tiles)."""
    block_q, block_k = block_mask.BLOCK_SIZE
    columns = block_mask.kv_indices.shape[-1]
    partial = _tiles(block_mask.kv_num_blocks, block_mask.kv_indices, columns)
    full = _tiles(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, columns)
    b = torch.arange(partial.shape[0])[:, None, None]
    q, k = torch.arange(s_q)[None, :, None], torch.arange(s_k)[None, None, :]
    elements = block_mask.mask_mod(b, 0, q, k)

    def spread(tiles):
        return tiles.repeat_interleave(block_q, 1).repeat_interleave(block_k, 2)[:, :s_q, :s_k]

    return spread(full) | (spread(partial) & elements), partial, full


def _attended_tiles(mask: torch.Tensor, block: int) -> torch.Tensor:
    """``[B, S_q/block, S/block]``: the tiles of a ``[B, S_q, S]`` mask holding an attended pair."""
    padded = torch.nn.functional.pad(mask, (0, -mask.shape[2] % block, 0, -mask.shape[1] % block))
    return padded.unflatten(1, (-1, block)).unflatten(3, (-1, block)).any(4).any(2)


@pytest.mark.parametrize("block", [BLOCK, 40])  # 40: the last tile of each side runs past the end
def test_block_mask_computes_exactly_the_reference_mask(block):
    documents = windows()
    listed = needed = 0
    for cp, *_, queries, keys in orders(documents):
        _, reference = document_attention(documents, queries, keys)
        block_mask = document_block_mask(*_operands(documents, queries, keys), block=block)
        computed, partial, full = emulate(block_mask, *reference.shape[2:])
        assert torch.equal(computed, reference[:, 0]) and not (partial & full).any()
        attended = _attended_tiles(reference[:, 0], block)
        assert torch.equal(full, full & attended)
        if cp == 1:  # tiles of consecutive tokens: exactly the tiles with an attended pair run
            assert torch.equal(partial | full, attended)
            assert block != BLOCK or attended.sum() < attended.numel() / 2  # most tiles never run
        listed, needed = listed + int((partial | full).sum()), needed + int(attended.sum())
    assert listed <= 1.1 * needed  # tiles straddling cp chunks only widen the ranges a little
    with torch.no_grad():  # what the model gets: the same lists at FlexAttention's own tile
        _, block_mask = document_attention(documents, kernel="flex")
    _, reference = document_attention(documents)
    assert block_mask.BLOCK_SIZE == (128, 128) and torch.equal(emulate(block_mask, SEQ, SEQ)[0], reference[:, 0])


def test_a_wrong_tile_rule_is_caught(monkeypatch):
    documents = windows()
    _, reference = document_attention(documents)
    right = document_blocks.tile_lists

    def below_is_full(*args, **kwargs):  # below the diagonal, documents ignored: declared full
        partial, full = right(*args, **kwargs)
        below = torch.ones_like(full).tril(-1)
        return partial & ~below, full | below

    monkeypatch.setattr(document_blocks, "tile_lists", below_is_full)
    block_mask = document_block_mask(*_operands(documents, None, None), block=BLOCK)
    assert not torch.equal(emulate(block_mask, SEQ, SEQ)[0], reference[:, 0])


def test_flex_forward_equals_sdpa_under_the_mask_for_each_cp_rank():
    warnings.simplefilter("error", UserWarning)  # e.g. flex_attention run uncompiled (materialising)
    documents = windows()
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, SEQ, 12, generator=gen) for _ in "kv")
    q_all = torch.randn(3, 4, SEQ, 12, generator=gen)
    with torch.no_grad():
        for cp_size, rank, balanced, queries, keys in orders(documents, cps=(2,)):
            if cp_size == 1:  # the whole window: the model test (a compile per query length)
                continue
            _, reference = document_attention(documents, queries, keys)
            # small tiles, so that the kernel skips some (the model's 128 cover this window whole)
            tiled = document_block_mask(*_operands(documents, queries, keys), block=BLOCK)
            q = q_all[:, :, queries]
            kk, vv = (k, v) if keys is None else (k[:, :, keys], v[:, :, keys])
            want = masked_sdpa(q, kk, vv, reference)
            # ContextParallel.attention as that rank runs it (it needs no process group)
            cp = ContextParallel(None, balance="documents" if balanced else "zigzag")
            cp.size, cp.rank = cp_size, rank
            assert (cp.attention(q, kk, vv, reference) - want).abs().max().item() <= 2e-6
            assert (cp.attention(q, kk, vv, tiled) - want).abs().max().item() <= 2e-6


ARGS = ModelArgs(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    qk_norm=True,
    no_rope_layers=[1],
    max_position_embeddings=SEQ,
    dtype="float32",
    init_std=0.3,  # sharp attention: what a token sees changes the logits a lot
)


def test_model_forward_with_flex_equals_the_reference():
    warnings.simplefilter("error", UserWarning)  # flex compiled, not run unfused, inside compiled layers
    documents = windows()
    ids = torch.randint(1, ARGS.vocab_size, documents.shape, generator=torch.Generator().manual_seed(3))
    reference = build_llama(ARGS, None, seed=5)
    # compiled layers (training.compile): flex runs outside their graphs, which read q/k wrongly
    flex = build_llama(dataclasses.replace(ARGS, attention_kernel="flex"), None, seed=5, compile_layers=True)
    with torch.no_grad():
        want, got = reference(ids, documents=documents), flex(ids, documents=documents)
        plain = reference(ids)
    scale = want.abs().max().item()
    assert (got - want).abs().max().item() <= 2e-6 * scale
    assert (plain - want).abs().max().item() > 1e-2 * scale  # the comparison sees the mask


def test_resolve_kernel_rule_and_the_cpu_training_refusal():
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert [resolve_kernel("auto", d) for d in (cpu, cuda)] == ["sdpa_mask", "flex"]
    assert resolve_kernel("sdpa_mask", cuda) == "sdpa_mask" and resolve_kernel("flex", cuda) == "flex"
    with torch.no_grad():
        assert resolve_kernel("flex", cpu) == "flex"  # the CPU forward exists (evaluation)
    with pytest.raises(ValueError, match="model.attention_kernel 'flex' cannot train on the CPU"):
        document_attention(torch.zeros(1, 8, dtype=torch.long), kernel="flex")


def test_dry_run_and_plan_say_what_memory_and_mfu_count_of_masked_attention(capsys):
    from pathlib import Path

    from nanotrain.commands.cli import main
    from nanotrain.config import load_config
    from nanotrain.estimate.memory import estimate_memory, mask_bytes

    config = Path(__file__).resolve().parents[1] / "configs" / "3d_16gpu.yaml"
    outputs = {}
    plan = ["--plan", "--gpus", "16", "--gpu-memory-gb", "80"]
    for kernel, mode in (("auto", ["--dry-run"]), ("sdpa_mask", ["--dry-run"]), ("auto", plan)):
        sets = ["data.document_masking=true", f"model.attention_kernel={kernel}"]
        assert main([str(config), *mode, *(a for s in sets for a in ("--set", s))]) == 0
        outputs[kernel, mode[0]] = capsys.readouterr().out
    for (kernel, _), out in outputs.items():
        lines = [line for line in out.splitlines() if line.startswith("document masking: ")]
        assert len(lines) == 1 and "FLOPs (MFU) count the full S x S attention, an upper bound" in lines[0]
        assert f"attention kernel {'flex' if kernel == 'auto' else 'sdpa_mask'}" in lines[0]
    assert "materialised mask" in outputs["sdpa_mask", "--dry-run"] and "(FlexAttention" in outputs["auto", "--plan"]
    assert main([str(config), "--dry-run"]) == 0 and "document masking" not in capsys.readouterr().out
    # the estimate counts what the line says: the mask per micro-batch in flight, flex nothing
    flex, dense = (
        load_config(config, ["data.document_masking=true", f"model.attention_kernel={k}"])
        for k in ("flex", "sdpa_mask")
    )
    plain = load_config(config)
    seq = plain.training.sequence_length
    assert mask_bytes(dense) == plain.training.micro_batch_size * seq * seq and mask_bytes(flex) == 0
    extra = estimate_memory(dense).activations - estimate_memory(flex).activations
    assert estimate_memory(flex).total == estimate_memory(plain).total
    assert abs(extra * 2**30 - estimate_memory(dense).in_flight * mask_bytes(dense)) < 1e-3 * mask_bytes(dense)


def test_a_checkpoint_resumes_under_another_kernel():
    from nanotrain.checkpoint.layout import model_differences

    saved = {"model": {"attention_kernel": "flex", "hidden_size": 64}}
    assert model_differences(saved, {"model": {"attention_kernel": "sdpa_mask", "hidden_size": 64}}) == []
    assert model_differences(saved, {"model": {"hidden_size": 32}}) == ["hidden_size (64 saved, 32 now)"]
