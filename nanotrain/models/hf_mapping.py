"""The Hugging Face <-> nanotrain tensor names and layout, shared by every family, in one place.

Why one place: converters elsewhere (nanotron, torchtitan, gpt-neox) are known for weights that
load without error and still compute another function (fused q/k/v or gate/up rows in another
order, experts in another order). Everything that decides how a tensor of one side becomes a
tensor of the other lives here and in the family modules beside it (``hf_llama``, ``hf_mistral``,
``hf_qwen``, ``hf_smollm3``, ``hf_moe``, their config.json in ``hf_config_json``), and the
import, the export, the pre-launch checks and the tests all read it. Pure Python (no torch,
no transformers): ``submit.py`` checks a HF directory before a launch without importing torch.

The layout facts (proven against transformers by tests/test_hf.py and tests/test_hf_mapping.py):

* nanotrain's fused ``attn.qkv.weight`` (and ``attn.qkv.bias``) holds the rows
  ``[q_proj | k_proj | v_proj]``, ``mlp.gate_up.weight`` the rows ``[gate_proj | up_proj]``;
  every other dense tensor is one HF tensor under another name.
* An MoE layer's experts are stacked: ``mlp.experts.gate_up.weight`` ``[E, 2F, H]`` (expert e's
  rows ``[gate | up]``), ``mlp.experts.down.weight`` ``[E, H, F]``; on disk each expert is its own
  tensors (Mixtral ``w1`` gate / ``w3`` up / ``w2`` down, Qwen3-MoE ``gate_proj`` / ``up_proj`` /
  ``down_proj``): a ``Piece`` with ``lead`` set. transformers 5.x also reads and writes (with
  ``save_original_format=False``) fused ``mlp.experts.gate_up_proj`` / ``down_proj`` stacks of
  exactly nanotrain's layout: read too (``fused=True``), never written.
* RoPE rotates the two halves of each head (``rotate_half``) as HF does: no row permutation.
* The vocabulary is never padded in a checkpoint, so its rows map 1:1; a HF vocabulary smaller
  than ``model.vocab_size`` fills the first rows (the others keep nanotrain's seeded init).
* Tied embeddings: HF stores ``model.embed_tokens.weight`` only (an ``lm_head.weight`` beside it
  is ignored on import and never written on export); nanotrain has no ``lm_head``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nanotrain.config import ModelArgs
from nanotrain.models import llama_arch


@dataclass(frozen=True)
class Piece:
    """Rows ``[start, stop)`` (dim 0) of a nanotrain tensor are the HF tensor ``hf_name``'s rows
    ``[0, stop - start)``. With ``lead`` set the nanotrain tensor is a 3-D expert stack and the
    rows are those of its expert ``lead`` (``tensor[lead, start:stop]``)."""

    hf_name: str
    start: int
    stop: int
    lead: int | None = None


def head_dim(args: ModelArgs) -> int:
    """Features per attention head: ``model.head_dim``, else hidden / heads (what the model and
    every family's ``getattr(config, "head_dim", ...)`` compute)."""
    return args.head_dim or args.hidden_size // args.num_attention_heads


def nanotrain_shapes(args: ModelArgs) -> dict[str, tuple[int, ...]]:
    """Every parameter of the full model with its unsharded shape, in forward order (export
    writes in this order): the names ``LlamaModel`` gives them for ``args``'s options."""
    h, d, f = args.hidden_size, head_dim(args), args.intermediate_size
    q, kv = args.num_attention_heads * d, llama_arch.kv_heads(args) * d
    out: dict[str, tuple[int, ...]] = {"embed.weight": (args.vocab_size, h)}
    for i in range(args.num_layers):
        p = f"layers.{i}."
        out[p + "input_norm.weight"] = (h,)
        out[p + "attn.qkv.weight"] = (q + 2 * kv, h)
        if args.qkv_bias:
            out[p + "attn.qkv.bias"] = (q + 2 * kv,)
        if args.qk_norm:
            out[p + "attn.q_norm.weight"] = (d,)
            out[p + "attn.k_norm.weight"] = (d,)
        out[p + "attn.o_proj.weight"] = (h, q)
        out[p + "post_attn_norm.weight"] = (h,)
        if llama_arch.is_moe_layer(args, i):
            e, fe, shared = args.moe.num_experts, llama_arch.expert_ffn(args), args.moe.num_shared_experts
            out[p + "mlp.router.weight"] = (e, h)
            out[p + "mlp.experts.gate_up.weight"] = (e, 2 * fe, h)
            out[p + "mlp.experts.down.weight"] = (e, h, fe)
            if shared:
                out[p + "mlp.shared.gate_up.weight"] = (2 * shared * fe, h)
                out[p + "mlp.shared.down.weight"] = (h, shared * fe)
        else:
            out[p + "mlp.gate_up.weight"] = (2 * f, h)
            out[p + "mlp.down.weight"] = (h, f)
    out["final_norm.weight"] = (h,)
    if not args.tie_word_embeddings:
        out["lm_head.weight"] = (args.vocab_size, h)
    return out


def nanotrain_names(args: ModelArgs) -> list[str]:
    """Every parameter name of the full model, in forward order."""
    return list(nanotrain_shapes(args))


# nanotrain field of a decoder layer -> the HF tensor under ``model.layers.{i}.`` (one piece)
_LAYER = {
    "input_norm.weight": "input_layernorm.weight",
    "attn.o_proj.weight": "self_attn.o_proj.weight",
    "attn.q_norm.weight": "self_attn.q_norm.weight",
    "attn.k_norm.weight": "self_attn.k_norm.weight",
    "post_attn_norm.weight": "post_attention_layernorm.weight",
    "mlp.down.weight": "mlp.down_proj.weight",
}


class Layout:
    """The tensor side of a family's mapping: names and shapes, both directions. A family with
    experts overrides ``expert_pieces``; the dense tensors are named alike in every family here."""

    ARCHITECTURE = "LlamaForCausalLM"
    MODEL_TYPE = "llama"

    def pieces(self, name: str, args: ModelArgs, hf_vocab: int | None = None, fused: bool = False) -> list[Piece]:
        """The HF tensors that nanotrain's ``name`` is made of. ``hf_vocab``: rows the HF side
        has of the embedding / LM head (default ``model.vocab_size``); ``fused``: the directory
        holds transformers 5.x's fused expert stacks instead of one tensor per expert."""
        vocab = args.vocab_size if hf_vocab is None else hf_vocab
        if name == "embed.weight":
            return [Piece("model.embed_tokens.weight", 0, vocab)]
        if name == "lm_head.weight":
            return [Piece("lm_head.weight", 0, vocab)]
        if name == "final_norm.weight":
            return [Piece("model.norm.weight", 0, args.hidden_size)]
        prefix, _, rest = name.partition(".")
        layer, _, field = rest.partition(".")
        if prefix != "layers" or not layer.isdigit():
            raise KeyError(f"no Hugging Face counterpart for {name!r}")
        hf = f"model.layers.{layer}."
        if field in ("attn.qkv.weight", "attn.qkv.bias"):
            q = args.num_attention_heads * head_dim(args)
            kv = llama_arch.kv_heads(args) * head_dim(args)
            kind = field.rsplit(".", 1)[1]
            return [
                Piece(f"{hf}self_attn.q_proj.{kind}", 0, q),
                Piece(f"{hf}self_attn.k_proj.{kind}", q, q + kv),
                Piece(f"{hf}self_attn.v_proj.{kind}", q + kv, q + 2 * kv),
            ]
        if field == "mlp.gate_up.weight":
            f = args.intermediate_size
            return [Piece(hf + "mlp.gate_proj.weight", 0, f), Piece(hf + "mlp.up_proj.weight", f, 2 * f)]
        if field in ("attn.q_norm.weight", "attn.k_norm.weight"):
            return [Piece(hf + _LAYER[field], 0, head_dim(args))]
        if field in _LAYER:
            return [Piece(hf + _LAYER[field], 0, args.hidden_size)]  # norms, o_proj, down: hidden rows
        if field.startswith(("mlp.router.", "mlp.experts.")):
            return self.expert_pieces(hf, field, args, fused)
        raise KeyError(f"no Hugging Face counterpart for {name!r} in {self.ARCHITECTURE}")

    def expert_pieces(self, hf: str, field: str, args: ModelArgs, fused: bool) -> list[Piece]:
        """An MoE layer's router and expert stacks (``hf``: ``model.layers.{i}.``)."""
        raise KeyError(f"{self.ARCHITECTURE} has no experts (layers.*.{field})")

    def hf_shapes(
        self, args: ModelArgs, hf_vocab: int | None = None, fused: bool = False
    ) -> dict[str, tuple[int, ...]]:
        """Every HF tensor the model needs, with its shape, in nanotrain's forward order (a tied
        model has no ``lm_head.weight``)."""
        out: dict[str, tuple[int, ...]] = {}
        for name, shape in nanotrain_shapes(args).items():
            for p in self.pieces(name, args, hf_vocab, fused):
                out[p.hf_name] = (p.stop - p.start, *shape[1 if p.lead is None else 2 :])
        return out
